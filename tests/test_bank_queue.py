"""MemoryBank push/pull/commit on a real redis-server: round trip, FIFO, exactly once,
crash recovery, corrupt entries, snapshot/restore."""

from __future__ import annotations

import logging
import multiprocessing as mp
import time
import uuid

import pytest
import torch
from bank_helpers import HEADS, make_group

from cluster.driver.state import version_of
from common.config import BankConfig
from memory_bank.bank import MemoryBank
from memory_bank.errors import DuplicateGroup, UnscoredGroup


def test_push_pull_round_trip_is_exact(bank):
    grp = make_group("cond-α", "grp-1", version=3, image=True)
    assert bank.push_group(grp) == "grp-1"
    batch = bank.pull(4, version=3)
    assert batch.version == 3 and len(batch.fresh) == 1 and batch.bank == [[]]
    got = batch.fresh[0]
    assert (got.group_id, got.policy_version, got.condition.id, got.condition.prompt) == (
        "grp-1", 3, "cond-α", grp.condition.prompt)
    # the condition travels encoded (one object shared by the members), never as pixels or a path
    assert got.condition.image is None and got.condition.image_path is None
    assert all(m.cond is got.cond for m in got.members)
    for side in ("tensors", "uncond"):
        a, b = getattr(grp.cond, side), getattr(got.cond, side)
        assert set(a) == set(b) and all(torch.equal(a[n], b[n]) and a[n].dtype == b[n].dtype for n in a)
    assert got.cond.encoder == grp.cond.encoder
    assert got.scores.heads == HEADS and torch.equal(got.scores.values, grp.scores.values)
    assert torch.equal(got.composite, grp.composite)
    for a, b in zip(grp.members, got.members, strict=True):
        for name in ("x", "x_next", "logp_old", "final_latents"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert (a.member, a.seed, a.spec, a.step_indices) == (b.member, b.seed, b.spec, b.step_indices)
        assert b.frames is None and b.bank_id
    st = bank.stats()
    assert (st["fresh"], st["pending"], st["pushed"]) == (0, 1, 1)
    assert st["bytes"] > 4 * 3 * 2 * 4 * 6 * 16 * 16 * 4  # latents are stored, not frames
    bank.commit(batch, step=1)
    st = bank.stats()
    assert (st["pending"], st["committed"], st["banked"]) == (0, 1, 4)
    assert [e.trajectory.trained_times for e in bank.entries("cond-α")] == [1, 1, 1, 1]
    assert {e.status for e in bank.entries("cond-α")} == {"banked"}


def test_unscored_and_duplicate_groups_rejected(bank):
    grp = make_group(group_id="dup")
    grp.scores = None
    with pytest.raises(UnscoredGroup, match="dup"):
        bank.push_group(grp)
    bank.push_group(make_group(group_id="dup"))
    with pytest.raises(DuplicateGroup, match="dup"):
        bank.push_group(make_group(group_id="dup", seed=5))
    st = bank.stats()
    assert (st["fresh"], st["entries"]) == (1, 4)          # the rejected copy left nothing behind
    assert len(list(bank.r.scan_iter(match=f"{bank.keys.namespace}:e:*"))) == 8


def test_fifo_order_and_exactly_once(bank):
    for i in range(5):
        bank.push_group(make_group(f"c{i % 2}", f"g{i}", seed=i))
    b1 = bank.pull(2, version=0)
    b2 = bank.pull(10, version=0)
    assert [g.group_id for g in b1.fresh] == ["g0", "g1"]
    assert [g.group_id for g in b2.fresh] == ["g2", "g3", "g4"]
    assert bank.pull(10, version=0).fresh == []
    bank.commit(b1, 1)
    bank.commit(b1, 1)   # a repeated commit must not bank or count anything twice
    assert bank.stats()["committed"] == 2 and len(bank.entries("c0")) == 4
    assert [e.trajectory.trained_times for e in bank.entries("c0")] == [1] * 4
    bank.push_group(make_group("c0", "g5", seed=5))
    b3 = bank.pull(1, version=0)                 # g5 trains with g0's members from the bank
    assert {t.group_id for t, _, _ in b3.bank[0]} == {"g0"}
    bank.commit(b3, 2)
    assert sorted(e.trajectory.trained_times for e in bank.entries("c0")) == [1] * 4 + [2] * 4


def test_requeue_after_consumer_crash(bank, redis_server):
    for i in range(4):
        bank.push_group(make_group("c", f"g{i}", seed=i))
    lost = bank.pull(3, version=0)          # the learner "crashes" before commit
    assert len(lost.fresh) == 3
    del lost
    resumed = MemoryBank(redis_server.client(), bank.cfg, consumer=bank.consumer)  # restarted
    assert resumed.requeue_pending() == 3
    batch = resumed.pull(10, version=0)
    assert [g.group_id for g in batch.fresh] == ["g0", "g1", "g2", "g3"]   # order kept
    resumed.commit(batch, 1)
    st = resumed.stats()
    assert (st["fresh"], st["pending"], st["committed"]) == (0, 0, 4)


def _producer(url: str, ns: str, pid: int, n: int) -> None:
    torch.set_num_threads(1)
    import redis

    b = MemoryBank(redis.Redis.from_url(url), BankConfig(namespace=ns))
    for i in range(n):
        grp = make_group(f"c{i % 3}", f"p{pid}-{i}", g=2, seed=pid * 100 + i)
        b.push_group(grp)


def test_concurrent_producers_every_group_trained_exactly_once(bank, redis_server):
    producers, per = 3, 12
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_producer, args=(redis_server.url.get_secret_value(),
                                                 bank.keys.namespace, p, per))
             for p in range(producers)]
    for p in procs:
        p.start()
    trained: list[str] = []
    step, crashed = 0, False
    expected = producers * per
    while len(trained) < expected:
        batch = bank.pull(4, version=step)
        if not batch.fresh:
            assert any(p.is_alive() for p in procs) or bank.stats()["fresh"] > 0, "groups lost"
            time.sleep(0.01)
            continue
        if not crashed and step == 2:       # drop one batch uncommitted, as a dead learner would
            crashed = True
            assert bank.requeue_pending() == len(batch.fresh)
            continue
        step += 1
        bank.commit(batch, step)
        trained += [g.group_id for g in batch.fresh]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    want = {f"p{p}-{i}" for p in range(producers) for i in range(per)}
    assert len(trained) == len(set(trained)) == expected       # none twice
    assert set(trained) == want                                # none lost
    for p in range(producers):                                 # FIFO within each producer
        mine = [int(g.split("-")[1]) for g in trained if g.startswith(f"p{p}-")]
        assert mine == sorted(mine)
    st = bank.stats()
    assert (st["fresh"], st["pending"], st["committed"], st["corrupt"]) == (0, 0, expected, 0)


