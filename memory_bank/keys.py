"""Every Redis key of the bank, built in one place.

Layout (namespace `ns`, which config restricts to [A-Za-z0-9_.-]):
- per entry, hash tag = entry id, so an entry's two keys share a Cluster slot:
  `ns:e:{eid}:meta` (hash of codec fields) and `ns:e:{eid}:blob` (safetensors bytes);
- global structures, hash tag = namespace, so one Lua script can update them atomically:
  `ns:{ns}:fresh` list of group ids (FIFO, producers RPUSH),
  `ns:{ns}:pending:<consumer>` per consumer: groups it pulled but has not committed (reliable
  queue; a consumer requeues only its own), `ns:{ns}:consumers` set of those consumer ids,
  `ns:{ns}:lease` the live run's ownership lease (TTL), `ns:{ns}:lease:epoch` the count of claims
  of it (never expires: a fence names its claim's epoch), `ns:{ns}:owner` the run that owns the data,
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

import json
import math
import re
from dataclasses import dataclass
from typing import Any

_NAMESPACE = re.compile(r"^[A-Za-z0-9_.-]+$")
_EID = re.compile(r"^[0-9a-f]{32}$")

DONE_CAP = 10_000   # committed group ids kept for inspection
DEAD_CAP = 1_000    # dropped (corrupt) group ids kept for inspection
QUARANTINE_CAP = 1_000   # quarantine records kept (the oldest are forgotten beyond it)
COUNT_MAX = 2 ** 53      # a byte count or counter the scripts keep exactly (Lua numbers are doubles)
VERSION_MAX = 2 ** 63    # a policy version: a whole number below this
_WHOLE = re.compile(r"0|[1-9][0-9]{0,18}")   # str(int) >= 0 of at most 19 digits, nothing else


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
    def epoch(self) -> str:
        return f"{self._g}:lease:epoch"

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


# --- values read back: untrusted (a bit flip or a hand can make any of them 1e999, NaN, -7,
# 10**400 or not JSON); each reader below raises ValueError naming the field, or returns None.


def stored_whole(raw: Any, limit: int = COUNT_MAX) -> int | None:
    """A whole number 0 <= n < limit stored as str(int) (a counter, a group's version or bytes),
    else None."""
    text = raw.decode("ascii", "replace") if isinstance(raw, (bytes, bytearray)) else raw
    if not isinstance(text, str) or not _WHOLE.fullmatch(text):
        return None
    n = int(text)
    return n if n < limit else None


def read_info(raw: Any, cid: str | None = None) -> dict[str, Any]:
    """An entry's index info (`einfo`: {b: bytes, c: composite, v: policy version, cond:
    condition id, k: its condition record's key}) exactly as a push writes it, of condition
    `cid` when given; ValueError naming the first field that is not."""
    try:
        d = json.loads(raw)
    except Exception as e:  # noqa: BLE001 — stored bytes: not UTF-8, not JSON, nested too deep...
        raise ValueError(f"not JSON ({type(e).__name__})") from None
    if not isinstance(d, dict):
        raise ValueError(f"a JSON {type(d).__name__}, not an object")
    for name, limit in (("b", COUNT_MAX), ("v", VERSION_MAX)):
        if not (_is_int(d.get(name)) and 0 <= d[name] < limit):
            raise ValueError(f"field {name!r} is {_short(d.get(name))}, expected a whole number in 0..{limit - 1}")
    if not _finite(d.get("c")):
        raise ValueError(f"field 'c' is {_short(d.get('c'))}, expected a finite number")
    if not isinstance(d.get("cond"), str) or (cid is not None and d["cond"] != cid):
        raise ValueError(f"field 'cond' is {_short(d.get('cond'))}, expected the condition id {cid!r}")
    if not (isinstance(d.get("k"), str) and _EID.fullmatch(d["k"])):
        raise ValueError(f"field 'k' is {_short(d.get('k'))}, expected a condition record's key")
    return d


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _finite(v: Any) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:        # an int past float's range (10**400)
        return False


def _short(v: Any) -> str:
    if _is_int(v) and abs(v) >= 10 ** 20:   # str() of an int past 4300 digits raises
        return f"a number of about {int(abs(v).bit_length() * 0.30103) + 1} digits"
    text = repr(v)
    return text if len(text) <= 40 else text[:40] + "…"
