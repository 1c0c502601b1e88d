"""MemoryBank: producers push scored groups, the learner pulls fresh groups plus banked
entries of the same condition, then commits (TAGRPO memory bank, ALGORITHM.md section 6).

Lifecycle of a group: push → `fresh` queue → pull → the consumer's `pending` → commit → its
members enter the condition's bank (per strategy) or are dropped. Pull/commit form a reliable
queue: a learner crash between them leaves the group in its `pending`, and `requeue_pending`
(by the same consumer) or a new owner's `requeue_all_pending` returns it.

Space: `bank.max_bytes` bounds every stored byte. Queued groups are never evicted, so a push
that does not fit beside them raises `BankFull` (wait with `wait_for_space`); banked entries
are a cache, evicted oldest first to make room.

Conditions: a group's encoded condition (`Group.cond`) is stored once, as a record keyed by its
condition id, what encoded it and its bytes (memory_bank/keys.py `cond_record`), named by each
member's entry; it counts in the bytes while an entry names it and is deleted with the last.
Pulled trajectories carry it again (`Trajectory.cond`, one object per record and pull).

Reads and evictions are atomic with respect to each other: an entry's two keys are read in
one MULTI/EXEC and deleted in one DEL, and an entry evicted between the index read and the
fetch reads as gone (skipped), never as corrupt.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import redis
import torch

from common.actor_metrics import count_bank_evictions
from common.config import BankConfig
from common.types import Cond, Group, Scores, TrainBatch, Trajectory
from memory_bank import codec
from memory_bank.codec import Entry
from memory_bank.errors import (
    BankFull,
    BankTooSmall,
    BankUnavailable,
    CorruptEntry,
    DuplicateGroup,
    LeaseLost,
    UnscoredGroup,
)
from memory_bank.keys import (
    DEAD_CAP,
    DONE_CAP,
    QUARANTINE_CAP,
    VERSION_MAX,
    Keys,
    check_eid,
    check_name,
    read_info,
    stored_whole,
)
from memory_bank.orphans import sweep_orphans
from memory_bank.scripts import Fence, Scripts, run, run_one

log = logging.getLogger(__name__)

LOW_WATERMARK = 0.9
# bank.strategy -> the commit script's mode at a step (which fresh members enter the bank): FIFO,
# FIFO every second step (TAGRPO's FIFO-S2), or SDU's replacement rule (memory_bank/scripts.py)
STRATEGIES: dict[str, Callable[[int], str]] = {
    "fifo": lambda step: "fifo",
    "fifo_s2": lambda step: "fifo" if step % 2 == 0 else "skip",
    "sdu": lambda step: "sdu",
}
"""Over max_bytes, commit evicts the oldest banked entries down to this share of it."""
SNAPSHOT_FORMAT = 1
STORED_CONDS_CAP = 4096
"""Condition records a producer remembers having stored (it then skips resending them)."""
WAIT_LOG_S = 30.0
"""While producers wait for space, one log line this often."""
P = ParamSpec("P")
R = TypeVar("R")


def _reachable(fn: Callable[P, R]) -> Callable[P, R]:
    """Redis connection failures (after the client's bounded retries) become BankUnavailable,
    a fenced script's refusal (the first argument is the bank) LeaseLost."""
    @functools.wraps(fn)
    def wrapper(*args: P.args, **kw: P.kwargs) -> R:
        try:
            return fn(*args, **kw)
        except (redis.ConnectionError, redis.TimeoutError) as e:
            raise BankUnavailable(f"memory bank: Redis unreachable during {fn.__name__}: "
                                  f"{type(e).__name__}") from None
        except redis.ResponseError as e:
            if not str(e).startswith("LEASELOST"):
                raise
            bank = args[0]
            raise LeaseLost.from_reply(bank.keys.namespace, str(e), bool(bank.fence.value)) from None
    return wrapper


def snapshot_problem(snap: Any, namespace: str) -> str | None:
    """Why a checkpoint's bank snapshot (`MemoryBank.snapshot`) cannot be restored into bank
    namespace `namespace`; None when it can. A resume asks before anything starts."""
    if not isinstance(snap, dict) or snap.get("format") != SNAPSHOT_FORMAT:
        fmt = snap.get("format") if isinstance(snap, dict) else snap
        return f"unknown format {str(fmt)[:40]!r} (this vgrpo writes {SNAPSHOT_FORMAT})"
    if snap.get("namespace") != namespace:
        return (f"it is for bank.namespace {str(snap.get('namespace'))[:80]!r}, where the run's data is; "
                f"this bank is {namespace!r}")
    banked = snap.get("banked") or {}
    if not isinstance(banked, dict) or not all(
            isinstance(v, list) and all(isinstance(e, str) for e in v) for v in banked.values()):
        return "field 'banked' must map condition id -> [entry id]"
    return None


def check_step_fits(groups_per_step: int, group_bytes: int, max_bytes: int) -> None:
    """Refuse a bank that cannot hold one training step's groups: its producer would wait
    forever for space that only that step's commit frees."""
    need = groups_per_step * group_bytes
    if need > max_bytes:
        raise BankTooSmall(
            f"bank.max_bytes={max_bytes} cannot hold one training step: train.groups_per_step="
            f"{groups_per_step} x {group_bytes} bytes per group = {need} bytes; set bank.max_bytes "
            f"to at least {need} or lower train.groups_per_step")


class MemoryBank:
    """Redis-backed memory bank. Any number of producers and consumers; each consumer (an id
    of [A-Za-z0-9_.-], random by default) owns its pending groups."""

    def __init__(self, client: redis.Redis, cfg: BankConfig, consumer: str | None = None,
                 fence: str | None = None):
        self.r = client
        self.cfg = cfg
        self.keys = Keys(cfg.namespace)
        # the run's lease value: every script that moves a group checks it (memory_bank.scripts)
        self.fence = Fence(self.keys.lease, max(1, int(cfg.lease_ttl_s * 1000)), fence or "", self.keys.epoch)
        self.scripts = Scripts(self.fence)
        self.dropped_ids: list[str] = []  # fresh groups dropped as corrupt by pull, for the caller to refill
        self.consumer = check_name(consumer or uuid.uuid4().hex[:16], "consumer id")
        self.groups_per_step: int | None = None
        self.group_bytes = 0            # the largest group this producer pushed (space estimate)
        self._stored_conds = RecentKeys(STORED_CONDS_CAP)  # condition records this producer stored
        self._wait_since: float | None = None
        self._wait_logged = 0.0

    def expect_step(self, groups_per_step: int) -> None:
        """The driver's groups per step: push_group then refuses, at the first group, a bank
        whose bank.max_bytes cannot hold one step (see check_step_fits)."""
        self.groups_per_step = int(groups_per_step)

    def __repr__(self) -> str:  # never shows the connection (its URL holds the password)
        c = self.cfg
        return (f"MemoryBank(namespace={c.namespace!r}, strategy={c.strategy!r}, "
                f"capacity={c.capacity}, max_staleness={c.max_staleness}, max_bytes={c.max_bytes})")

    # ------------------------------------------------------------------ producers
    @_reachable
    def push_group(self, group: Group) -> str:
        """Store a scored group and queue it as fresh; returns its group id."""
        # 1. Validate: scored, one condition, shapes agree.
        gid, heads = group.group_id, _checked_heads(group)
        # 2. Encode the condition once and the members (frames are not stored).
        ck, record = codec.encode_cond(group.condition.id, group.cond, checked=self._stored_conds)
        cbytes = codec.cond_nbytes(record)
        eids = [uuid.uuid4().hex for _ in group.members]
        encoded = [codec.encode(eid, m, heads, group.scores.values[i], float(group.composite[i]), cond_key=ck)
                   for i, (eid, m) in enumerate(zip(eids, group.members, strict=True))]
        # 3. Write entry keys (and the condition record unless it is stored), then queue the
        #    group atomically, in one round trip: nobody sees the entries until it is queued.
        k = self.keys
        cmds: list = []
        info: list[str] = []
        total = 0
        for eid, m, (meta, blob) in zip(eids, group.members, encoded, strict=True):
            cmds.append(("HSET", k.meta(eid), *[x for kv in meta.items() for x in kv]))
            cmds.append(("SET", k.blob(eid), blob))
            nbytes = len(blob) + sum(len(f) + len(v.encode()) for f, v in meta.items())
            total += nbytes
            info += [eid, json.dumps({"b": nbytes, "c": float(meta["composite"]),
                                      "v": m.policy_version, "cond": group.condition.id, "k": ck})]
        if self.groups_per_step is not None:
            check_step_fits(self.groups_per_step, total + cbytes, self.cfg.max_bytes)
        res, out, queued, extra = self._queue(cmds, group, ck, record, cbytes, total, info, eids)
        self.group_bytes = max(self.group_bytes, total + cbytes)
        if res == -1:
            self._delete_entries(eids)
            raise DuplicateGroup(f"group_id {gid!r} is already queued in bank {k.namespace!r}: "
                                 "producers must use unique group ids")
        if res == -3:
            self._delete_entries(eids)
            raise BankUnavailable(f"memory bank: the condition record of group {gid!r} was evicted "
                                  "each time it was written during the push; retry")
        if res == -2:
            self._delete_entries(eids)
            raise BankFull(f"bank {k.namespace!r} is full: queued groups hold {int(queued)} bytes and "
                           f"group {gid!r} needs {total + int(extra)} more, over bank.max_bytes="
                           f"{self.cfg.max_bytes}; wait_for_space() until the learner pulls and "
                           "commits, or raise bank.max_bytes")
        count_bank_evictions(len(out))
        return gid

    def _queue(self, cmds: list, group: Group, ck: str, record: dict, cbytes: int, total: int,
               info: list[str], eids: list[str]) -> tuple[int, list, int, int]:
        """Run the PUSH script after `cmds` (the entries' writes), in one round trip, with the
        condition record written first unless this producer stored it before (`_stored_conds`:
        no round trip to ask); when the record is gone (its last entries were evicted since),
        the script answers -3 and the record is written again. Returns (code, the ids
        evicted or reclaimed, queued bytes, what the condition added to the queued bytes)."""
        k, token = self.keys, uuid.uuid4().hex
        write_record = ("HSET", k.cond_record(ck), *[x for kv in record.items() for x in kv])
        if ck not in self._stored_conds:   # else the script answers -3 if it was dropped since
            cmds = [*cmds, write_record]
        for _ in range(3):
            replies = run(self.r, [*cmds, self.scripts.push.call(
                keys=[k.group(group.group_id), k.fresh, k.einfo, k.bytes, k.counts, k.qbytes, k.bankz,
                      k.conds, k.cinfo, k.trash],
                args=[group.group_id, token, group.condition.id, group.policy_version, total, group.size,
                      self.cfg.max_bytes, k.cond_prefix, ck, cbytes, *info])])
            if err := next((r for r in replies if isinstance(r, Exception)), None):
                self._delete_entries(eids)   # a refused or failed script queued nothing
                raise err
            res, out, *rest = replies[-1]
            self._reclaim(out)           # banked entries evicted to make room, and older trash
            if res in (0, 1):
                self._stored_conds.remember(ck)
            if res != -3:
                queued, extra = [*rest, 0, 0][:2]
                return res, out, int(queued), int(extra)
            self._stored_conds.forget(ck)
            cmds = [write_record]
        return -3, [], 0, 0

    @_reachable
    def bytes_used(self) -> int:
        return int(self.r.get(self.keys.bytes) or 0)

    @_reachable
    def queued_bytes(self) -> int:
        """Bytes of the groups waiting in fresh or pending (never evicted for space)."""
        return int(self.r.get(self.keys.qbytes) or 0)

    def has_space(self, nbytes: int | None = None) -> bool:
        """Whether a group of nbytes (default: the largest this producer pushed) fits beside the
        queued groups; banked entries make room by eviction."""
        need = self.group_bytes if nbytes is None else nbytes
        return self.queued_bytes() + max(need, 1) <= self.cfg.max_bytes

    def wait_for_space(self, timeout_s: float, poll_s: float = 0.05, nbytes: int | None = None,
                       log_every_s: float = WAIT_LOG_S) -> bool:
        """Block until has_space(nbytes) or timeout; returns has_space(). While the bank stays
        full, one log line every log_every_s (across calls) says so and for how long."""
        deadline = time.monotonic() + timeout_s
        while not self.has_space(nbytes):
            now = time.monotonic()
            if self._wait_since is None:
                self._wait_since = self._wait_logged = now
            elif now - self._wait_logged >= log_every_s:
                self._wait_logged = now
                log.warning("bank %r full for %.0fs: queued groups hold %d of bank.max_bytes=%d "
                            "bytes; producers wait for the learner to pull and commit",
                            self.keys.namespace, now - self._wait_since, self.queued_bytes(),
                            self.cfg.max_bytes)
            left = deadline - now
            if left <= 0:
                return False
            time.sleep(min(poll_s, left))
            poll_s = min(poll_s * 1.5, 1.0)
        self._wait_since = None
        return True

    # ------------------------------------------------------------------ the learner
    @_reachable
    def pull(self, n: int, version: int) -> TrainBatch:
        """Up to n fresh groups (FIFO), each with its condition's banked entries whose
        policy version is within bank.max_staleness of `version`."""
        k = self.keys
        # 1. Move up to n groups fresh → pending and read their records and their
        #    conditions' bank indexes, atomically, in one round trip.
        groups, banks = run_one(self.r, self.scripts.pull.call(
            keys=[k.fresh, k.pending(self.consumer), k.einfo, k.consumers],
            args=[n, k.group_prefix, k.cond_prefix, self.consumer]))
        batch = TrainBatch(fresh=[], bank=[], version=version)
        if not groups:
            return batch
        # 2. Banked entry ids (and their condition records' keys) per condition, filtered by
        #    staleness.
        banked = {_s(row[0]): self._fresh_enough(_s(row[0]), row[1:], version) for row in banks}
        # 3. Decode each group, and its condition's bank entries once per pull (one round trip
        #    per group, which also reads the condition records they name); skip what is corrupt.
        cache: dict[str, list[Entry]] = {}
        conds: dict[str, Cond] = {}   # one object per condition record and pull
        for gid, cid, ver, eids, ck in ([_s(v) for v in row] for row in groups):
            bank_eids = {} if cid in cache else banked.get(cid, {})
            group, entries = self._load_group(gid, cid, ver, eids.split(), list(bank_eids), conds,
                                              {ck, *bank_eids.values()} - {""})
            cache.setdefault(cid, entries)
            if group is None:
                self._drop_group(gid)
                continue
            cache[cid], usable = self._match_bank(group, cache[cid])
            batch.fresh.append(group)
            batch.bank.append(usable)
        return batch

    @_reachable
    def commit(self, batch: TrainBatch, step: int) -> None:
        """After the optimizer step: pending → done, fresh members enter the bank per
        bank.strategy, trained counts go up, evicted entries are deleted."""
        k, cfg = self.keys, self.cfg
        mode = STRATEGIES[cfg.strategy](step)
        if not cfg.enabled:
            mode = "skip"  # bank.enabled=false: a plain exactly-once queue, nothing is banked
        # 1. Move each group out of pending and bank its members, atomically per group.
        low = int(cfg.max_bytes * LOW_WATERMARK)
        keeps = [[t.bank_id for t in grp.members if t.bank_id] for grp in batch.fresh]
        outs = run(self.r, [self.scripts.commit.call(
            keys=[k.pending(self.consumer), k.group(grp.group_id), k.cond(grp.condition.id),
                  k.einfo, k.bytes, k.counts, k.done, k.conds, k.bankz, k.qbytes, k.cinfo, k.trash,
                  k.quarantine],
            args=[grp.group_id, mode, cfg.capacity, grp.condition.id, low, k.cond_prefix,
                  DONE_CAP, "committed", *keep]) for grp, keep in zip(batch.fresh, keeps, strict=True)])
        if err := next((o for o in outs if isinstance(o, Exception)), None):
            raise err   # LEASELOST refuses every one alike; nothing was committed
        # 2. For the groups just committed: trained counts up on what survived (the bank
        #    entries used and the members now banked), evicted entries deleted.
        evicted: set[str] = set()
        touch: dict[str, str] = {}     # eid -> new status ('' keeps it)
        bank_used = batch.bank or [[] for _ in batch.fresh]
        for grp, keep, (done, out), entries in zip(batch.fresh, keeps, outs, bank_used, strict=True):
            evicted |= {_s(e) for e in out}
            if not done:
                log.warning("bank: group %r was not pending (committed twice?); ignored",
                            grp.group_id)
                continue
            touch.update({t.bank_id: "" for t, _, _ in entries if t.bank_id})
            touch.update({eid: "banked" for eid in keep})
        cmds = [self.scripts.touch.call(keys=[k.meta(eid)], args=[1, status])
                for eid, status in touch.items()
                if eid not in evicted]   # the script never recreates a deleted entry either
        self._reclaim(sorted(evicted), cmds)
        # trimmed by capacity or the byte bound (members of a skipped step were never banked)
        count_bank_evictions(len(evicted - ({e for ks in keeps for e in ks} if mode in ('skip', 'drop') else set())))

    @_reachable
    def queued_ids(self) -> list[str]:
        """Ids of the fresh groups waiting to be pulled, oldest first."""
        return [_s(g) for g in self.r.lrange(self.keys.fresh, 0, -1)]

    @_reachable
    def requeue_pending(self) -> int:
        """Put this consumer's groups pulled but never committed back at the head of the fresh
        queue. Other consumers' pending groups are theirs (they may be training them now)."""
        n = int(run_one(self.r, self.scripts.requeue.call(
            keys=[self.keys.pending(self.consumer), self.keys.fresh])))
        if n:
            log.info("bank: requeued %d pending groups", n)
        return n

    @_reachable
    def discard(self, gids: list[str], after_version: int) -> tuple[int, int]:
        """Drop what a resume rolled back: the queued fresh groups `gids`, and banked entries
        stamped with a policy version above `after_version`. Both were sampled by weights of a
        lost timeline whose version numbers the resumed learner reuses. Returns (groups, entries)."""
        k = self.keys
        groups = 0
        for gid in gids:
            if run_one(self.r, self.scripts.discard.call(keys=[k.fresh, k.pending(self.consumer)],
                                                          args=[gid])):
                self._drop_group(gid)  # out of the queue into the dead list, entries deleted
                groups += 1
        entries = 0
        for cid in sorted(_s(c) for c in self.r.smembers(k.conds)):
            late = [e.id for e in self.entries(cid) if e.trajectory.policy_version > after_version]
            if late:
                self._evict_banked(cid, late)
                entries += len(late)
        return groups, entries

    @_reachable
    def requeue_all_pending(self) -> int:
        """Every consumer's pending groups back to fresh: only for the namespace's owner taking
        over from a dead run (memory_bank.ownership), when no other consumer is live."""
        k = self.keys
        n = int(run_one(self.r, self.scripts.requeue_all.call(
            keys=[k.consumers, k.fresh, f"{k._g}:pending"], args=[f"{k._g}:pending:"])))
        if n:
            log.info("bank: requeued %d pending groups of earlier consumers", n)
        return n

    @_reachable
    def pending_ids(self) -> list[str]:
        """Ids of the groups pulled but not committed, by any consumer."""
        k = self.keys
        out: list[str] = []
        for c in sorted(_s(c) for c in self.r.smembers(k.consumers)):
            out += [_s(g) for g in self.r.lrange(k.pending(c), 0, -1)]
        return out

    @_reachable
    def sweep_orphans(self, min_age_s: float = 0.0) -> dict[str, int]:
        """Delete entry keys no index names (memory_bank.orphans); {"entries", "bytes"}."""
        return sweep_orphans(self.r, self.keys, min_age_s)

    # ------------------------------------------------------------------ dead letters
    @_reachable
    def quarantine(self, entry_id: str, reason: str) -> None:
        """Dead letter for an entry that decodes but cannot be trained: its record (reason,
        time, condition, version) is kept under the quarantine key and counted; a banked entry
        leaves the bank (its data is deleted), a member of a queued group is never banked when
        its group commits. The caller drops or redraws the group, as for a corrupt one."""
        check_eid(entry_id)
        why = self._quarantine(entry_id, reason)
        log.warning("bank: quarantined entry %s: %s", entry_id, why)

    def _quarantine(self, eid: str, reason: str, cid: str = "", nbytes: int | None = None) -> str:
        """The QUARANTINE script; `cid`: the condition whose index lists the entry (its index
        info may not say), `nbytes`: its bytes when its index info cannot say. Returns the reason
        as recorded."""
        k = self.keys
        why = " ".join(str(reason).split())[:500] or "no reason given"
        out = run_one(self.r, self.scripts.quarantine.call(
            keys=[k.einfo, k.bytes, k.bankz, k.conds, k.trash, k.quarantine, k.counts, k.qbytes, k.cinfo],
            args=[eid, why, repr(time.time()), k.cond_prefix, QUARANTINE_CAP, cid,
                  "" if nbytes is None else nbytes]))
        self._reclaim(out)
        return why

    @_reachable
    def evict(self, condition_id: str, entry_ids: list[str]) -> None:
        """Take banked entries out of a condition's index and delete them (entries this run cannot
        use, such as those sampled with other settings; not counted as corrupt or quarantined)."""
        for eid in entry_ids:
            check_eid(eid)
        self._evict_banked(condition_id, list(entry_ids))

    @_reachable
    def drop_pulled(self, group_id: str) -> None:
        """A group this consumer pulled and will not train: out of pending into the dead list, its
        members deleted (the caller draws its condition again). Listed in `dropped_ids`."""
        self._drop_group(group_id)

    @_reachable
    def quarantined(self) -> list[dict[str, Any]]:
        """The quarantine's records, newest first: {id, reason, time, condition, version,
        banked, seq} (the last QUARANTINE_CAP)."""
        out = []
        for eid, raw in self.r.hgetall(self.keys.quarantine).items():
            try:
                rec = json.loads(raw)
            except (ValueError, RecursionError):
                rec = {"reason": "unreadable quarantine record"}
            rec = rec if isinstance(rec, dict) else {}
            out.append({"id": _s(eid), **rec, "time": _num(rec.get("time"))})
        return sorted(out, key=lambda r: -_num(r.get("seq")))

    @_reachable
    def quarantine_count(self) -> int:
        """Entries ever quarantined in this namespace."""
        return _counter(self.r.hget(self.keys.counts, "quarantined") or 0)

    # ------------------------------------------------------------------ inspection
    @_reachable
    def entries(self, condition_id: str) -> list[Entry]:
        """A condition's banked entries, oldest first, whatever their version."""
        eids = [_s(e) for e in self.r.lrange(self.keys.cond(condition_id), 0, -1)]
        return [e for _, e in self._fetch(eids, condition_id)]

    @_reachable
    def stats(self) -> dict[str, Any]:
        """Counts by status, bytes, queue depths, stored condition records, corrupt count and Redis
        round-trip latency."""
        k = self.keys
        t0 = time.perf_counter()
        self.r.ping()
        latency_ms = (time.perf_counter() - t0) * 1e3
        pipe = self.r.pipeline(transaction=False)
        pipe.llen(k.fresh).get(k.bytes).hgetall(k.counts)
        pipe.zcard(k.bankz).scard(k.conds).hlen(k.einfo).get(k.qbytes).hlen(k.cinfo).hvals(k.trash)
        fresh, nbytes, counts, banked, conds, entries, qbytes, records, trash = pipe.execute()
        pending = len(self.pending_ids())
        c = {_s(a): _counter(b) for a, b in counts.items()}
        return {
            "fresh": fresh, "pending": pending, "banked": banked, "entries": entries,
            "conditions": conds, "pushed": c.get("pushed", 0), "committed": c.get("committed", 0),
            "dropped": c.get("dropped", 0), "corrupt": c.get("corrupt", 0),
            "quarantined": c.get("quarantined", 0), "orphans_reclaimed": c.get("orphans", 0),
            "trash": len(trash), "trash_bytes": sum(_counter(b) for b in trash),
            "cond_records": records, "bytes": int(nbytes or 0), "queued_bytes": int(qbytes or 0),
            "max_bytes": self.cfg.max_bytes,
            "redis_latency_ms": latency_ms,
        }

    @_reachable
    def snapshot(self) -> dict[str, Any]:
        """A JSON-able watermark for a checkpoint: pending groups and each condition's bank."""
        k = self.keys
        conds = sorted(_s(c) for c in self.r.smembers(k.conds))
        pipe = self.r.pipeline(transaction=False)
        for cid in conds:
            pipe.lrange(k.cond(cid), 0, -1)
        indexes = pipe.execute()
        return {
            "format": SNAPSHOT_FORMAT, "namespace": k.namespace, "time": time.time(),
            "pending": self.pending_ids(),
            "banked": {cid: [_s(e) for e in ix] for cid, ix in zip(conds, indexes, strict=True)},
            "counts": {_s(a): _counter(b) for a, b in self.r.hgetall(k.counts).items()},
        }

    @_reachable
    def restore(self, snap: dict[str, Any]) -> dict[str, int]:
        """Resume from a snapshot: requeue pending groups and set each condition's bank to
        the snapshot's entries that still exist (entries banked since are evicted; entries
        evicted since cannot come back and are counted as missing)."""
        k = self.keys
        if (why := snapshot_problem(snap, k.namespace)) is not None:
            raise ValueError(f"bank snapshot: {why}")
        banked = snap.get("banked") or {}
        requeued = self.requeue_all_pending()   # restoring is taking over: no consumer is live
        current = {_s(c) for c in self.r.smembers(k.conds)}
        kept = missing = 0
        evicted: list[str] = []
        for cid in sorted(current | set(banked)):
            want = banked.get(cid, [])
            n, gone = run_one(self.r, self.scripts.restore.call(
                keys=[k.cond(cid), k.einfo, k.bytes, k.conds, k.bankz, k.counts, k.qbytes, k.cinfo,
                      k.trash],
                args=[cid, *want]))
            kept, missing = kept + n, missing + len(want) - n
            evicted += [_s(e) for e in gone]
        self._reclaim(evicted)
        out = {"requeued": requeued, "restored": kept, "missing": missing, "evicted": len(evicted)}
        log.info("bank: restored snapshot %s", out)
        return out

    @_reachable
    def clear(self, keep_lease: bool = False) -> int:
        """Delete every key of this namespace (tests, or starting a run afresh); keep_lease
        keeps the run-ownership lease (memory_bank.ownership) of the caller and its epoch."""
        n = 0
        batch: list[bytes] = []
        for key in self.r.scan_iter(match=self.keys.pattern, count=500):
            if keep_lease and key.decode("utf-8", "replace") in (self.keys.lease, self.keys.epoch):
                continue
            batch.append(key)
            if len(batch) >= 500:
                n += self.r.delete(*batch)
                batch = []
        if batch:
            n += self.r.delete(*batch)
        return n

    # ------------------------------------------------------------------ internals
    def _fresh_enough(self, cid: str, flat: list, version: int) -> dict[str, str]:
        """A condition's banked entry ids (oldest first) within the staleness bound, each with
        the key of its condition record ('' if unknown); `flat` alternates entry id and its
        einfo JSON."""
        keep, bad = {}, []
        for eid, info in zip(flat[::2], flat[1::2], strict=True):
            eid = _s(eid)
            try:
                d = read_info(info, cid)
            except ValueError as e:   # any value a push never writes: 1e999, NaN, -7, 10**400, ...
                bad.append((eid, f"unreadable index info: {e}" if info else "no index info"))
                continue
            if version - d["v"] <= self.cfg.max_staleness:
                keep[eid] = d["k"]
        if bad:
            self._dead_letters(cid, bad)
        return keep

    def _dead_letters(self, cid: str, bad: list[tuple[str, str]]) -> None:
        """Banked entries of condition `cid` whose index info cannot be read: each is skipped,
        counted corrupt, logged, and quarantined with its reason (out of the index, its data
        deleted). The scripts cannot read its bytes then, so they are given what its push
        counted (`_pushed_bytes`)."""
        ids = [eid for eid, _ in bad if _valid_eid(eid)]
        sizes = self._pushed_bytes(ids)
        for eid, why in bad:
            self._corrupt(f"bank entry {eid[:80]!r} of condition {cid!r}: {why}")
        for eid, why in bad:
            if eid in sizes:
                self._quarantine(eid, why, cid, sizes[eid])
        if foreign := [eid for eid, _ in bad if eid not in sizes]:  # no keys of ours to delete
            self._evict_banked(cid, foreign)

    def _pushed_bytes(self, eids: list[str]) -> dict[str, int]:
        """Each entry's bytes as its push counted them (blob and metadata, status 'fresh' and
        trained '0' as written then), from what Redis holds now; 0 when nothing is left."""
        if not eids:
            return {}
        pipe = self.r.pipeline(transaction=False)
        for eid in eids:
            pipe.strlen(self.keys.blob(eid)).hgetall(self.keys.meta(eid))
        got = pipe.execute()
        out = {}
        for eid, n, meta in zip(eids, got[::2], got[1::2], strict=True):
            m = {bytes(f): bytes(v) for f, v in meta.items()}
            if m:
                m.update({b"status": b"fresh", b"trained": b"0"})
            out[eid] = int(n) + sum(len(f) + len(v) for f, v in m.items())
        return out

    def _load_group(self, gid: str, cid: str, version: str, eids: list[str], bank_eids: list[str],
                    conds: dict[str, Cond], records: set[str]) -> tuple[Group | None, list[Entry]]:
        """Decode a pulled group (None when no member is usable) and the given bank entries;
        `records`: the condition records they name, as far as the index says."""
        v = stored_whole(version, VERSION_MAX)
        if v is None:
            self._corrupt(f"group {gid!r}: record missing or incomplete (version {version[:40]!r})")
            return None, []
        fetched = self._fetch(eids + bank_eids, cid, members=set(eids), conds=conds, records=records)
        own = set(eids)
        members = [e for eid, e in fetched if eid in own]
        bank = [e for eid, e in fetched if eid not in own]
        if members:  # foreign members with another latent shape or other heads are dropped
            shape = Counter(tuple(e.trajectory.final_latents.shape) for e in members).most_common(1)[0][0]
            heads = members[0].heads
            bad = [e for e in members if tuple(e.trajectory.final_latents.shape) != shape or e.heads != heads]
            for e in bad:
                self._corrupt(f"group {gid!r} entry {e.id}: shape/heads differ from the group")
            members = [e for e in members if e not in bad]
        if not members:
            self._corrupt(f"group {gid!r}: no decodable member")
            return None, bank
        members.sort(key=lambda e: e.trajectory.member)
        cond = members[0].trajectory.condition
        for e in members:  # one Condition object per group
            e.trajectory.condition = cond
        group = Group(
            condition=cond, group_id=gid, policy_version=v,
            members=[e.trajectory for e in members],
            scores=Scores(list(members[0].heads), torch.stack([e.scores for e in members])),  # [G, H]
            composite=torch.tensor([e.composite for e in members], dtype=torch.float32),  # [G]
        )
        return group, bank

    def _match_bank(self, group: Group, bank: list[Entry]
                    ) -> tuple[list[Entry], list[tuple[Trajectory, torch.Tensor, float]]]:
        """(entries still valid, those usable with this group: same latent shape and heads)."""
        cid, heads = group.condition.id, group.scores.heads
        shape = tuple(group.members[0].final_latents.shape)
        out, bad = [], []
        for e in bank:
            if tuple(e.trajectory.final_latents.shape) != shape or sorted(e.heads) != sorted(heads):
                self._corrupt(f"bank entry {e.id} of condition {cid!r}: shape "
                              f"{tuple(e.trajectory.final_latents.shape)}/heads {e.heads} differ from "
                              f"the fresh group's {shape}/{heads}")
                bad.append(e.id)
                continue
            scores = e.scores[[e.heads.index(h) for h in heads]]  # [H] in the group's head order
            e.trajectory.condition = group.condition
            out.append((e.trajectory, scores, e.composite))
        if bad:
            self._evict_banked(cid, bad)
        return [e for e in bank if e.id not in bad], out

    def _fetch(self, eids: list[str], cid: str, members: set[str] = frozenset(),
               conds: dict[str, Cond] | None = None, records: set[str] = frozenset()
               ) -> list[tuple[str, Entry]]:
        """Decode entries (one atomic round trip, which also reads the condition `records` not
        in `conds` yet) with their encoded conditions (`_with_conds`); corrupt ones are logged,
        counted and evicted. A banked entry whose keys are both gone was evicted after the index
        was read: it is skipped, not corrupt. A group member (`members`) is never evicted while
        queued, so a gone member is corrupt."""
        conds = {} if conds is None else conds
        good_ids, bad = [], []
        for eid in eids:
            try:
                check_eid(eid)
                good_ids.append(eid)
            except ValueError:
                self._corrupt(f"condition {cid!r}: foreign entry id {eid[:80]!r}")
                bad.append(eid)
        # MULTI/EXEC: no eviction's DEL can fall between an entry's meta and blob reads; the
        # blobs are received straight into their own buffers (memory_bank.wire)
        raw: list = []
        read = sorted(ck for ck in records if ck not in conds and _valid_eid(ck)) if good_ids else []
        if good_ids:
            k = self.keys
            cmds = [("MULTI",), *[c for eid in good_ids for c in (("HGETALL", k.meta(eid)),
                                                                   ("GET", k.blob(eid)))],
                    *[("HGETALL", k.cond_record(ck)) for ck in read], ("EXEC",)]
            replies = run(self.r, cmds)
            if isinstance(replies[-1], Exception):
                raise replies[-1]
            raw = [_pairs(r) if i % 2 == 0 else r for i, r in enumerate(replies[-1][:2 * len(good_ids)])]
            self._take_records(read, [_pairs(r) for r in replies[-1][2 * len(good_ids):]], cid, conds)
        out, gone = [], []
        for i, eid in enumerate(good_ids):
            if not raw[2 * i] and raw[2 * i + 1] is None and eid not in members:
                gone.append(eid)
                continue
            try:
                if isinstance(raw[2 * i + 1], Exception) or isinstance(raw[2 * i], Exception):
                    raise CorruptEntry(f"keys of another type: {raw[2 * i + 1]}")
                # no copy: the blob is this call's own read-only buffer, and pulled tensors are
                # only read (the learner trains on what Ray serialises from them)
                e = codec.decode(raw[2 * i], raw[2 * i + 1], copy=False)
                if e.id != eid or e.trajectory.condition.id != cid:
                    raise CorruptEntry(f"id/condition {e.id}/{e.trajectory.condition.id!r} do not "
                                       f"match the index ({eid}/{cid!r})")
                out.append((eid, e))
            except CorruptEntry as err:
                self._corrupt(f"entry {eid} of condition {cid!r}: {err}")
                bad.append(eid)
        out = self._with_conds(out, cid, members, conds, bad, gone, tried=set(read))
        if gone:
            log.debug("bank: %d entries of condition %r evicted while being fetched", len(gone), cid)
        if bad or gone:
            self._evict_banked(cid, bad + gone)
        return out

    def _with_conds(self, fetched: list[tuple[str, Entry]], cid: str, members: set[str],
                    conds: dict[str, Cond], bad: list[str], gone: list[str],
                    tried: set[str] = frozenset()) -> list[tuple[str, Entry]]:
        """Set each entry's trajectory.cond from its condition record (read once per record and
        pull: `conds`; those not `tried` with the entries are read now, in one round trip). An
        entry whose record cannot be read is corrupt (`bad`), unless it is a banked entry
        evicted since it was read (`gone`): its record went with its last entry."""
        k = self.keys
        want = sorted({e.cond_key for _, e in fetched} - set(conds) - tried)
        if want:
            pipe = self.r.pipeline(transaction=False)
            for ck in want:
                pipe.hgetall(k.cond_record(ck))
            self._take_records(want, pipe.execute(), cid, conds)
        out, missing = [], []
        for eid, e in fetched:
            if e.cond_key in conds:
                e.trajectory.cond = conds[e.cond_key]
                out.append((eid, e))
            else:
                missing.append(eid)
        if missing:
            alive = self.r.hmget(k.einfo, missing)
            for eid, info in zip(missing, alive, strict=True):
                if info is None and eid not in members:
                    gone.append(eid)
                else:
                    self._corrupt(f"entry {eid} of condition {cid!r}: its condition record is missing or damaged")
                    bad.append(eid)
        return out

    def _take_records(self, keys: list[str], raws: list, cid: str, conds: dict[str, Cond]) -> None:
        """Decode condition records (HGETALL replies) of condition `cid` into `conds`; a missing
        one is left out, a damaged one is logged and counted, and left out too."""
        for ck, raw in zip(keys, raws, strict=True):
            try:
                key, rec_cid, cond = codec.decode_cond(raw, copy=False) if raw else (ck, cid, None)
                if cond is not None and (key != ck or rec_cid != cid):
                    raise CorruptEntry(f"it is {key}/{rec_cid!r}, not {ck}/{cid!r}")
            except CorruptEntry as err:
                self._corrupt(f"condition record {ck} of condition {cid!r}: {err}")
                continue
            if cond is not None:
                conds[ck] = cond

    def _evict_banked(self, cid: str, eids: list[str]) -> None:
        """Remove entries from a condition's index (no-op for eids not in it) and delete them."""
        k = self.keys
        gone = run_one(self.r, self.scripts.evict.call(
            keys=[k.cond(cid), k.einfo, k.bytes, k.conds, k.bankz, k.qbytes, k.cinfo, k.trash],
            args=[cid, *eids]))
        self._reclaim([_s(e) for e in gone])

    def _drop_group(self, gid: str) -> None:
        """A pulled group with nothing usable: out of pending into the capped dead list."""
        self.dropped_ids.append(gid)
        k = self.keys
        _, out = run_one(self.r, self.scripts.commit.call(
            keys=[k.pending(self.consumer), k.group(gid), k.cond("-"), k.einfo, k.bytes, k.counts,
                  k.dead, k.conds, k.bankz, k.qbytes, k.cinfo, k.trash, k.quarantine],
            args=[gid, "drop", self.cfg.capacity, "-", int(self.cfg.max_bytes * LOW_WATERMARK),
                  k.cond_prefix, DEAD_CAP, "dropped"]))
        self._reclaim([_s(e) for e in out])

    def _reclaim(self, eids: list, cmds: list | None = None) -> None:
        """Delete the keys of entries a script put in the trash, then take them out of it; in
        the round trip of `cmds` (sent first) when given."""
        eids = [_s(e) for e in eids]
        out = list(cmds or [])
        out += [("DEL", self.keys.meta(e), self.keys.blob(e)) for e in eids if _valid_eid(e)]
        if eids:
            out.append(("HDEL", self.keys.trash, *eids))
        if out:
            _raise_first(run(self.r, out))

    def _delete_entries(self, eids: list[str]) -> None:
        """Delete entries' keys, each entry's two in one DEL (atomic against _fetch's MULTI)."""
        cmds = [("DEL", self.keys.meta(e), self.keys.blob(e)) for e in eids if _valid_eid(e)]
        if cmds:
            _raise_first(run(self.r, cmds))

    def _corrupt(self, what: str) -> None:
        log.error("bank: skipped %s", what)
        self.r.hincrby(self.keys.counts, "corrupt", 1)


class RecentKeys:
    """A set of at most `cap` keys; past it, the least recently remembered is forgotten."""

    def __init__(self, cap: int):
        self.cap, self._keys = cap, OrderedDict[str, None]()

    def __contains__(self, key: str) -> bool:
        return key in self._keys

    def remember(self, key: str) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        if len(self._keys) > self.cap:
            self._keys.popitem(last=False)

    def forget(self, key: str) -> None:
        self._keys.pop(key, None)


def _checked_heads(group: Group) -> list[str]:
    """A group push_group accepts: an id, scores [G, H] and composite [G], one condition, and one
    encoded condition its members share; returns its heads."""
    gid, g = group.group_id, group.size
    if not isinstance(gid, str) or not gid or len(gid) > 256:
        raise ValueError(f"group_id {gid!r} must be a non-empty string of at most 256 chars")
    if group.scores is None or group.composite is None:
        raise UnscoredGroup(f"group {gid!r} has no scores/composite: run the reward role before push_group")
    heads = list(group.scores.heads)
    if g == 0 or tuple(group.scores.values.shape) != (g, len(heads)):
        raise ValueError(f"group {gid!r}: scores.values shape {tuple(group.scores.values.shape)}"
                         f" != [G={g}, H={len(heads)}]")
    if tuple(group.composite.shape) != (g,):
        raise ValueError(f"group {gid!r}: composite shape {tuple(group.composite.shape)} != [{g}]")
    for m in group.members:
        if m.condition.id != group.condition.id:
            raise ValueError(f"group {gid!r} member {m.member}: condition {m.condition.id!r} "
                             f"!= group condition {group.condition.id!r}")
        if m.cond is None or m.cond is not group.cond:
            raise ValueError(f"group {gid!r} member {m.member}: no encoded condition shared with the "
                             "group (Trajectory.cond, set by sample_group): the bank stores it once")
    return heads


def _s(v: bytes | str) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else v


def _pairs(flat: Any) -> Any:
    """A flat HGETALL reply as a dict (an error reply stays as it is)."""
    return dict(zip(flat[::2], flat[1::2], strict=True)) if isinstance(flat, list) else flat


def _num(v: Any) -> float:
    """A stored number (a quarantine record's time or sequence); 0.0 unless finite."""
    try:
        f = float(v)
    except (TypeError, ValueError, OverflowError):
        return 0.0
    return f if math.isfinite(f) else 0.0


def _counter(v: Any) -> int:
    """A counter as the scripts keep it; 0 when it is not one (a damaged value)."""
    return stored_whole(v if isinstance(v, (bytes, str)) else str(v)) or 0


def _valid_eid(eid: str) -> bool:
    try:
        check_eid(eid)
        return True
    except ValueError:
        return False   # a foreign id never had keys of ours


def _raise_first(replies: list) -> None:
    if err := next((r for r in replies if isinstance(r, Exception)), None):
        raise err