def test_corrupt_and_foreign_entries_are_skipped_and_counted(bank, caplog):
    k = bank.keys
    for i in range(3):
        bank.push_group(make_group("c", f"g{i}", seed=i))
    bank.commit(bank.pull(1, 0), 1)                     # g0's 4 members are now banked
    banked = [e.id for e in bank.entries("c")]
    bank.r.set(k.blob(banked[0]), b"\x00garbage")              # bad bytes
    bank.r.hdel(k.meta(banked[1]), "version")                  # missing field
    # g1: a foreign member with another latent shape; g2: every member destroyed
    foreign = make_group("c", "g1", shape=(4, 6, 8, 8))
    other = [e for e in bank.r.hget(k.group("g1"), "eids").decode().split()]
    from memory_bank.codec import encode, encode_cond
    meta, blob = encode(other[2], foreign.members[2], HEADS, foreign.scores.values[2], 1.0,
                        cond_key=encode_cond("c", foreign.cond)[0])
    bank.r.hset(k.meta(other[2]), mapping=meta)
    bank.r.set(k.blob(other[2]), bytes(blob))
    for eid in bank.r.hget(k.group("g2"), "eids").decode().split():
        bank.r.delete(k.blob(eid))
    bank.r.rpush(k.cond("c"), "not-an-id")                     # foreign index entry
    with caplog.at_level(logging.ERROR, logger="memory_bank.bank"):
        batch = bank.pull(5, version=0)
    assert [g.group_id for g in batch.fresh] == ["g1"]          # g2 had nothing usable
    assert batch.fresh[0].size == 3 and batch.fresh[0].scores.values.shape == (3, 3)
    assert len(batch.bank[0]) == 2                              # 4 banked - 2 corrupt
    st = bank.stats()
    assert st["corrupt"] == 2 + 1 + 4 + 1 + 1 and st["dropped"] == 1, st
    assert "skipped" in caplog.text and "blob rejected" in caplog.text
    bank.commit(batch, 2)
    assert len(bank.entries("c")) == 5 and bank.stats()["corrupt"] == 9   # counted once
    assert bank.stats()["pending"] == 0


