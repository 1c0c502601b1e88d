"""Trajectory <-> (metadata hash fields, safetensors bytes); an encoded condition <-> its record.

Bytes read from Redis are untrusted: decoding never unpickles, checks every field and
shape, and raises only `CorruptEntry` (naming the field) on anything it does not accept.
Numbers are accepted only in the form `encode` writes them (`str(int)`, `repr(float)`), so a
damaged field is never read as another number. `encode` checks its output by decode's own
rules before it returns (the fields as decode reads them, the tensors as decode checks them; the
blob's layout is `tensorfile.pack`'s, which `loads` reads back exactly), so everything it writes
reads back.
Frames are not stored: the learner needs latents, log-probs and rewards, not video.

Each entry stores its SDE scheme's full spec (`scheme`, `scheme_params`: every constructor
argument, `sigmas`), the only thing the learner replays it with, the steps its member trains
and nothing else of the schedule, and the key of its encoded condition (`cond_key`). The
condition's tensors are a record of their own (`encode_cond`), stored once per condition and
encoding (its key: the condition id, what encoded it, and the bytes), not per member; entries
name no file for the learner to open.

Format 3. Format 1 (no scheme spec) and format 2 (every recorded step, conditions re-encoded by
the learner from a prompt and an image path) are refused in one line: neither can be trained
without an encoder, and format 1 not replayed exactly.
An entry of a rollout that records no step (grpo.loss=nft: `step_indices` empty) stores its
final latents only.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
import time
from collections.abc import Container, Mapping
from dataclasses import dataclass
from typing import Any, get_args

import torch
from torch import Tensor

from common.config import SchemeName
from common.sde import Param, SchemeSpec, scheme_from_spec
from common.types import Cond, Condition, Trajectory
from memory_bank.errors import CorruptEntry
from memory_bank.keys import check_eid
from memory_bank.tensorfile import Blob, check_finite, dumps, loads, pack

FORMAT = "3"
OLD_FORMATS = {
    "1": "did not store its SDE scheme's full spec, so it cannot be replayed exactly",
    "2": "stored no encoded condition (the learner re-encoded it from the prompt and an image path)",
}
_INT = re.compile(r"(0|-?[1-9][0-9]*)")   # str(int) and nothing else
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")  # a condition tensor's name (a transformer kwarg)
SCHEMES = frozenset(get_args(SchemeName))
STATUSES = frozenset({"fresh", "banked"})
TENSORS = ("x", "x_next", "logp_old", "final_latents")  # plus "mu_old" when recorded
OPTIONAL_TENSORS = ("mu_old",)
REQUIRED = (
    "format", "id", "condition", "prompt", "group", "member", "seed", "version", "created",
    "scheme", "scheme_params", "guidance_scale", "sigmas", "step_indices", "trained", "heads", "scores",
    "composite", "status", "cond_key",
)
COND_REQUIRED = ("format", "key", "condition", "encoder", "blob")


@dataclass
class Entry:
    """One decoded bank entry: a trajectory with its stored rewards. `trajectory.cond` is None
    here: the bank sets it from the record `cond_key` names."""

    id: str
    trajectory: Trajectory
    heads: list[str]
    scores: Tensor                 # [H] fp32
    composite: float
    status: str
    created: float
    cond_key: str = ""


def encode(eid: str, traj: Trajectory, heads: list[str], scores: Tensor, composite: float,
           status: str = "fresh", cond_key: str = "") -> tuple[dict[str, str], Blob]:
    """Return (metadata hash fields, blob) for one member whose encoded condition is stored as
    the record `cond_key` (see `encode_cond`); raises ValueError on bad input. The blob views
    the trajectory's tensors (sent as they lie; `bytes(blob)` joins it)."""
    check_eid(eid)
    try:
        check_eid(cond_key)
    except ValueError:
        raise ValueError(f"member {traj.member}: cond_key {cond_key!r} is not a condition record's key "
                         "(encode_cond gives it)") from None
    row = [float(s) for s in scores.reshape(-1).tolist()]          # [H]
    if len(row) != len(heads) or not heads:
        raise ValueError(f"member {traj.member}: {len(row)} scores for heads {heads}")
    if not all(math.isfinite(s) for s in [*row, float(composite)]):
        raise ValueError(f"group {traj.group_id!r} member {traj.member}: non-finite reward "
                         f"{row} / {composite}; the reward role must drop such members")
    tensors = {"x": traj.x, "x_next": traj.x_next, "logp_old": traj.logp_old,
               "final_latents": traj.final_latents}
    if not traj.step_indices:  # a rollout that records no step (grpo.loss=nft): its final latents only
        tensors = {"final_latents": traj.final_latents}
    if traj.mu_old is not None:
        tensors["mu_old"] = traj.mu_old
    for field in ("id", "prompt"):
        _utf8(getattr(traj.condition, field), f"condition.{field}")
    _utf8(traj.group_id, "group_id")
    for h in heads:
        _utf8(h, "heads")
    blob = pack(tensors)
    meta = {
        "format": FORMAT,
        "id": eid,
        "condition": traj.condition.id,
        "prompt": traj.condition.prompt,
        "group": traj.group_id,
        "member": str(int(traj.member)),
        "seed": str(int(traj.seed)),
        "version": str(int(traj.policy_version)),
        "created": repr(time.time()),
        "scheme": traj.spec.name,
        "scheme_params": _params_json(traj.spec.params),
        "guidance_scale": repr(float(traj.guidance_scale)),
        "sigmas": json.dumps([float(s) for s in traj.spec.sigmas]),
        "step_indices": json.dumps([int(k) for k in traj.step_indices]),
        "trained": str(int(traj.trained_times)),
        "heads": json.dumps(list(heads)),
        "scores": json.dumps(row),
        "composite": repr(float(composite)),
        "status": status,
        "cond_key": cond_key,
    }
    try:  # what decode would refuse (non-finite latents, a step outside sigmas, ...) is refused here;
        # the tensors are checked as given, not re-read from the blob's header (that cost a push
        # about a quarter of its time at 1 MB entries)
        _decode(meta, None, copy=False, given=tensors)
    except CorruptEntry as e:
        raise ValueError(f"group {traj.group_id!r} member {traj.member}: cannot be stored: {e}") from None
    return meta, blob


