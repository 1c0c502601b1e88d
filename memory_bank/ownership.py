"""Run ownership of a bank namespace: a lease key with a TTL, renewed by a daemon thread.

One run at a time uses a namespace. A second driver on a live namespace is refused in one
line (`NamespaceBusy`). Data left by a run whose lease expired is reported (`StaleBank`) and
deleted only when `bank.clear_stale` is on; a resume of the same run (the `owner` key names
it) adopts its data instead, requeues the pending groups its dead consumers left and deletes
the orphan entries it left (memory_bank.orphans).

Epoch: every claim increments `ns:{ns}:lease:epoch` (a key that outlives the lease) and the lease's
value ends with the claim's epoch, so a run whose lease lapsed cannot take it back, by its renewal
or by a fenced script, once another run has claimed it, even if that run released it since (its
`clear_stale` may have deleted this run's data): it is refused (`LeaseLost`) and must stop.

Fencing: the lease's value is the run's fence. The claiming bank carries it, and so does every
`BankRef` this process makes for the namespace while it holds the lease (`held_fence`), so
the actors' banks carry it too; each script that moves a group checks it on the server, so a
run whose lease was taken over cannot push, pull, commit or requeue (`LeaseLost`), whatever
its renewal thread has noticed yet.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import uuid

from common.processes import pid_alive
from memory_bank.bank import MemoryBank, _reachable
from memory_bank.errors import NamespaceBusy, StaleBank, describe_holder
from memory_bank.scripts import eval_cached

log = logging.getLogger(__name__)
_HELD: dict[str, str] = {}   # namespace -> the lease value (fence) this process holds

# KEYS: lease, epoch. ARGV: our value without its end, ttl ms. A free lease is claimed: the epoch
# counts one more claim and ends the value (`, "epoch": N}`); returns that value, or nil (held).
CLAIM = """
if redis.call('EXISTS', KEYS[1]) == 1 then return nil end
local v = ARGV[1] .. ', "epoch": ' .. redis.call('INCR', KEYS[2]) .. '}'
redis.call('SET', KEYS[1], v, 'PX', ARGV[2])
return v
"""

# KEYS: lease, epoch. ARGV: our value, ttl ms, our epoch. 1: renewed; 2: had lapsed, taken
# again; 0: another's; 3: had lapsed and another run claimed it since (and let it go).
RENEW = """
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] then redis.call('PEXPIRE', KEYS[1], ARGV[2]) return 1 end
if v then return 0 end
if redis.call('GET', KEYS[2]) ~= ARGV[3] then return 3 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 2
"""

# KEYS: lease. ARGV: our value. Deletes the lease only while it is ours.
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class Lease:
    """A held lease. `start()` renews it every ttl/3 in a daemon thread; `release()` ends it."""

    def __init__(self, bank: MemoryBank, run_id: str, ttl_s: float):
        self.bank, self.run_id, self.ttl_s = bank, run_id, ttl_s
        self.value = ""   # set by acquire: run, token, host, pid and the claim's epoch, as JSON
        self.epoch = 0
        self.renewals = 0
        self.lost = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def key(self) -> str:
        return self.bank.keys.lease

    @property
    def ttl_ms(self) -> int:
        return max(1, int(self.ttl_s * 1000))

    def acquire(self) -> bool:
        """Claim the lease if it is free; every claim takes the next epoch, which the value (the
        fence) ends with, so a later claim by anyone (even one released since) shows."""
        head = json.dumps({"run": self.run_id, "token": uuid.uuid4().hex, "host": socket.gethostname(),
                           "pid": os.getpid()})[:-1]
        got = eval_cached(self.bank.r, CLAIM, 2, self.key, self.bank.keys.epoch, head, self.ttl_ms)
        if got is None:
            return False
        self.value = got.decode() if isinstance(got, bytes) else str(got)
        self.epoch = int(json.loads(self.value)["epoch"])
        self.bank.fence.value = _HELD[self.bank.keys.namespace] = self.value
        return True

    @property
    def fence(self) -> str:
        """What the run's banks pass to every script that moves a group."""
        return self.value

    def renew(self) -> bool:
        """Extend the TTL; False (and one error line) when another run holds the lease now."""
        got = int(eval_cached(self.bank.r, RENEW, 2, self.key, self.bank.keys.epoch, self.value, self.ttl_ms,
                              self.epoch))
        if got == 2:
            log.warning("bank: the lease on namespace %r had lapsed (Redis unreachable or this "
                        "process stalled for over bank.lease_ttl_s=%s); taken again (no other run "
                        "claimed it meanwhile)", self.bank.keys.namespace, self.ttl_s)
        if got == 0 and not self.lost:
            log.error("bank: lost the lease on namespace %r to another run (%s): stop this run",
                      self.bank.keys.namespace, describe_holder(self.bank.r.get(self.key)))
        if got == 3 and not self.lost:
            log.error("bank: lost the lease on namespace %r: it lapsed, and another run claimed it "
                      "(epoch %s, this run's %d) and released it since; its data may have changed: "
                      "stop this run", self.bank.keys.namespace, _s(self.bank.r.get(self.bank.keys.epoch)),
                      self.epoch)
        lost = got in (0, 3)
        self.lost = self.lost or lost  # sticky: a run that lost its lease once must stop
        self.renewals += not lost
        return not lost

    def start(self) -> Lease:
        def loop() -> None:
            while not self._stop.wait(self.ttl_s / 3):
                try:
                    self.renew()
                except Exception as e:  # noqa: BLE001 — an outage: the driver's own calls decide
                    log.warning("bank: lease renewal failed (%s); retrying", type(e).__name__)

        self._thread = threading.Thread(target=loop, name="vgrpo-bank-lease", daemon=True)
        self._thread.start()
        return self

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if _HELD.get(self.bank.keys.namespace) == self.value:
            del _HELD[self.bank.keys.namespace]
        if self.bank.fence.value == self.value:
            self.bank.fence.value = ""
        try:
            eval_cached(self.bank.r, RELEASE, 1, self.key, self.value)
        except Exception as e:  # noqa: BLE001 — the TTL ends it anyway
            log.warning("bank: could not release the lease (%s); it expires in %.0fs",
                        type(e).__name__, self.ttl_s)


