"""Find and delete entry keys that no index names: what a lost reply or a killed producer
leaves behind, outside the bank's byte accounting.

Two kinds. Entries evicted by a script whose caller never saw the reply stay in the `trash`
hash (memory_bank.scripts); every later evicting call returns them, and this sweep deletes
whatever is left. Entries written by a push whose script never ran (the producer died between
its writes and the script, or gave up on a dropped connection) are in no index at all: a SCAN
of the namespace's entry keys finds them, and likewise the encoded-condition records such a
push wrote first that `cinfo` never came to count. The sweep runs when a run claims its namespace on
resume (nothing is pushing then); a live run may call it with `min_age_s` so that a push in
flight, whose entries exist a moment before its script indexes them, is never touched.
"""

from __future__ import annotations

import logging

import redis

from memory_bank.keys import Keys, stored_whole
from memory_bank.scripts import run

log = logging.getLogger(__name__)
BATCH = 256


def sweep_orphans(r: redis.Redis, k: Keys, min_age_s: float = 0.0) -> dict[str, int]:
    """Delete the trash and every entry no index names (untouched for min_age_s); returns
    {"entries": n, "bytes": b} and counts them under the `orphans` counter."""
    trash = {_s(e): stored_whole(b) or 0 for e, b in r.hgetall(k.trash).items()}  # 0: damaged
    known = {_s(e) for e in r.hkeys(k.einfo)}
    stray: set[str] = set()
    for key in r.scan_iter(match=k.entry_pattern, count=1000):
        eid = k.entry_id(_s(key))
        if eid is not None and eid not in known and eid not in trash:
            stray.add(eid)
    stray = {e for e in stray if _idle_enough(r, k, [k.meta(e), k.blob(e)], min_age_s)}
    counted = {_s(c) for c in r.hkeys(k.cinfo)}
    prefix = k.cond_record_prefix
    records = [key for key in (_s(x) for x in r.scan_iter(match=prefix + "*", count=1000))
               if key[len(prefix):] not in counted and _idle_enough(r, k, [key], min_age_s)]
    nbytes = sum(trash.values()) + sum(_size(r, k, sorted(stray)))
    ids = sorted(trash) + sorted(stray)
    for i in range(0, len(ids), BATCH):
        chunk = ids[i:i + BATCH]
        cmds = [("DEL", k.meta(e), k.blob(e)) for e in chunk]
        if done := [e for e in chunk if e in trash]:
            cmds.append(("HDEL", k.trash, *done))
        run(r, cmds)
    for i in range(0, len(records), BATCH):
        run(r, [("DEL", *records[i:i + BATCH])])
    if ids or records:
        r.hincrby(k.counts, "orphans", len(ids) + len(records))
        log.warning("bank: reclaimed %d orphan entries (%d bytes) and %d condition records in "
                    "namespace %r: %d evicted by calls whose reply was lost, %d written by pushes "
                    "that never queued them", len(ids), nbytes, len(records), k.namespace, len(trash),
                    len(stray))
    return {"entries": len(ids), "bytes": nbytes, "cond_records": len(records)}


def _idle_enough(r: redis.Redis, k: Keys, keys: list[str], min_age_s: float) -> bool:
    if min_age_s <= 0:
        return True
    for key in keys:
        try:
            idle = r.object("idletime", key)
        except Exception:  # noqa: BLE001 — an LFU server has no idle time: leave it be
            return False
        if idle is not None and idle < min_age_s:
            return False
    return True


def _size(r: redis.Redis, k: Keys, eids: list[str]) -> list[int]:
    """Bytes of entries as a push counts them (blob plus metadata fields and values)."""
    out = []
    for i in range(0, len(eids), BATCH):
        pipe = r.pipeline(transaction=False)
        for e in eids[i:i + BATCH]:
            pipe.strlen(k.blob(e)).hgetall(k.meta(e))
        got = pipe.execute()
        out += [int(n) + sum(len(f) + len(v) for f, v in meta.items())
                for n, meta in zip(got[::2], got[1::2], strict=True)]
    return out


def _s(v: bytes | str) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else v
