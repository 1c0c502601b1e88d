"""Rendezvous for the weight-sync process group shared by learner rank 0 and rollout actors,
and the waits on it, which fail fast.

That group is not the learner's default torch.distributed group (a process has only one, and
the rollout actors are not in the learner's), so it is built directly: a TCPStore served by
the publisher, a fresh key prefix per group, and a Gloo (CPU) or NCCL (GPU) process group
object. Each peer writes a `joined/<rank>` key first, so the publisher can name the peers
that never came instead of waiting in an anonymous rendezvous.

Failing fast (`WeightGroup`). A member that dies mid-broadcast must not leave the others in the
broadcast until their timeout: the broadcasts of a bucket it never takes part in, or the
publisher never posts, would not end before it. So no member blocks inside an op. Each polls
its ops (`Work.is_completed`, or a short `Work.wait` on gloo) and, between polls, looks at the
group's `abort` key in the store; whoever gives up on the group (its own deadline, an op that
failed, a peer it saw die: the publisher watches the members' Ray calls) sets that key with its
reason, and every member still waiting returns within a poll, its group dropped. The publisher
builds a new group at its next publish (new store, port and key prefix) and every member joins
it afresh. A publisher that dies takes its store with it: a member sees that as an abort too.

Dropping a group with an op still pending. torch 2.13 offers `abort()` and `shutdown()` on every
backend (the older `_shutdown` is gone). `shutdown()` waits for pending ops, so it is not used on
a broken group. `abort()` on NCCL aborts the communicators (ncclCommAbort): a kernel waiting on a
dead peer returns and the group can be freed at once. On gloo, `abort()` leaves a pending op
pending (measured: `is_completed()` stays false), and the group's destructor waits for it, up to
the op's own timeout (timeout_s). So the last reference to a dropped group is released on a
short-lived thread of its own (`_drop`): the destructor releases the GIL while it waits, the
member carries on at once, and the broken group's buffers (two buckets at most) and sockets
linger for timeout_s at worst.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

Backend = Literal["gloo", "nccl"]

log = logging.getLogger(__name__)

ABORT_KEY = "abort"
POLL_S = 0.05
"""How long a member waits on an op before it looks at the abort key (and the publisher at its
members' calls) again: how soon the others return after one gives up."""
NCCL_WATCHDOG_MARGIN_S = 60.0
"""NCCL's own op timeout is timeout_s plus this: its watchdog tears the whole process down (the
default TORCH_NCCL_ASYNC_ERROR_HANDLING), so the group's deadline, which only aborts the group,
comes first."""


class WeightSyncTimeout(TimeoutError):
    """A weight-group peer did not join or answer in time; the message names it."""


class WeightGroupAborted(WeightSyncTimeout):
    """Another member gave up on the weight group while this one waited in it (its reason is in
    the message), or the publisher's store is gone."""


def join_key(rank: int) -> str:
    return f"joined/{rank}"


def backend_for(device: torch.device | str) -> Backend:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def make_process_group(store: dist.Store, rank: int, world_size: int, backend: Backend,
                       timeout_s: float) -> dist.ProcessGroup:
    """A process-group object on `store`; every collective on it times out after timeout_s
    (NCCL: plus NCCL_WATCHDOG_MARGIN_S, see there)."""
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout + timedelta(seconds=NCCL_WATCHDOG_MARGIN_S)
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)
    raise ValueError(f"weight group backend {backend!r} is not one of gloo, nccl")