def test_snapshot_restore(bank):
    for i in range(3):
        bank.push_group(make_group("c", f"g{i}", seed=i, g=2))
    bank.commit(bank.pull(1, 0), 1)
    snap = bank.snapshot()
    import json
    snap = json.loads(json.dumps(snap))                 # JSON-able, as a checkpoint stores it
    before = [e.id for e in bank.entries("c")]
    pulled = bank.pull(1, 0)
    bank.commit(pulled, 2)                              # after the checkpoint
    bank.pull(1, 0)                                     # pending at the crash
    out = bank.restore(snap)
    assert out == {"requeued": 1, "restored": 2, "missing": 0, "evicted": 2}
    assert [e.id for e in bank.entries("c")] == before
    st = bank.stats()
    assert (st["fresh"], st["pending"], st["banked"]) == (1, 0, 2)
    with pytest.raises(ValueError, match="namespace"):
        bank.restore({**snap, "namespace": "other"})


def test_bank_fixture_namespaces_are_isolated(redis_server):
    a = MemoryBank(redis_server.client(), BankConfig(namespace=f"a{uuid.uuid4().hex[:8]}"))
    b = MemoryBank(redis_server.client(), BankConfig(namespace=f"b{uuid.uuid4().hex[:8]}"))
    a.push_group(make_group())
    assert b.stats()["fresh"] == 0 and a.stats()["fresh"] == 1
    assert a.clear() > 0 and a.stats()["fresh"] == 0


def test_queued_ids_lists_fresh_groups_oldest_first(bank):
    from bank_helpers import make_group

    ids = [bank.push_group(make_group("c", f"q{i}")) for i in range(3)]
    assert bank.queued_ids() == ids
    bank.pull(2, version=0)
    assert bank.queued_ids() == ids[2:]


def test_resume_discards_what_a_lost_timeline_sampled_after_the_checkpoint(bank):
    # the lost run trained to version 3 and pushed groups stamped v3 and v4; a resume at step 2
    # reuses those version numbers for other weights, so they must not pass as on-policy
    bank.push_group(make_group("c0", "g0000000-v1", version=1, seed=0))
    bank.push_group(make_group("c0", "g0000001-v2", version=2, seed=1))
    bank.commit(bank.pull(2, version=2), 3)                            # banked at versions 1 and 2
    bank.push_group(make_group("c1", "g0000002-v3", version=3, seed=2))
    bank.commit(bank.pull(1, version=3), 4)                            # banked at version 3
    for gid, v in (("g0000003-v2", 2), ("g0000004-v3", 3), ("g0000005-v4-a1", 4)):
        bank.push_group(make_group("c0", gid, version=v, seed=v + 10))
    lost = [g for g in bank.queued_ids() if version_of(g) > 2]           # the driver's id format
    groups, entries = bank.discard(lost, after_version=2)
    assert (groups, entries) == (2, 4)                                 # g…4-v3, g…5-v4-a1; c1's 4 members
    assert bank.queued_ids() == ["g0000003-v2"]
    assert bank.entries("c1") == []
    assert sorted({e.trajectory.policy_version for e in bank.entries("c0")}) == [1, 2]
    assert bank.pull(5, version=2).fresh[0].group_id == "g0000003-v2"
