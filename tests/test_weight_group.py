"""The weight group's waits are bounded and abortable (common/weight_group.WeightGroup), on gloo.

Members of one real gloo group in this process (a thread each, as the rendezvous needs): rank 1
waits in a broadcast that rank 0 never sends. It returns within a poll when another member gives
the group up (even while that member's own dropped group still holds its connections open), and
at its deadline otherwise, telling the others why; dropping a group whose op is still pending
does not wait for that op.
"""

from __future__ import annotations

import threading
import time
import uuid
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from common.weight_group import (
    ABORT_KEY,
    POLL_S,
    WeightGroup,
    WeightGroupAborted,
    WeightSyncTimeout,
    make_process_group,
)

pytestmark = pytest.mark.timeout(120)


def _members(n: int, timeout_s: float) -> list[WeightGroup]:
    server = dist.TCPStore("127.0.0.1", 0, n, True, timedelta(seconds=timeout_s), wait_for_workers=False)
    prefix = f"t/{uuid.uuid4().hex}"
    groups: dict[int, WeightGroup] = {}

    def build(rank: int) -> None:
        base = server if rank == 0 else dist.TCPStore("127.0.0.1", server.port, n, False,
                                                      timedelta(seconds=timeout_s))
        store = dist.PrefixStore(prefix, base)
        pg = make_process_group(store, rank, n, "gloo", timeout_s)
        groups[rank] = WeightGroup(pg, store, rank, "gloo", timeout_s, server=base)

    threads = [threading.Thread(target=build, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 10)
    return [groups[r] for r in range(n)]


def _wait_in_thread(group: WeightGroup, works: list, what: str = "bucket 1 of version 7") -> dict:
    out: dict = {}

    def run() -> None:
        t0 = time.monotonic()
        try:
            group.wait(works, what)
        except Exception as e:  # noqa: BLE001 - the test looks at it
            out["error"] = e
        out["seconds"] = time.monotonic() - t0

    out["thread"] = threading.Thread(target=run, daemon=True)
    out["thread"].start()
    return out


def test_a_member_waiting_in_a_broadcast_returns_within_a_poll_when_another_aborts():
    g0, g1, g2 = _members(3, timeout_s=30.0)
    # bucket 0 reaches rank 1, not rank 2 (alive, out of the broadcast: a vanished machine), so
    # rank 0's send to it stays pending and its group, even dropped, keeps its connections open
    first = torch.arange(256, dtype=torch.float32)
    sent = g0.broadcast(first)
    got = torch.empty(256)
    g1.wait([g1.broadcast(got)], "bucket 0")
    assert torch.equal(got, first)
    waiting = _wait_in_thread(g1, [g1.broadcast(torch.empty(256))])   # bucket 1: never sent
    time.sleep(0.3)
    assert waiting["thread"].is_alive()                   # it waits while nobody gave up
    t0 = time.monotonic()
    g0.abort("rank 0 (the publisher): rollout actor 2 died")
    waiting["thread"].join(10)
    assert time.monotonic() - t0 < 2.0 + 4 * POLL_S       # not the 30 s op timeout
    err = waiting["error"]
    assert isinstance(err, WeightGroupAborted), err
    assert "bucket 1 of version 7 aborted by rank 0 (the publisher): rollout actor 2 died" in str(err)
    assert not g0.live and not g1.live                    # both gave the group up, neither waited on it
    assert not sent.is_completed()                        # rank 0's send to rank 2 is still pending
    g2.close()


def test_a_member_gives_up_at_its_deadline_and_tells_the_others():
    g0, g1 = _members(2, timeout_s=1.5)
    waiting = _wait_in_thread(g1, [g1.broadcast(torch.empty(1024))])
    waiting["thread"].join(20)
    err = waiting["error"]
    assert type(err) is WeightSyncTimeout and "rank 1: bucket 1 of version 7" in str(err), err
    assert 1.4 < waiting["seconds"] < 1.5 + 2.0, waiting["seconds"]   # its deadline (or gloo's, the same)
    # the others learn why from the group's store
    reason = g0.aborted_by()
    assert reason is not None and reason.startswith("rank 1: bucket 1 of version 7"), reason
    assert g0.store.check([ABORT_KEY])
    g0.close()


def test_closing_a_group_with_an_op_pending_does_not_wait_for_it():
    g0, g1 = _members(2, timeout_s=20.0)
    g1.broadcast(torch.empty(1024))                       # pending until rank 0's timeout
    t0 = time.monotonic()
    g1.close()                                            # gloo's destructor would wait 20 s here
    g0.close()
    assert time.monotonic() - t0 < 2.0
    with pytest.raises(WeightGroupAborted, match="given up"):
        g1.broadcast(torch.empty(1))
