"""The bank's data in a checkpoint: `<checkpoint>/bank/{index.json, entries.bin}`.

A checkpoint carries the bank, so a resume restores it whatever Redis keeps (the default
embedded server has no persistence, `bank.aof: false`). `index.json` holds the queued and
pending groups, each condition's banked entry ids in order, the bank order, counters and
per-entry accounting, the offset of each entry and of each encoded-condition record in
`entries.bin` and that file's SHA-256. `entries.bin` is, per entry, its metadata as UTF-8 JSON
then its safetensors blob (the codec's own bytes), then per condition record the same (its
fields as JSON, then its blob). A record's references are counted again from the entries
restored. Format 2; a format-1 dump (an older vgrpo's entries, which carried no encoded
condition) is refused in one line. Restoring checks the digest and decodes every entry before it writes
anything: a bank is restored whole or not at all, and the driver says which in one line.

On an object store (a `s3://` run root) the two files are uploaded one object each, index.json
last and an older index.json removed first, so a reader finds a bank only when it is whole.

Restoring happens only into an empty namespace: a Redis that still holds the run's data
(AOF, an external server) is the newer copy, and the checkpoint's watermark
(`MemoryBank.restore`) reconciles it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import shutil
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from common import storage
from memory_bank import codec
from memory_bank.bank import MemoryBank, _s
from memory_bank.errors import BankUnavailable, CorruptEntry
from memory_bank.keys import VERSION_MAX, check_eid, read_info, stored_whole
from memory_bank.scripts import eval_cached

log = logging.getLogger(__name__)

DIR, INDEX, DATA = "bank", "index.json", "entries.bin"
FORMAT = 2
BATCH = 64   # entries fetched per MULTI
SLACK = 256  # bytes an entry's metadata may have grown since its push counted it ('trained', 'status')

# KEYS: fresh, consumers, einfo, bankz, counts, conds, cinfo. ARGV: pending prefix, group prefix,
# cond prefix. One atomic read of every index: pending then fresh groups with their records,
# each condition's entry ids, per-entry accounting, the bank order, counters.
INDEX_READ = """
local queue = {}
for _, c in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  for _, g in ipairs(redis.call('LRANGE', ARGV[1] .. c, 0, -1)) do queue[#queue + 1] = g end
end
for _, g in ipairs(redis.call('LRANGE', KEYS[1], 0, -1)) do queue[#queue + 1] = g end
local groups = {}
for i, g in ipairs(queue) do groups[i] = {g, redis.call('HGETALL', ARGV[2] .. g)} end
local conds = {}
for _, cid in ipairs(redis.call('SMEMBERS', KEYS[6])) do
  conds[#conds + 1] = {cid, redis.call('LRANGE', ARGV[3] .. cid, 0, -1)}
end
return {groups, conds, redis.call('HGETALL', KEYS[3]),
        redis.call('ZRANGE', KEYS[4], 0, -1, 'WITHSCORES'), redis.call('HGETALL', KEYS[5]),
        redis.call('HKEYS', KEYS[7])}
"""


def _pairs(flat: list) -> dict[str, str]:
    return {_s(a): _s(b) for a, b in zip(flat[::2], flat[1::2], strict=True)}


def dump_bank(bank: MemoryBank, ckpt_dir: str | Path) -> str | None:
    """Write the bank's data into `ckpt_dir/bank/` (atomically); None when written, else the
    one line saying why the checkpoint has no bank data."""
    where = storage.location(ckpt_dir)
    try:
        if storage.is_uri(where):
            with tempfile.TemporaryDirectory(prefix="vgrpo-bank-") as tmp:
                out = _dump(bank, Path(tmp))
                _upload(Path(tmp) / DIR, where / DIR)
        else:
            out = _dump(bank, where)
    except BankUnavailable as e:
        return f"checkpoint without the bank's data: {e}"
    log.info("bank: %d queued groups and %d banked entries (%d bytes) written to %s",
             out["groups"], out["banked"], out["bytes"], where / DIR)
    return None


def _upload(local: Path, dest: storage.Uri) -> None:
    """entries.bin, then index.json: the index is the marker, so it goes last (and first)."""
    storage.remove(dest / INDEX)
    storage.write(dest / DATA, (local / DATA).read_bytes())
    storage.write(dest / INDEX, (local / INDEX).read_bytes())


def _dump(bank: MemoryBank, ckpt_dir: Path) -> dict[str, int]:
    k = bank.keys
    groups_raw, conds_raw, einfo_raw, bankz_raw, counts_raw, cks_raw = eval_cached(
        bank.r, INDEX_READ, 7, k.fresh, k.consumers, k.einfo, k.bankz, k.counts, k.conds, k.cinfo,
        f"{k._g}:pending:", k.group_prefix, k.cond_prefix)
    groups = [{"id": _s(g), "fields": _pairs(h)} for g, h in groups_raw]
    conds = {_s(row[0]): [_s(e) for e in row[1]] for row in conds_raw}
    einfo = _pairs(einfo_raw)
    order = {_s(e): float(s) for e, s in zip(bankz_raw[::2], bankz_raw[1::2], strict=True)}
    want = [e for grp in groups for e in grp["fields"].get("eids", "").split()]
    want += [e for ids in conds.values() for e in ids]
    tmp = ckpt_dir / f".{DIR}-tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        entries, records, digest, size = _write_entries(bank, want, [_s(c) for c in cks_raw], tmp / DATA)
        # entries evicted (or corrupt) since the index read: banked ones leave the index, a
        # group missing a member is left out (a resume draws its condition again)
        conds = {c: kept for c, ids in conds.items() if (kept := [e for e in ids if e in entries])}
        groups = [g for g in groups if all(e in entries for e in g["fields"].get("eids", "").split())]
        index = {
            "format": FORMAT, "namespace": k.namespace, "time": time.time(), "groups": groups,
            "conds": conds, "bankz": {e: s for e, s in order.items() if e in entries},
            "einfo": {e: einfo[e] for e in entries if e in einfo}, "counts": _pairs(counts_raw),
            "entries": entries, "cond_records": records, "sha256": digest, "size": size,
        }
        (tmp / INDEX).write_text(json.dumps(index), encoding="utf-8")
        final = ckpt_dir / DIR
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"groups": len(groups), "banked": sum(len(v) for v in conds.values()), "bytes": size}


def _write_entries(bank: MemoryBank, eids: list[str], cks: list[str], path: Path
                   ) -> tuple[dict[str, list[int]], dict[str, list[int]], str, int]:
    """Fetch entries in MULTI batches and append them to `path`, then the condition records
    they name; returns {eid: [offset, meta bytes, blob bytes]} for the entries that exist and
    decode (and whose record does), the same for the records, the digest, the size."""
    h, out, recs = hashlib.sha256(), {}, {}
    with open(path, "wb") as f:
        off = _append_records(bank, cks, f, h, recs)
        for i in range(0, len(eids), BATCH):
            chunk = list(dict.fromkeys(eids[i:i + BATCH]))
            pipe = bank.r.pipeline(transaction=True)
            for eid in chunk:
                pipe.hgetall(bank.keys.meta(eid)).get(bank.keys.blob(eid))
            raw = pipe.execute()
            for j, eid in enumerate(chunk):
                meta, blob = raw[2 * j], raw[2 * j + 1]
                if eid in out or (not meta and blob is None):
                    continue              # a duplicate id, or evicted since the index read
                try:
                    if codec.decode(meta, blob, copy=False).cond_key not in recs:
                        raise CorruptEntry("its condition record is not in the checkpoint")
                    m = json.dumps({_s(a): _s(b) for a, b in meta.items()}).encode()
                except CorruptEntry as e:
                    log.error("bank: entry %s left out of the checkpoint: %s", eid, e)
                    continue
                for part in (m, blob):
                    f.write(part)
                    h.update(part)
                out[eid] = [off, len(m), len(blob)]
                off += len(m) + len(blob)
    return out, recs, h.hexdigest(), off


def _append_records(bank: MemoryBank, cks: list[str], f, h, recs: dict[str, list[int]]) -> int:
    """Append the condition records that exist and decode (fields as JSON, then the blob)."""
    off = 0
    for i in range(0, len(cks), BATCH):
        chunk = cks[i:i + BATCH]
        pipe = bank.r.pipeline(transaction=False)
        for ck in chunk:
            pipe.hgetall(bank.keys.cond_record(ck))
        for ck, raw in zip(chunk, pipe.execute(), strict=True):
            try:
                if not raw or codec.decode_cond(raw, copy=False)[0] != ck:
                    raise CorruptEntry("missing or keyed otherwise")
            except CorruptEntry as e:
                log.error("bank: condition record %s left out of the checkpoint: %s", ck, e)
                continue
            fields = {_s(a): b for a, b in raw.items()}
            m = json.dumps({a: _s(b) for a, b in fields.items() if a != "blob"}).encode()
            for part in (m, fields["blob"]):
                f.write(part)
                h.update(part)
            recs[ck] = [off, len(m), len(fields["blob"])]
            off += len(m) + len(fields["blob"])
    return off


def step_dir(ckpt: str | Path, step: int) -> Path:
    """The checkpoint directory of `step` under a checkpoints root (or `ckpt` itself)."""
    p = storage.location(ckpt)
    return p if (p / DIR).exists() or (p / "extra.json").is_file() else p / f"step_{step:08d}"


def restore_bank(bank: MemoryBank, ckpt_dir: str | Path) -> str:
    """Load a checkpoint's bank data into an empty namespace; one line saying what happened.

    Whoever calls it, nothing is trusted: the index's offsets and every count the bank will keep
    (each entry's bytes against what it holds, each group's as its entries', the counters) are
    checked, and the data sized against this bank's bank.max_bytes, before anything is written. A
    dump whose queued groups (never evicted) do not fit is refused; banked entries are a cache, so
    the oldest are left out until the rest fits."""
    src = storage.location(ckpt_dir) / DIR
    try:
        held = bank.stats()
        if held["fresh"] or held["pending"] or held["entries"]:
            return (f"bank: kept the {held['entries']} entries Redis still holds (namespace "
                    f"{bank.keys.namespace!r}); the checkpoint's copy was not needed")
        if not (src / INDEX).is_file():
            return (f"bank: cannot restore the bank: {src / INDEX} is missing (a checkpoint "
                    "written without it); resuming with an empty bank")
        try:
            index, records = _read(src, bank.keys.namespace)
            sizes = _check_counts(index, records)
            out, out_bytes = _fit(index, records, sizes, bank.cfg.max_bytes)
        except Exception as e:  # noqa: BLE001 — an untrusted file: any failure to read it refuses it
            why = f"{INDEX} lacks the field {e}" if isinstance(e, KeyError) else " ".join(str(e).split())[:500]
            why = why or type(e).__name__
            return f"bank: cannot restore the bank from {src}: {why}; resuming with an empty bank"
        _write(bank, index, records)
    except BankUnavailable as e:
        return f"bank: cannot restore the bank from {src}: {e}; resuming with an empty bank"
    banked = sum(len(v) for v in index["conds"].values())
    left = (f"; left out the {out} oldest banked entries ({out_bytes} bytes) over bank.max_bytes="
            f"{bank.cfg.max_bytes}") if out else ""
    return (f"bank: restored {banked} banked entries and {len(index['groups'])} queued groups "
            f"from {src}{left}")


def _read(src: Path, namespace: str) -> tuple[dict[str, Any], dict[str, tuple[dict, bytes]]]:
    """Parse and check everything before anything is written (raises with the reason)."""
    index = json.loads((src / INDEX).read_text(encoding="utf-8"))
    if isinstance(index, dict) and index.get("format") == 1:
        raise ValueError(f"{INDEX}: format 1, a bank written by an older vgrpo (its entries carry no encoded "
                         "condition, which the learner needs); it is not read")
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ValueError(f"{INDEX}: unknown format {index.get('format') if isinstance(index, dict) else index!r}")
    if index["namespace"] != namespace:
        raise ValueError(f"it is for bank.namespace {index['namespace']!r}, this run uses {namespace!r}")
    data = (src / DATA).read_bytes()
    if len(data) != index["size"] or hashlib.sha256(data).hexdigest() != index["sha256"]:
        raise ValueError(f"{DATA} is damaged ({len(data)} bytes, checksum mismatch)")
    for key in ("cond_records", "entries"):
        _need(isinstance(index[key], dict), f"'{key}'", "must be a map of id -> [offset, meta bytes, blob bytes]")
        for name, loc in index[key].items():
            _need(isinstance(loc, list) and len(loc) == 3 and all(_whole(x) for x in loc)
                  and sum(loc) <= len(data), f"'{key}.{name}'",
                  f"must be 3 byte counts >= 0 inside the file's {len(data)} bytes, got {_short(loc)}")
    conds = {}
    for ck, (off, n_meta, n_blob) in index["cond_records"].items():
        fields = {**json.loads(data[off:off + n_meta]), "blob": data[off + n_meta:off + n_meta + n_blob]}
        if codec.decode_cond(fields, copy=False)[0] != ck:
            raise CorruptEntry(f"condition record {ck}: it holds another key")
        conds[ck] = fields
    records = {}
    for eid, (off, n_meta, n_blob) in index["entries"].items():
        check_eid(eid)
        meta = json.loads(data[off:off + n_meta])
        blob = data[off + n_meta:off + n_meta + n_blob]
        e = codec.decode(meta, blob, copy=False)
        if e.id != eid:
            raise CorruptEntry(f"entry {eid}: its metadata names another id")
        if e.cond_key not in conds:
            raise ValueError(f"entry {eid} names condition record {e.cond_key}, which the file does not hold")
        records[eid] = (meta, blob)
    index["cond_fields"] = conds
    for grp in index["groups"]:
        if any(e not in records for e in grp["fields"].get("eids", "").split()):
            raise ValueError(f"group {grp['id']!r} names entries the file does not hold")
    for cid, ids in index["conds"].items():
        if any(e not in records for e in ids):
            raise ValueError(f"condition {cid!r} names entries the file does not hold")
    return index, records


def _need(ok: bool, field: str, what: str) -> None:
    if not ok:
        raise ValueError(f"{INDEX}: {field} {what}")


def _whole(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _short(v: Any) -> str:
    text = repr(v) if not isinstance(v, int) or abs(v) < 10 ** 20 else "a number past int64"
    return text if len(text) <= 60 else text[:60] + "…"


def _check_counts(index: dict[str, Any], records: dict[str, tuple[dict, bytes]]) -> dict[str, int]:
    """Every count the restored bank keeps, as a push and the scripts write it: each entry's index
    info (its bytes no fewer than its blob's and no more than it holds, its condition and record
    those of its metadata), each queued group's bytes its entries' and its version, each banked
    entry's place in the bank order, the counters; every entry once, in one group or one
    condition's bank. Returns each entry's bytes."""
    einfo, groups, conds = index["einfo"], index["groups"], index["conds"]
    _need(isinstance(einfo, dict) and set(einfo) == set(records), "'einfo'",
          "must hold the accounting of exactly the entries the file holds")
    sizes: dict[str, int] = {}
    for eid, (meta, blob) in records.items():
        try:
            d = read_info(einfo[eid], meta["condition"])
        except ValueError as e:
            raise ValueError(f"{INDEX}: 'einfo.{eid}': {e}") from None
        held = len(blob) + sum(len(f) + len(v.encode()) for f, v in meta.items())
        _need(len(blob) <= d["b"] <= held + SLACK, f"'einfo.{eid}'",
              f"counts {d['b']} bytes; the entry holds {held} ({len(blob)} of them its blob)")
        _need(d["k"] == meta["cond_key"], f"'einfo.{eid}'", "names another condition record than the entry")
        sizes[eid] = d["b"]
    _need(isinstance(groups, list), "'groups'", "must be a list of queued groups")
    placed = Counter(e for ids in conds.values() for e in ids)
    for i, g in enumerate(groups):
        fields = g.get("fields") if isinstance(g, dict) else None
        _need(isinstance(fields, dict) and isinstance(g.get("id"), str)
              and all(isinstance(v, str) for v in fields.values()), f"'groups[{i}]'", "must be {id, fields}")
        eids = fields.get("eids", "").split()
        placed.update(eids)
        _need(stored_whole(fields.get("bytes")) == sum(sizes[e] for e in eids), f"'groups[{i}].fields.bytes'",
              f"is {_short(fields.get('bytes'))}, its entries count {sum(sizes[e] for e in eids)}")
        _need(stored_whole(fields.get("version"), VERSION_MAX) is not None, f"'groups[{i}].fields.version'",
              f"is {_short(fields.get('version'))}, not a policy version")
        _need(all(records[e][0]["condition"] == fields.get("cond") for e in eids), f"'groups[{i}].fields.cond'",
              "is not its entries' condition")
    for cid, ids in conds.items():
        _need(all(records[e][0]["condition"] == cid for e in ids), f"'conds.{cid}'", "lists entries of another condition")
    _need(not (twice := [e for e, n in placed.items() if n > 1]), "an entry",
          f"is listed more than once ({twice[:1]})")
    bankz = index["bankz"]
    _need(isinstance(bankz, dict) and set(bankz) == {e for ids in conds.values() for e in ids}
          and all(_finite(v) for v in bankz.values()), "'bankz'",
          "must give each banked entry a finite place in the bank order")
    counts = index["counts"]
    _need(isinstance(counts, dict), "'counts'", "must be a map of name -> count")
    for name, v in counts.items():
        _need(stored_whole(v) is not None, f"'counts.{name}'", f"is {_short(v)}, not a count")
    return sizes


def _finite(v: Any) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False


def _fit(index: dict[str, Any], records: dict[str, tuple[dict, bytes]], sizes: dict[str, int],
         max_bytes: int) -> tuple[int, int]:
    """Size the dump against bank.max_bytes as the bank counts it (entries, and each condition
    record once while an entry names it): queued groups that do not fit are refused (ValueError);
    past that, the oldest banked entries are left out of `index` and `records` until the rest
    fits. Returns (entries left out, their bytes)."""
    key = {eid: meta["cond_key"] for eid, (meta, _) in records.items()}
    record_bytes = {ck: codec.cond_nbytes(f) for ck, f in index["cond_fields"].items()}
    queued = {e for g in index["groups"] for e in g["fields"].get("eids", "").split()}
    need = sum(sizes[e] for e in queued) + sum(record_bytes[ck] for ck in {key[e] for e in queued})
    if need > max_bytes:
        raise ValueError(f"its {len(index['groups'])} queued groups need {need} bytes with their condition "
                         f"records, over bank.max_bytes={max_bytes} (queued groups are never evicted); "
                         f"raise bank.max_bytes to at least {need} to keep them")
    refs = Counter(key.values())
    total = sum(sizes.values()) + sum(record_bytes[ck] for ck in refs)
    out: list[str] = []
    for eid in sorted(index["bankz"], key=index["bankz"].get):   # oldest first
        if total <= max_bytes:
            break
        out.append(eid)
        total -= sizes[eid]
        refs[key[eid]] -= 1
        if not refs[key[eid]]:
            total -= record_bytes[key[eid]]
    gone = set(out)
    for eid in out:
        del records[eid], index["einfo"][eid], index["bankz"][eid]
    index["conds"] = {c: kept for c, ids in index["conds"].items() if (kept := [e for e in ids if e not in gone])}
    return len(out), sum(sizes[e] for e in out)


def _write(bank: MemoryBank, index: dict[str, Any], records: dict[str, tuple[dict, bytes]]) -> None:
    k = bank.keys
    pipe = bank.r.pipeline(transaction=False)
    for n, (eid, (meta, blob)) in enumerate(records.items(), 1):
        pipe.hset(k.meta(eid), mapping=meta).set(k.blob(eid), blob)
        if n % BATCH == 0:
            pipe.execute()
    cinfo = _cinfo(index)
    for ck in cinfo:   # a record no restored entry names stays out (it would be an orphan)
        pipe.hset(k.cond_record(ck), mapping=index["cond_fields"][ck])
    pipe.execute()
    total = sum(int(json.loads(v)["b"]) for v in index["einfo"].values())
    total += sum(c["b"] for c in cinfo.values())
    queued = sum(int(g["fields"].get("bytes") or 0) for g in index["groups"])
    queued += sum(c["b"] for c in cinfo.values() if c["q"])
    pipe = bank.r.pipeline(transaction=True)   # the global structures appear at once
    if index["einfo"]:
        pipe.hset(k.einfo, mapping=index["einfo"])
    if cinfo:
        pipe.hset(k.cinfo, mapping={ck: json.dumps(c) for ck, c in cinfo.items()})
    for cid, ids in index["conds"].items():
        pipe.rpush(k.cond(cid), *ids).sadd(k.conds, cid)
    if index["bankz"]:
        pipe.zadd(k.bankz, index["bankz"])
    for grp in index["groups"]:
        pipe.hset(k.group(grp["id"]), mapping=grp["fields"]).rpush(k.fresh, grp["id"])
    if index["counts"]:
        pipe.hset(k.counts, mapping=index["counts"])
    pipe.set(k.bytes, total).set(k.qbytes, queued)
    pipe.execute()


def _cinfo(index: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each restored condition record's accounting, counted again from the restored entries:
    {b: its bytes, n: entries naming it, q: those in queued groups, cond: its condition id}."""
    queued = {e for g in index["groups"] for e in g["fields"].get("eids", "").split()}
    out: dict[str, dict[str, Any]] = {}
    for eid, raw in index["einfo"].items():
        ck = json.loads(raw).get("k")
        fields = index["cond_fields"].get(ck)
        if fields is None:
            continue
        c = out.setdefault(ck, {"b": codec.cond_nbytes(fields), "n": 0, "q": 0, "cond": _s(fields["condition"])})
        c["n"] += 1
        c["q"] += eid in queued
    return out
