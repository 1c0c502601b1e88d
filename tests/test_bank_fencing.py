"""Fencing on a real redis-server: a run whose lease lapsed and was taken over cannot push,
pull, commit, requeue or quarantine, from its own bank or its actors' (BankRef), and nothing
it held is trained twice; each refusal is checked by the server inside the script."""

from __future__ import annotations

import time
import uuid

import pytest
import redis
from bank_helpers import make_group

from common.config import BankConfig
from memory_bank.bank import MemoryBank
from memory_bank.errors import LeaseLost
from memory_bank.ownership import claim_namespace
from memory_bank.ref import make_ref

SMALL = (1, 2, 4, 4)   # [C, F, H, W]
TTL = 0.4


def _cfg(ns: str) -> BankConfig:
    return BankConfig(namespace=ns, capacity=4, max_staleness=100, lease_ttl_s=TTL)


def _pause_past_ttl(bank: MemoryBank, lease) -> None:
    """What a process stopped past its TTL looks like to Redis: no renewal, the key expires."""
    lease._stop.set()
    lease._thread.join(timeout=10)
    deadline = time.monotonic() + 10
    while bank.r.exists(bank.keys.lease):
        assert time.monotonic() < deadline, "the lease never expired"
        time.sleep(0.02)


def _entry_ids(bank: MemoryBank) -> set[str]:
    return {bank.keys.entry_id(k.decode()) for k in bank.r.scan_iter(match=bank.keys.entry_pattern)}


def test_a_run_whose_lease_was_taken_over_is_refused_everywhere(redis_server, tmp_path):
    url, ns = redis_server.url.get_secret_value(), f"fence{uuid.uuid4().hex[:8]}"
    old = MemoryBank(redis.Redis.from_url(url), _cfg(ns))
    lease_old = claim_namespace(old, "run-x")
    ref_old, secret = make_ref(old.cfg, url, secret_dir=tmp_path)  # what its actors get
    assert ref_old.fence == lease_old.value
    actor_old = ref_old.open()
    for i in range(3):
        actor_old.push_group(make_group("c", f"g{i}", g=2, seed=i, shape=SMALL))
    held = actor_old.pull(2, 0)                       # g0, g1 in flight when the run stalls
    assert [g.group_id for g in held.fresh] == ["g0", "g1"]

    _pause_past_ttl(old, lease_old)
    new = MemoryBank(redis.Redis.from_url(url), _cfg(ns))
    lease_new = claim_namespace(new, "run-x", resume=True)   # requeues the stalled run's pulls

    # the stalled run wakes up: every operation that moves a group is refused by the server
    before = {k: v for k, v in new.stats().items() if k != "redis_latency_ms"}
    keys_before = _entry_ids(new)
    for bank in (old, actor_old):
        with pytest.raises(LeaseLost, match="lost the lease"):
            bank.commit(held, 1)
        with pytest.raises(LeaseLost, match="lost the lease"):
            bank.push_group(make_group("c", "g9", g=2, seed=9, shape=SMALL))
        with pytest.raises(LeaseLost, match="lost the lease"):
            bank.pull(5, 0)
        with pytest.raises(LeaseLost, match="lost the lease"):
            bank.requeue_pending()
        with pytest.raises(LeaseLost, match="lost the lease"):
            bank.requeue_all_pending()
        with pytest.raises(LeaseLost, match="lost the lease"):
            bank.quarantine(held.fresh[0].members[0].bank_id, "stale holder")
    assert {k: v for k, v in new.stats().items() if k != "redis_latency_ms"} == before
    assert _entry_ids(new) == keys_before             # the refused push left no entry behind
    assert not lease_old.renew() and lease_old.lost   # and its renewal thread would say so

    # the new holder trains each group exactly once
    got = new.pull(5, 1)
    assert sorted(g.group_id for g in got.fresh) == ["g0", "g1", "g2"]
    new.commit(got, 1)
    st = new.stats()
    assert (st["committed"], st["fresh"], st["pending"]) == (3, 0, 0)
    assert sorted(g.decode() for g in new.r.lrange(new.keys.done, 0, -1)) == ["g0", "g1", "g2"]
    lease_new.release()
    new.clear()


