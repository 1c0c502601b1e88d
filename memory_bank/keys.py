"""Every Redis key of the bank, built in one place.

Layout (namespace `ns`, which config restricts to [A-Za-z0-9_.-]):
- per entry, hash tag = entry id, so an entry's two keys share a Cluster slot:
  `ns:e:{eid}:meta` (hash of codec fields) and `ns:e:{eid}:blob` (safetensors bytes);
- global structures, hash tag = namespace, so one Lua script can update them atomically:
  `ns:{ns}:fresh` list of group ids (FIFO, producers RPUSH),
  `ns:{ns}:pending:<consumer>` per consumer: groups it pulled but has not committed (reliable
  queue; a consumer requeues only its own), `ns:{ns}:consumers` set of those consumer ids,
  `ns:{ns}:lease` the live run's ownership lease (TTL), `ns:{ns}:owner` the run that owns the data,
  `ns:{ns}:done` / `ns:{ns}:dead` capped lists of committed / dropped groups,
  `ns:{ns}:g:<gid>` hash: a queued group's entry ids, condition, version, push token, bytes and
  the key of its condition record (`ck`),
  `ns:{ns}:c:<cid>` list: a condition's banked entry ids, oldest first,
  `ns:{ns}:einfo` hash eid -> JSON {b: bytes, c: composite, v: version, cond: cid, k: cond key},
  `ns:{ns}:cinfo` hash cond key -> JSON {b: bytes, n: entries naming it, q: queued entries
  naming it, cond: cid}: the accounting of the encoded conditions,
  `ns:{ns}:condrec:<cond key>` hash: one encoded condition (memory_bank/codec.encode_cond),
  stored once per condition id, encoder and bytes (its key: their digest) and deleted, inside
  the script that drops it, when no entry names it any more (so it shares the {ns} slot),
  `ns:{ns}:bankz` zset of banked eids by bank order (global eviction under max_bytes),
  `ns:{ns}:conds` set of conditions with a non-empty index,
  `ns:{ns}:bytes` counter of every entry's bytes, `ns:{ns}:qbytes` counter of the bytes of
  queued (fresh or pending) groups, `ns:{ns}:counts` hash of counters,
  `ns:{ns}:trash` hash eid -> bytes: entries evicted whose keys the caller has not deleted yet
  (a lost reply leaves them there until the next evicting call returns them),
  `ns:{ns}:quarantine` hash eid -> JSON {reason, time, condition, version, banked}: the dead
  letters, entries that decoded but could not be trained (capped at QUARANTINE_CAP).
Only the first `{...}` of a key is its hash tag, so ids after it may hold any character.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_NAMESPACE = re.compile(r"^[A-Za-z0-9_.-]+$")
_EID = re.compile(r"^[0-9a-f]{32}$")

DONE_CAP = 10_000   # committed group ids kept for inspection
DEAD_CAP = 1_000    # dropped (corrupt) group ids kept for inspection
QUARANTINE_CAP = 1_000   # quarantine records kept (the oldest are forgotten beyond it)


@dataclass(frozen=True)
class Keys:
    namespace: str

    def __post_init__(self):
        if not _NAMESPACE.match(self.namespace):
            raise ValueError(f"bank.namespace {self.namespace!r} must match [A-Za-z0-9_.-]+")

    # --- global structures: tag {ns} ---
    @property
    def _g(self) -> str:
        return f"{self.namespace}:{{{self.namespace}}}"

    @property
    def fresh(self) -> str:
        return f"{self._g}:fresh"

    def pending(self, consumer: str) -> str:
        return f"{self._g}:pending:{check_name(consumer, 'consumer id')}"

    @property
    def consumers(self) -> str:
        return f"{self._g}:consumers"

    @property
    def lease(self) -> str:
        return f"{self._g}:lease"

    @property
    def owner(self) -> str:
        return f"{self._g}:owner"

    @property
    def qbytes(self) -> str:
        return f"{self._g}:qbytes"

    @property
    def done(self) -> str:
        return f"{self._g}:done"

    @property
    def dead(self) -> str:
        return f"{self._g}:dead"

    @property
    def einfo(self) -> str:
        return f"{self._g}:einfo"

    @property
    def cinfo(self) -> str:
        return f"{self._g}:cinfo"

    def cond_record(self, ck: str) -> str:
        """An encoded condition's record; the scripts build the same key as cinfo's sibling
        (`ns:{ns}:condrec:` + key), so it must stay `cinfo` with `cinfo` → `condrec:`."""
        return f"{self.cond_record_prefix}{check_eid(ck)}"

    @property
    def cond_record_prefix(self) -> str:
        """What every condition record's key starts with (the orphan sweep scans it)."""
        return f"{self._g}:condrec:"

    @property
    def bankz(self) -> str:
        return f"{self._g}:bankz"

    @property
    def conds(self) -> str:
        return f"{self._g}:conds"

    @property
    def bytes(self) -> str:
        return f"{self._g}:bytes"

    @property
    def counts(self) -> str:
        return f"{self._g}:counts"

    @property
    def trash(self) -> str:
        return f"{self._g}:trash"

    @property
    def quarantine(self) -> str:
        return f"{self._g}:quarantine"

    @property
    def cond_prefix(self) -> str:
        return f"{self._g}:c:"

    @property
    def group_prefix(self) -> str:
        return f"{self._g}:g:"

    def group(self, gid: str) -> str:
        return f"{self.group_prefix}{gid}"

    def cond(self, cid: str) -> str:
        return f"{self.cond_prefix}{cid}"

    # --- per entry: tag {eid} ---
    def meta(self, eid: str) -> str:
        return f"{self.namespace}:e:{{{check_eid(eid)}}}:meta"

    def blob(self, eid: str) -> str:
        return f"{self.namespace}:e:{{{check_eid(eid)}}}:blob"

    @property
    def entry_pattern(self) -> str:
        """SCAN pattern for every entry key (meta and blob) of this namespace."""
        return f"{self.namespace}:e:*"

    def entry_id(self, key: str) -> str | None:
        """The entry id of an entry key of this namespace, else None."""
        head = f"{self.namespace}:e:{{"
        if key.startswith(head) and key.endswith(("}:meta", "}:blob")):
            eid = key[len(head):-len("}:meta")]
            return eid if _EID.match(eid) else None
        return None

    @property
    def pattern(self) -> str:
        """SCAN pattern for every key of this namespace."""
        return f"{self.namespace}:*"


def check_name(name: str, what: str) -> str:
    """Consumer ids (and namespaces) use [A-Za-z0-9_.-] only, so they never break a key."""
    if not isinstance(name, str) or not _NAMESPACE.match(name):
        raise ValueError(f"{what} {name!r} must match [A-Za-z0-9_.-]+")
    return name


def check_eid(eid: str) -> str:
    """Entry ids (uuid4) and condition keys (a digest) are 32 hex chars, so they never break a
    key or a hash tag."""
    if not _EID.match(eid):
        raise ValueError(f"bad entry id {eid!r}: expected 32 lowercase hex characters")
    return eid