def leftovers(bank: MemoryBank) -> dict[str, int]:
    """What the namespace holds: queued and pending groups, stored entries, other keys."""
    k = bank.keys
    pipe = bank.r.pipeline(transaction=False)
    pipe.llen(k.fresh).hlen(k.einfo).exists(k.counts)
    fresh, entries, counts = pipe.execute()
    out = {"queued": int(fresh), "pending": len(bank.pending_ids()), "entries": int(entries)}
    if not any(out.values()) and not counts:
        # no index at all: any key left under the namespace (entries whose index is gone)
        stray = next((key for key in bank.r.scan_iter(match=k.pattern, count=500)
                      if key.decode() not in (k.lease, k.epoch, k.owner)), None)
        out["other"] = int(stray is not None)
    return out


@_reachable
def claim_namespace(bank: MemoryBank, run_id: str, resume: bool = False) -> Lease:
    """Take the namespace for run `run_id` and start renewing the lease; raises NamespaceBusy
    or StaleBank in one line. Settings: bank.lease_ttl_s, bank.clear_stale."""
    cfg, ns = bank.cfg, bank.keys.namespace
    lease = Lease(bank, run_id, cfg.lease_ttl_s)
    if not lease.acquire() and not (resume and _own_dead_session(bank, lease, run_id) and lease.acquire()):
        raw, ttl = bank.r.get(lease.key), bank.r.pttl(lease.key)
        raise NamespaceBusy(
            f"bank.namespace {ns!r} is in use by a live run ({describe_holder(raw)}, lease expires in "
            f"{max(ttl, 0) / 1000:.0f}s unless renewed): stop that run, or set another bank.namespace")
    try:
        held = leftovers(bank)
        owner = (bank.r.get(bank.keys.owner) or b"").decode("utf-8", "replace")
        if any(held.values()):
            if resume and owner == run_id:
                n = bank.requeue_all_pending()
                log.info("bank: resuming run %s on namespace %r: %s, %d pending groups requeued",
                         run_id, ns, held, n)
                bank.sweep_orphans()   # nothing pushes yet: every unindexed entry is an orphan
            elif cfg.clear_stale:
                n = bank.clear(keep_lease=True)
                log.warning("bank: deleted %d keys left in namespace %r by %s (bank.clear_stale)",
                            n, ns, owner or "an unknown run")
            else:
                raise StaleBank(
                    f"bank.namespace {ns!r} holds data of a run that is no longer live "
                    f"({owner or 'unknown run'}): {held['queued']} queued groups, {held['pending']} "
                    f"pending, {held['entries']} stored entries; resume that run, set another "
                    "bank.namespace, or delete the data with bank.clear_stale=true "
                    "(vgrpo train --clear-stale-bank)")
        bank.r.set(bank.keys.owner, run_id)
    except BaseException:
        lease.release()
        raise
    return lease.start()


def _own_dead_session(bank: MemoryBank, lease: Lease, run_id: str) -> bool:
    """Whether the lease is held by an earlier session of this same run, on this host, by a
    process that is gone, and was dropped (only if unchanged): a session whose server died under
    it could not release its lease, which the server kept (AOF) with its TTL. A holder on another
    host, or alive, stays and the resume is refused."""
    raw = bank.r.get(lease.key)
    try:
        d = json.loads(raw or "")
        mine = d["run"] == run_id and d["host"] == socket.gethostname() and int(d["pid"]) != os.getpid()
    except (ValueError, TypeError, KeyError, OverflowError):
        return False
    if not mine or pid_alive(int(d["pid"])):
        return False
    if not int(eval_cached(bank.r, RELEASE, 1, lease.key, raw)):
        return False   # it changed meanwhile: someone else decides
    log.warning("bank: run %s's previous session (pid %s on this host) is gone and left its lease on "
                "namespace %r; taken over", run_id, d["pid"], bank.keys.namespace)
    return True


def _s(raw: bytes | None) -> str:
    return raw.decode("utf-8", "replace") if raw is not None else "none"


def held_fence(namespace: str) -> str | None:
    """The fence of the lease this process holds on `namespace`, if any (memory_bank.ref)."""
    return _HELD.get(namespace)