def _utf8(v: str, field: str) -> None:
    """Redis stores UTF-8: a string that cannot be encoded (a lone surrogate) is refused here."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{field} {v!r} is not valid Unicode text (it cannot be stored as UTF-8)") from None


def decode(meta: Mapping[Any, Any], blob: bytes | None, copy: bool = True) -> Entry:
    """Rebuild an entry from its hash fields and blob; raises only CorruptEntry.

    copy=False: the tensors view the blob (see tensorfile.loads); only for read-only use.
    """
    try:
        return _decode(meta, blob, copy)
    except CorruptEntry:
        raise
    except Exception as e:  # noqa: BLE001 — untrusted bytes: any other failure is corruption too
        raise CorruptEntry(f"undecodable entry: {type(e).__name__}: {e}") from e


def _decode(meta: Mapping[Any, Any], blob: bytes | None, copy: bool,
            given: dict[str, Tensor] | None = None) -> Entry:
    """`given`: the tensors themselves (encode's check), instead of reading them from `blob`."""
    m = _fields(meta)
    eid = m["id"]
    member, seed, version, trained = (_int(m, f) for f in ("member", "seed", "version", "trained"))
    if member < 0 or trained < 0:
        raise CorruptEntry(f"field 'member'/'trained' negative: {member}/{trained}")
    cfg_scale, composite, created = (_float(m, f) for f in ("guidance_scale", "composite", "created"))
    spec = _spec(m["scheme"], m["scheme_params"], m["sigmas"])
    steps = _steps(m, len(spec.sigmas))
    try:
        check_eid(m["cond_key"])
    except ValueError:
        raise CorruptEntry(f"field 'cond_key' is {m['cond_key'][:40]!r}, expected 32 hex characters") from None
    heads, scores = _json_list(m, "heads", str), _json_list(m, "scores", float)
    if not heads:
        raise CorruptEntry("field 'heads' is empty")
    if len(scores) != len(heads):
        raise CorruptEntry(f"field 'scores' has {len(scores)} values for {len(heads)} heads")
    t = _tensors(blob, len(steps), copy, given)
    traj = Trajectory(
        condition=Condition(id=m["condition"], prompt=m["prompt"]),
        group_id=m["group"], member=member, seed=seed, spec=spec, guidance_scale=cfg_scale,
        policy_version=version, step_indices=steps, x=t.get("x"), x_next=t.get("x_next"),
        logp_old=t.get("logp_old"),
        final_latents=t["final_latents"], frames=None, trained_times=trained, bank_id=eid,
        mu_old=t.get("mu_old"),
    )
    return Entry(id=eid, trajectory=traj, heads=heads,
                 scores=torch.tensor(scores, dtype=torch.float32), composite=composite,
                 status=m["status"], created=created, cond_key=m["cond_key"])


def _fields(meta: Mapping[Any, Any]) -> dict[str, str]:
    """The hash fields as text, all present, of this format, with a valid id and status."""
    m = {_text(k, "field name"): _text(v, k) for k, v in meta.items()}
    missing = [f for f in REQUIRED if f not in m]
    _check_format(m.get("format"), "an entry")  # first: an older entry also lacks newer fields
    if missing:
        raise CorruptEntry(f"missing fields {missing}")
    if m["format"] != FORMAT:
        raise CorruptEntry(f"field 'format' is {m['format']!r}, expected {FORMAT!r}")
    try:
        check_eid(m["id"])
    except ValueError as e:
        raise CorruptEntry(f"field 'id': {e}") from None
    if m["status"] not in STATUSES:
        raise CorruptEntry(f"field 'status' is {m['status']!r}")
    return m


@functools.lru_cache(maxsize=256)
def _spec(scheme: str, scheme_params: str, sigmas: str) -> SchemeSpec:
    """The scheme's full spec from its three fields; its arguments must be exactly what encode
    writes for it. A function of the fields' text and a spec is immutable, so the spec of
    fields already read is reused (a group's members, every pull of a run, share one)."""
    m = {"scheme": scheme, "scheme_params": scheme_params, "sigmas": sigmas}
    if m["scheme"] not in SCHEMES:
        raise CorruptEntry(f"field 'scheme' is {m['scheme']!r}, expected one of {sorted(SCHEMES)}")
    sigmas = _json_list(m, "sigmas", float)
    if len(sigmas) < 2:
        raise CorruptEntry(f"field 'sigmas' has {len(sigmas)} values, expected at least 2 (σ_0 … σ_T)")
    text = m["scheme_params"]
    try:
        params = json.loads(text)
    except (ValueError, RecursionError):
        raise CorruptEntry("field 'scheme_params' is not JSON") from None
    if not isinstance(params, dict) or not all(_is_param(v) for v in params.values()):
        raise CorruptEntry("field 'scheme_params' must be a JSON object of finite numbers, strings and nulls")
    spec = SchemeSpec(m["scheme"], tuple(params.items()), sigmas)
    try:
        scheme = scheme_from_spec(spec)
    except (ValueError, TypeError, OverflowError) as e:
        raise CorruptEntry(f"field 'scheme_params': {e}") from None
    if _params_json(scheme.arguments()) != text:
        raise CorruptEntry(f"field 'scheme_params' is {text[:80]!r}, not the arguments as encode writes them")
    return spec


def _check_format(fmt: str | None, what: str) -> None:
    """Formats 1 and 2 (older vgrpo) are refused in one line that says why."""
    if fmt in OLD_FORMATS:
        raise CorruptEntry(f"field 'format' is {fmt!r}: {what} of an older vgrpo, which "
                           f"{OLD_FORMATS[fmt]}; it is not read (format {FORMAT} is)")


def _steps(m: dict[str, str], n_sigmas: int) -> list[int]:
    """step_indices: the member's trained steps, each a step of the schedule, increasing."""
    steps = _json_list(m, "step_indices", int)
    if any(not 0 <= k < n_sigmas - 1 for k in steps):  # none: a rollout that records no step
        raise CorruptEntry(f"field 'step_indices' {steps} outside 0..{n_sigmas - 2}")
    if any(b <= a for a, b in zip(steps, steps[1:], strict=False)):
        raise CorruptEntry(f"field 'step_indices' {steps} is not strictly increasing")
    return steps


def _tensors(blob: bytes | None, k: int, copy: bool, given: dict[str, Tensor] | None = None
             ) -> dict[str, Tensor]:
    """The blob's tensors: safetensors only (no pickle), exactly the expected names and shapes.
    `given`: the tensors just packed, checked as loads checks what it reads (every float finite)."""
    if given is None and not isinstance(blob, (bytes, bytearray, memoryview, Blob)):
        raise CorruptEntry("blob missing")
    try:
        t = loads(blob, copy=copy) if given is None else check_finite(given)
    except ValueError as e:
        raise CorruptEntry(f"blob rejected: {e}") from None
    return _step_tensors(t, k) if k else _final_only(t)


def _step_tensors(t: dict[str, Tensor], k: int) -> dict[str, Tensor]:
    """The tensors of a trajectory that recorded k > 0 steps: x, x_next, logp_old, final_latents
    (and mu_old), checked."""
    extra, absent = set(t) - {*TENSORS, *OPTIONAL_TENSORS}, set(TENSORS) - set(t)
    if extra or absent:
        raise CorruptEntry(f"blob tensors: missing {sorted(absent)}, unexpected {sorted(extra)}")
    x, x_next, logp_old, final = (t[n] for n in TENSORS)
    if x.dim() != 5 or x.shape[0] != k:
        raise CorruptEntry(f"tensor 'x' shape {tuple(x.shape)}: expected [K={k}, C, F, H, W]")
    if x_next.shape != x.shape:
        raise CorruptEntry(f"tensor 'x_next' shape {tuple(x_next.shape)} != x {tuple(x.shape)}")
    if logp_old.shape != (k,):
        raise CorruptEntry(f"tensor 'logp_old' shape {tuple(logp_old.shape)}: expected [{k}]")
    if final.shape != x.shape[1:]:
        raise CorruptEntry(f"tensor 'final_latents' shape {tuple(final.shape)} != {tuple(x.shape[1:])}")
    for n in TENSORS:
        if not t[n].is_floating_point():
            raise CorruptEntry(f"tensor {n!r} has dtype {t[n].dtype}, expected floating point")
    mu_old = t.get("mu_old")
    if mu_old is not None and (mu_old.shape != x.shape or not mu_old.is_floating_point()):
        raise CorruptEntry(f"tensor 'mu_old' {mu_old.dtype} {tuple(mu_old.shape)}: expected float {tuple(x.shape)}")
    return t


def _final_only(t: dict[str, Tensor]) -> dict[str, Tensor]:
    """A trajectory that recorded no step (grpo.loss=nft): only `final_latents`."""
    extra = set(t) - {"final_latents"}
    if extra or "final_latents" not in t:
        raise CorruptEntry(f"blob of an entry without steps: expected final_latents, got {sorted(t)}")
    final = t["final_latents"]
    if final.dim() != 4 or not final.is_floating_point():
        raise CorruptEntry(f"tensor 'final_latents' {final.dtype} {tuple(final.shape)}: expected float [C, F, H, W]")
    return t


# --- encoded conditions: one record per (condition, encoder, bytes) ----------------------------


def encode_cond(cid: str, cond: Cond, checked: Container[str] = ()) -> tuple[str, dict[str, str | bytes]]:
    """(key, record hash fields) of a group's encoded condition (one row); ValueError on bad input.

    The key is the SHA-256 (32 hex characters) of the condition id, what encoded it
    (`cond.encoder`) and the tensors' bytes: the groups of one condition encoded alike share one
    record, and a record never changes under its key. So a record whose key is in `checked`
    (records this caller encoded before, and stored) is not read back again: its bytes are the
    ones that were."""
    _utf8(cid, "condition.id")
    _utf8(cond.encoder, "cond.encoder")
    tensors = {f"c.{k}": v for k, v in cond.tensors.items()}
    tensors.update({f"u.{k}": v for k, v in (cond.uncond or {}).items()})
    bad = [n for n, t in tensors.items() if t.dim() < 1 or t.shape[0] != 1]
    if bad:
        raise ValueError(f"condition {cid!r}: encoded tensors {bad} do not have one row (a group's "
                         "condition is encoded once: [1, ...])")
    blob = dumps(tensors)
    key = _cond_digest(cid, cond.encoder, blob)
    fields: dict[str, str | bytes] = {"format": FORMAT, "key": key, "condition": cid, "encoder": cond.encoder,
                                      "blob": blob}
    if key in checked:
        return key, fields
    try:  # the key was just computed from these bytes: not hashed again (SHA-256 of MBs at scale)
        _decode_cond(fields, copy=False, key_checked=True)
    except Exception as e:  # noqa: BLE001 — as decode_cond: any failure to read it back refuses it
        raise ValueError(f"condition {cid!r}: its encoded tensors cannot be stored: {e}") from None
    return key, fields


def cond_nbytes(fields: Mapping[str, str | bytes]) -> int:
    """What a condition record holds in Redis (fields and values), for the bank's byte bound."""
    return sum(len(k) + len(v if isinstance(v, bytes) else v.encode()) for k, v in fields.items())


def decode_cond(fields: Mapping[Any, Any], copy: bool = True) -> tuple[str, str, Cond]:
    """(key, condition id, Cond) of a record; raises only CorruptEntry. The key must be the
    digest of what the record holds, so a damaged record is never read as a condition."""
    try:
        return _decode_cond(fields, copy)
    except CorruptEntry:
        raise
    except Exception as e:  # noqa: BLE001 — untrusted bytes: any other failure is corruption too
        raise CorruptEntry(f"undecodable condition record: {type(e).__name__}: {e}") from e


def _decode_cond(fields: Mapping[Any, Any], copy: bool, key_checked: bool = False
                 ) -> tuple[str, str, Cond]:
    raw = {_text(k, "field name"): v for k, v in fields.items()}
    blob = raw.get("blob")
    m = {k: _text(v, k) for k, v in raw.items() if k != "blob"}
    _check_format(m.get("format"), "a condition record")
    missing = [f for f in COND_REQUIRED if f not in raw]
    if missing:
        raise CorruptEntry(f"condition record: missing fields {missing}")
    if m["format"] != FORMAT:
        raise CorruptEntry(f"condition record: field 'format' is {m['format']!r}, expected {FORMAT!r}")
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise CorruptEntry("condition record: blob missing")
    if not key_checked and _cond_digest(m["condition"], m["encoder"], bytes(blob)) != m["key"]:
        raise CorruptEntry(f"condition record {m['key'][:40]!r}: its bytes do not match its key (damaged)")
    try:
        t = loads(blob, copy=copy)
    except ValueError as e:
        raise CorruptEntry(f"condition record: blob is not safetensors: {e}") from None
    parts: dict[str, dict[str, Tensor]] = {"c": {}, "u": {}}
    for name, v in t.items():
        side, _, key = name.partition(".")
        if side not in parts or not _NAME.fullmatch(key) or v.dim() < 1 or v.shape[0] != 1:
            raise CorruptEntry(f"condition record: tensor {name!r} {tuple(v.shape)} is not a one-row "
                               "'c.<name>' or 'u.<name>'")
        parts[side][key] = v
    if not parts["c"] or not set(parts["u"]) <= set(parts["c"]):
        raise CorruptEntry(f"condition record: tensors {sorted(parts['c'])}, unconditional {sorted(parts['u'])}")
    return m["key"], m["condition"], Cond(parts["c"], parts["u"] or None, m["encoder"])


def _cond_digest(cid: str, encoder: str, blob: bytes) -> str:
    h = hashlib.sha256()
    for part in (cid.encode(), encoder.encode()):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    h.update(blob)
    return h.hexdigest()[:32]


def _params_json(params: tuple[tuple[str, Param], ...]) -> str:
    return json.dumps(dict(params))


def _is_param(v: Any) -> bool:
    if isinstance(v, float):
        return math.isfinite(v)
    return v is None or isinstance(v, str) or (isinstance(v, int) and not isinstance(v, bool))


def _text(v: Any, field: Any) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, (bytes, bytearray)):
        try:
            return bytes(v).decode("utf-8")
        except UnicodeDecodeError:
            raise CorruptEntry(f"field {field!r} is not UTF-8") from None
    raise CorruptEntry(f"field {field!r} has type {type(v).__name__}")


