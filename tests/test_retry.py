"""The one outage-retry loop (common/retry.py): against a real redis-server that goes away and
comes back, and in the rollout actor's push into the bank."""

from __future__ import annotations

import logging
import threading
import time
import uuid

import pytest
from bank_helpers import make_group

from common.config import BankConfig, load_config
from common.retry import retry_outage
from common.types import GroupReceipt
from memory_bank.bank import MemoryBank
from memory_bank.embedded import EmbeddedRedis
from memory_bank.errors import BankUnavailable


@pytest.fixture()
def server():
    """A redis-server of this test's own, so stopping it disturbs no other test."""
    with EmbeddedRedis() as s:
        yield s


def _later(seconds: float, fn) -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(seconds), fn()), daemon=True)
    t.start()
    return t


def test_retries_through_an_outage_then_succeeds(server, caplog):
    bank = MemoryBank(server.client(), BankConfig(namespace=f"t{uuid.uuid4().hex[:12]}"))
    assert bank.stats()["fresh"] == 0
    server.terminate()
    back = _later(2.0, server.restart)
    waits = []
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="common.retry"):
        stats = retry_outage(bank.stats, outage_s=30, what="stats", errors=BankUnavailable,
                             on_retry=lambda e, wait, left: waits.append((type(e), wait, left)))
    back.join()
    assert stats["fresh"] == 0 and time.monotonic() - t0 >= 2.0
    assert waits and all(e is BankUnavailable and left <= 30 for e, _, left in waits)
    # the backoff doubles from 0.25 s (capped at 5 s)
    assert [w for _, w, _ in waits] == [min(0.25 * 2**i, 5.0) for i in range(len(waits))]
    assert "retrying stats in 0.2s" in caplog.text


def test_gives_up_after_outage_s_with_the_error(server):
    bank = MemoryBank(server.client(), BankConfig(namespace=f"t{uuid.uuid4().hex[:12]}"))
    server.terminate()
    t0 = time.monotonic()
    with pytest.raises(BankUnavailable, match="Redis unreachable during stats"):
        retry_outage(bank.stats, outage_s=2.0, what="stats", errors=BankUnavailable)
    took = time.monotonic() - t0
    assert 2.0 <= took < 2.0 + 5.0   # the budget, plus at most the one call under way


class _Wrapped(Exception):
    """What a remote call's error looks like from the caller (Ray's RayTaskError has `cause`)."""

    def __init__(self, cause: BaseException):
        super().__init__(f"remote: {cause}")
        self.cause = cause


def test_only_outages_are_retried_and_a_wrapped_outage_counts():
    calls = []

    def broken():
        calls.append(1)
        raise ValueError("not an outage")

    with pytest.raises(ValueError, match="not an outage"):
        retry_outage(broken, outage_s=10, what="x", errors=BankUnavailable)
    assert len(calls) == 1                                   # raised at once, never retried

    tries = iter([_Wrapped(BankUnavailable("down")), _Wrapped(BankUnavailable("down")), None])

    def flaky():
        err = next(tries)
        if err is not None:
            raise err
        return "ok"

    assert retry_outage(flaky, outage_s=10, what="x", errors=BankUnavailable) == "ok"
    last = BankUnavailable("still down")
    with pytest.raises(BankUnavailable) as e:                # the cause is raised, unwrapped
        retry_outage(lambda: (_ for _ in ()).throw(_Wrapped(last)), outage_s=0.3, what="x",
                     errors=BankUnavailable)
    assert e.value is last


def _worker(server, outage_s: float):
    from memory_bank.ref import make_ref
    from rollout_worker.actor import RolloutWorker

    cfg = load_config("configs/quickstart.yaml", [f"bank.outage_s={outage_s}",
                                                  f"bank.namespace=t{uuid.uuid4().hex[:12]}"])
    ref, folder = make_ref(cfg.bank, server.url.get_secret_value())
    return RolloutWorker(cfg, bank=ref), folder


def _receipt(group) -> GroupReceipt:
    return GroupReceipt(group.group_id, group.condition.id, 0, group.policy_version, size=group.size)


def test_the_rollout_actor_pushes_through_an_outage(server, tmp_path):
    import shutil

    worker, folder = _worker(server, 30.0)
    try:
        group = make_group(group_id=f"g-{uuid.uuid4().hex[:8]}", shape=(2, 2, 4, 4))
        worker._open_bank()                      # connected, then Redis goes away
        server.terminate()
        back = _later(2.0, server.restart)
        rec = worker._store(group, _receipt(group))
        back.join()
        assert rec.ok and rec.failure is None and rec.seconds["store"] >= 2.0
        assert worker._open_bank().stats()["fresh"] == 1
        # Redis gone for longer than bank.outage_s: the receipt says so in one line
        worker2, folder2 = _worker(server, 1.0)
        server.terminate()
        other = make_group(group_id=f"g-{uuid.uuid4().hex[:8]}", shape=(2, 2, 4, 4))
        rec = worker2._store(other, _receipt(other))
        assert (rec.ok, rec.failure) == (False, "bank_unavailable")
        assert rec.detail.startswith("memory bank unreachable for 1s during push_group (")
        shutil.rmtree(folder2, ignore_errors=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
