"""The soak's attacks (benchmarks/soak_attacks.py) on a real redis-server: each damages a stored
entry so that the bank or the learner must catch it, in the way the soak counts on, and none
recreates an entry the bank deleted meanwhile."""

from __future__ import annotations

import random

import pytest
from bank_helpers import SHAPE, make_group

from benchmarks.soak_attacks import FUTURE, flip_bits, non_finite, queued_members, untrainable
from learner.admit import Admission, admit
from memory_bank.bank import MemoryBank


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
