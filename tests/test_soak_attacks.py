"""The soak's attacks (benchmarks/soak_attacks.py) on a real redis-server: each damages a stored
entry so that the bank or the learner must catch it, in the way the soak counts on, and none
recreates an entry the bank deleted meanwhile; with the actors' rights too (the soak outside the
run holds only those). And how the soak finds a run's processes, its bank and its weights."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import time

import pytest
import torch
from bank_helpers import SHAPE, make_group

from benchmarks.soak_attacks import (
    FUTURE,
    bank_url,
    checkpoint_finite,
    descendants,
    flip_bits,
    non_finite,
    queued_members,
    role_pids,
    server_pids,
    untrainable,
)
from common.config import BankConfig
from learner.admit import Admission, admit
from memory_bank.bank import MemoryBank
from memory_bank.embedded import EmbeddedRedis
from memory_bank.ref import make_ref


@pytest.fixture
def disk(bank, redis_server):
    """The fixture's bank through the server owner's client: the damage comes from below the
    bank (the actors' user may run the bank's own scripts only, not the attacks' Lua guard)."""
    return MemoryBank(redis_server.admin_client(), bank.cfg)


def _queued(bank, gid="g0"):
    bank.push_group(make_group("c", gid, g=3, seed=0))
    return queued_members(bank)


@pytest.mark.parametrize("attack", [flip_bits, non_finite])
def test_a_damaged_queued_member_is_skipped_as_corrupt_and_its_group_trains_the_rest(bank, disk, attack):
    members = _queued(bank)
    eid = attack(disk, random.Random(3))
    assert eid in members
    batch = bank.pull(1, 0)
    assert sorted(t.bank_id for t in batch.fresh[0].members) == sorted(members - {eid})
    assert bank.stats()["corrupt"] >= 1


def test_a_member_from_the_future_decodes_and_is_then_quarantined_by_admission(bank, disk):
    members = _queued(bank)
    eid = untrainable(disk, random.Random(0))
    assert eid in members
    batch = bank.pull(1, 0)                        # the codec accepts the 39-digit version
    (bad,) = [t for t in batch.fresh[0].members if t.bank_id == eid]
    assert bad.policy_version == int(FUTURE)
    verdict = admit(batch, Admission(bad.spec, SHAPE), version=0)
    assert list(verdict.quarantine) == [eid] and batch.fresh == []


def test_attacks_never_recreate_a_deleted_entry(bank, disk):
    members = _queued(bank)
    for eid in members:   # the bank deleted them (as a commit or an eviction would) after they were listed
        bank.r.delete(bank.keys.blob(eid), bank.keys.meta(eid))
    rng = random.Random(1)
    for attack in (flip_bits, non_finite, untrainable):
        assert attack(disk, rng) is None
    assert not any(bank.r.exists(bank.keys.blob(e), bank.keys.meta(e)) for e in members)


@pytest.mark.parametrize("attack", [flip_bits, non_finite, untrainable])
def test_each_damage_works_with_the_actors_rights_alone(bank, attack):
    """The soak damages a live `vgrpo train`'s bank through its actors' URL (no EVAL of new code)."""
    members = _queued(bank)
    eid = attack(bank, random.Random(5))
    assert eid in members
    batch = bank.pull(1, 0)
    if attack is untrainable:
        assert int(FUTURE) in {t.policy_version for t in batch.fresh[0].members}
    else:
        assert eid not in {t.bank_id for t in batch.fresh[0].members}


def test_with_the_actors_rights_a_deleted_entry_is_not_recreated(bank):
    members = _queued(bank)
    for eid in members:
        bank.r.delete(bank.keys.blob(eid), bank.keys.meta(eid))
    rng = random.Random(1)
    for attack in (flip_bits, non_finite, untrainable):
        assert attack(bank, rng) is None
    assert not any(bank.r.exists(bank.keys.blob(e), bank.keys.meta(e)) for e in members)


def test_the_processes_of_a_run_are_found_among_its_descendants_only(tmp_path):
    """A process tree like vgrpo train's: a Ray actor's worker titled `ray::<Class>` two levels
    down and an embedded server; another tree's are never named."""
    tree, other = (subprocess.Popen(["bash", "-c", "(exec -a ray::RolloutWorker.deliver sleep 60) & wait"])
                   for _ in range(2))
    try:
        with EmbeddedRedis(data_dir=tmp_path / "redis") as server:
            for _ in range(100):
                if role_pids(tree.pid, "RolloutWorker") and role_pids(other.pid, "RolloutWorker"):
                    break
                time.sleep(0.05)
            (worker,) = role_pids(tree.pid, "RolloutWorker")
            (theirs,) = role_pids(other.pid, "RolloutWorker")
            assert worker != theirs and worker not in descendants(other.pid)
            assert role_pids(tree.pid, "RewardActor") == []
            assert server.pid in server_pids(os.getpid()) and server_pids(tree.pid) == []
    finally:
        for p in (tree, other):
            for pid in descendants(p.pid):   # the sleeps these trees started
                os.kill(pid, 9)
            p.kill()
            p.wait()


def test_a_runs_bank_url_is_found_by_its_server_directory(tmp_path):
    with EmbeddedRedis(data_dir=tmp_path / "redis") as server:
        ref, folder = make_ref(BankConfig(namespace="soakurl"), server.url.get_secret_value())
        try:
            assert bank_url(tmp_path / "redis") == server.url.get_secret_value()
            assert bank_url(tmp_path / "elsewhere") is None
        finally:
            shutil.rmtree(folder)


def test_checkpoint_finite_counts_the_non_finite_tensors_of_policy_and_state(tmp_path):
    from safetensors.torch import save_file

    (tmp_path / "policy").mkdir()
    save_file({"a": torch.ones(3), "b": torch.tensor([1.0, float("nan")])}, tmp_path / "policy" / "m.safetensors")
    torch.save({"opt": {"state": [torch.zeros(2), torch.tensor([float("inf")])]}, "step": torch.tensor(3)},
               tmp_path / "trainer.pt")
    assert checkpoint_finite(tmp_path) == (4, 2)   # the integer step is not a weight