def _int(m: dict[str, str], f: str) -> int:
    if len(m[f]) > 40 or not _INT.fullmatch(m[f]):
        raise CorruptEntry(f"field {f!r} is {m[f][:40]!r}, expected an integer")
    return int(m[f])


def _float(m: dict[str, str], f: str) -> float:
    try:
        v = float(m[f])
    except ValueError:
        raise CorruptEntry(f"field {f!r} is {m[f][:40]!r}, expected a number") from None
    if not math.isfinite(v):
        raise CorruptEntry(f"field {f!r} is not finite: {v}")
    if repr(v) != m[f]:
        raise CorruptEntry(f"field {f!r} is {m[f][:40]!r}, not a number as written by encode")
    return v


def _json_list(m: dict[str, str], f: str, kind: type) -> list:
    try:
        v = json.loads(m[f])
    except (ValueError, RecursionError):
        raise CorruptEntry(f"field {f!r} is not JSON") from None
    if not isinstance(v, list) or not all(_is(e, kind) for e in v):
        raise CorruptEntry(f"field {f!r} must be a JSON list of {kind.__name__}")
    if kind is float:
        try:
            v = [float(e) for e in v]
        except OverflowError:
            raise CorruptEntry(f"field {f!r} has out-of-range values") from None
        if not all(math.isfinite(e) for e in v):
            raise CorruptEntry(f"field {f!r} has non-finite values")
    return v


def _is(e: Any, kind: type) -> bool:
    if isinstance(e, bool):        # JSON true/false are not numbers here
        return False
    return isinstance(e, (int, float)) if kind is float else isinstance(e, kind)