class WeightGroup:
    """One member's side of one weight group: its process group, the store where the group's
    keys live, and the bounded waits on its ops. Once it failed (`abort`) or was closed it is
    spent: the publisher builds a new group and every member joins that one."""

    def __init__(self, pg: dist.ProcessGroup, store: dist.Store, rank: int, backend: Backend,
                 timeout_s: float, server: dist.Store | None = None):
        self.pg, self.store, self.rank = pg, store, rank
        self.backend, self.timeout_s = backend, timeout_s
        self._server = server          # the publisher's TCPStore, kept alive with the group
        self.reason: str | None = None  # why the group was given up, once it was

    @property
    def live(self) -> bool:
        return self.pg is not None

    def broadcast(self, t: torch.Tensor):
        if self.pg is None:
            raise WeightGroupAborted(f"weight group rank {self.rank}: the group was given up ({self.reason})")
        return self.pg.broadcast(t, 0)

    def wait(self, works: Sequence, what: str, check: Callable[[], str | None] | None = None) -> None:
        """Wait for `works`, timeout_s at most in all. Polls them; between polls looks at the
        abort key and at `check()` (a reason to give up, or None). Gives the group up (`abort`)
        and raises WeightGroupAborted when another member gave up or `check` found a reason, and
        WeightSyncTimeout when an op failed or the deadline passed."""
        deadline = time.monotonic() + self.timeout_s
        for w in works:
            while True:
                try:
                    if self._settled(w):
                        break
                except RuntimeError as e:  # the op itself failed (e.g. a peer's connection closed)
                    other = self.aborted_by()
                    if other is not None:  # because another member gave the group up and left it
                        self._aborted_by(other, what)
                    reason = f"rank {self.rank}: {what} failed: {_first_line(e)}"
                    self.abort(reason)
                    raise WeightSyncTimeout(f"weight group {reason}") from None
                other = self.aborted_by()
                if other is not None:
                    self._aborted_by(other, what)
                found = check() if check is not None else None
                if found is not None:
                    self.abort(f"rank {self.rank}: {found}")
                    raise WeightGroupAborted(f"weight group rank {self.rank}: {what} aborted: {found}")
                if time.monotonic() > deadline:
                    reason = f"rank {self.rank}: {what} did not complete within {self.timeout_s} s"
                    self.abort(reason)
                    raise WeightSyncTimeout(f"weight group {reason}")

    def _aborted_by(self, other: str, what: str) -> None:
        self.abort(other, tell=False)
        raise WeightGroupAborted(f"weight group rank {self.rank}: {what} aborted by {other}") from None

    def _settled(self, w) -> bool:
        """True once `w` is done (raising its error if it failed); False after about POLL_S."""
        if self.backend == "gloo":
            if w.is_completed():
                w.wait()
                return True
            try:
                w.wait(timedelta(seconds=POLL_S))  # a timed-out wait leaves the op as it was (measured)
            except RuntimeError:
                if not w.is_completed():
                    return False
                w.wait()  # it ended meanwhile: its own error, if any
            return True
        # NCCL: Work.wait only orders the current stream after the op (it does not block the CPU
        # unless TORCH_NCCL_BLOCKING_WAIT, which aborts the group when a short wait times out), so
        # poll the op's completion event
        end = time.monotonic() + POLL_S
        while not w.is_completed():
            if time.monotonic() > end:
                return False
            time.sleep(0.001)
        w.wait()
        return True

    def aborted_by(self) -> str | None:
        """The reason another member gave the group up for, or None (one store round trip,
        bounded by the store's timeout). A store that cannot be reached is a reason."""
        try:
            if not self.store.check([ABORT_KEY]):
                return None
            return self.store.get(ABORT_KEY).decode(errors="replace")
        except Exception as e:  # noqa: BLE001 - the publisher's store is gone: the group is too
            return f"the group's store being unreachable ({_first_line(e)})"

    def abort(self, reason: str, tell: bool = True) -> None:
        """Give the group up: tell the other members why (the abort key; tell=False when they
        told us), abort this member's pending ops, and drop the group without waiting for them."""
        if self.pg is None:
            return
        self.reason = reason
        if tell:
            try:
                self.store.compare_set(ABORT_KEY, "", reason)  # the first member's reason stays
            except Exception as e:  # noqa: BLE001 - the store is gone: nobody is left to tell
                log.info("weight group rank %d: could not set the abort key (%s)", self.rank, e)
        log.warning("weight group rank %d aborted: %s", self.rank, reason)
        self._drop()

    def close(self) -> None:
        """Leave the group (a healthy one: its members change, or the run ends)."""
        if self.pg is not None:
            self.reason = self.reason or "closed"
            self._drop()

    def _drop(self) -> None:
        box = [self.pg, self.store, self._server]
        self.pg = self.store = self._server = None
        try:
            box[0].abort()  # NCCL: ncclCommAbort, pending kernels end; gloo: no effect on them
        except Exception as e:  # noqa: BLE001 - best effort: the group is dropped either way
            log.info("weight group rank %d: abort() raised %s", self.rank, e)
        # the last references go on a thread of their own (see the module docstring): nothing
        # else holds the group (an op's Work does not keep it alive, measured)
        threading.Thread(target=box.clear, name="weight-group-drop", daemon=True).start()


def _first_line(e: BaseException) -> str:
    """`Type: message`, its first sentence, without gloo's source-file prefix."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text).split(". This is typically")[0]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def join_as_peer(host: str, port: int, prefix: str, rank: int, world_size: int,
                 backend: Backend, timeout_s: float) -> WeightGroup:
    """Connect to the publisher's store, announce this rank, and build the group (blocks until all joined)."""
    if not 1 <= rank < world_size:
        raise ValueError(f"weight group rank {rank} is outside 1..{world_size - 1} (rank 0 is the publisher)")
    timeout = timedelta(seconds=timeout_s)
    try:
        base = dist.TCPStore(host, port, world_size, False, timeout)
    except Exception as e:
        raise WeightSyncTimeout(f"weight group rank {rank}: cannot reach the publisher's store at "
                                f"{host}:{port} within {timeout_s} s ({e})") from None
    store = dist.PrefixStore(prefix, base)
    store.set(join_key(rank), "1")
    return WeightGroup(make_process_group(store, rank, world_size, backend, timeout_s), store, rank,
                       backend, timeout_s)