def test_a_bank_without_the_lease_is_refused_while_a_run_holds_it(redis_server):
    url, ns = redis_server.url.get_secret_value(), f"fence{uuid.uuid4().hex[:8]}"
    owner = MemoryBank(redis.Redis.from_url(url), _cfg(ns))
    lease = claim_namespace(owner, "run-y")
    stranger = MemoryBank(redis.Redis.from_url(url), _cfg(ns))
    with pytest.raises(LeaseLost, match="holds no lease") as err:
        stranger.push_group(make_group("c", "g0", g=2, shape=SMALL))
    assert "run run-y" in str(err.value) and "\n" not in str(err.value)
    owner.push_group(make_group("c", "g0", g=2, shape=SMALL))
    with pytest.raises(LeaseLost, match="holds no lease"):
        stranger.pull(1, 0)
    assert [g.group_id for g in owner.pull(1, 0).fresh] == ["g0"]
    lease.release()
    # released: the namespace is nobody's, an unfenced bank works again
    assert [g.group_id for g in stranger.pull(1, 0).fresh] == []
    owner.clear()


def test_a_lapsed_lease_nobody_took_is_taken_again_by_the_next_operation(redis_server):
    url, ns = redis_server.url.get_secret_value(), f"fence{uuid.uuid4().hex[:8]}"
    bank = MemoryBank(redis.Redis.from_url(url), _cfg(ns))
    lease = claim_namespace(bank, "run-z")
    _pause_past_ttl(bank, lease)
    bank.push_group(make_group("c", "g0", g=2, shape=SMALL))     # re-takes it, as renew would
    assert bank.r.get(bank.keys.lease).decode() == lease.value
    assert 0 < bank.r.pttl(bank.keys.lease) <= TTL * 1000
    assert lease.renew() and not lease.lost
    lease.release()
    bank.clear()


def test_a_lapsed_lease_another_run_claimed_and_released_is_not_taken_back(redis_server, tmp_path):
    """A frozen owner A: B claims the namespace (A's lease had lapsed) and releases it. A wakes:
    the lease key is gone, but the epoch says someone claimed it since, so A's renewal and every
    fenced operation (its own bank's and its actors') are refused, and A takes nothing back."""
    url, ns = redis_server.url.get_secret_value(), f"fence{uuid.uuid4().hex[:8]}"
    a = MemoryBank(redis.Redis.from_url(url), _cfg(ns))
    lease_a = claim_namespace(a, "run-a")
    actor_a = make_ref(a.cfg, url, secret_dir=tmp_path)[0].open()
    actor_a.push_group(make_group("c", "g0", g=2, seed=0, shape=SMALL))
    _pause_past_ttl(a, lease_a)                       # A freezes past its TTL

    b = MemoryBank(redis.Redis.from_url(url), _cfg(ns).model_copy(update={"clear_stale": True}))
    lease_b = claim_namespace(b, "run-b")             # B takes it, deletes A's data (clear_stale)
    assert lease_b.epoch == lease_a.epoch + 1
    lease_b.release()                                 # and lets it go
    assert not b.r.exists(b.keys.lease)

    # A wakes up: nobody holds the lease, yet A is refused, by the renewal and by the server
    assert not lease_a.renew() and lease_a.lost
    for bank in (a, actor_a):
        with pytest.raises(LeaseLost, match="another run claimed it since") as err:
            bank.push_group(make_group("c", "g1", g=2, seed=1, shape=SMALL))
        assert "\n" not in str(err.value)
        with pytest.raises(LeaseLost, match="another run claimed it since"):
            bank.pull(5, 0)
    assert not a.r.exists(a.keys.lease)               # A took nothing back
    assert a.stats()["fresh"] == 0                    # and nothing of A's is queued again
    b.clear()
