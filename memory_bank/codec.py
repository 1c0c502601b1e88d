"""Trajectory <-> (metadata hash fields, safetensors bytes).

Bytes read from Redis are untrusted: decoding never unpickles, checks every field and
shape, and raises only `CorruptEntry` (naming the field) on anything it does not accept.
Numbers are accepted only in the form `encode` writes them (`str(int)`, `repr(float)`), so a
damaged field is never read as another number. `encode` decodes its own output before it
returns, so everything it writes reads back, exactly.
Frames are not stored: the learner needs latents, log-probs and rewards, not video.

Each entry stores its SDE scheme's full spec (`scheme`, `scheme_params`: every constructor
argument, `sigmas`), the only thing the learner replays it with. Format 1 (before the spec)
stored the name and η alone; its entries are refused in one line, not read with guessed
arguments that may not be the ones it was sampled with. An entry of a rollout that records no
step (grpo.loss=nft: `step_indices` empty) stores its final latents only; entries with steps read
as before, so the format stays 2.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, get_args

import torch
from torch import Tensor

from common.config import SchemeName
from common.sde import Param, SchemeSpec, scheme_from_spec
from common.types import Condition, Trajectory
from memory_bank.errors import CorruptEntry
from memory_bank.keys import check_eid
from memory_bank.tensorfile import dumps, loads

FORMAT = "2"
_INT = re.compile(r"(0|-?[1-9][0-9]*)")   # str(int) and nothing else
SCHEMES = frozenset(get_args(SchemeName))
STATUSES = frozenset({"fresh", "banked"})
TENSORS = ("x", "x_next", "logp_old", "final_latents")  # plus "image" for I2V, "mu_old" when recorded
OPTIONAL_TENSORS = ("image", "mu_old")
REQUIRED = (
    "format", "id", "condition", "prompt", "group", "member", "seed", "version", "created",
    "scheme", "scheme_params", "guidance_scale", "sigmas", "step_indices", "trained", "heads", "scores",
    "composite", "status",
)


@dataclass
class Entry:
    """One decoded bank entry: a trajectory with its stored rewards."""

    id: str
    trajectory: Trajectory
    heads: list[str]
    scores: Tensor                 # [H] fp32
    composite: float
    status: str
    created: float


def encode(eid: str, traj: Trajectory, heads: list[str], scores: Tensor, composite: float,
           status: str = "fresh") -> tuple[dict[str, str], bytes]:
    """Return (metadata hash fields, blob) for one member; raises ValueError on bad input."""
    check_eid(eid)
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
    if traj.condition.image is not None:
        tensors["image"] = traj.condition.image
    if traj.mu_old is not None:
        tensors["mu_old"] = traj.mu_old
    for field in ("id", "prompt"):
        _utf8(getattr(traj.condition, field), f"condition.{field}")
    _utf8(traj.group_id, "group_id")
    for h in heads:
        _utf8(h, "heads")
    blob = dumps(tensors)
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
    }
    if traj.trained_steps is not None:
        meta["trained_steps"] = json.dumps([int(k) for k in traj.trained_steps])
    if traj.condition.image_path is not None:  # I2V by reference: the learner reads the file
        meta["image_path"] = traj.condition.image_path
    if traj.condition.negative_prompt is not None:  # the learner encodes the row's CFG text too
        meta["negative_prompt"] = traj.condition.negative_prompt
    try:  # what decode would refuse (non-finite log-probs, a step outside sigmas, ...) is refused here
        decode(meta, blob, copy=False)
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


def _decode(meta: Mapping[Any, Any], blob: bytes | None, copy: bool) -> Entry:
    m = _fields(meta)
    eid = m["id"]
    member, seed, version, trained = (_int(m, f) for f in ("member", "seed", "version", "trained"))
    if member < 0 or trained < 0:
        raise CorruptEntry(f"field 'member'/'trained' negative: {member}/{trained}")
    cfg_scale, composite, created = (_float(m, f) for f in ("guidance_scale", "composite", "created"))
    spec = _spec(m)
    steps, trained_steps = _steps(m, len(spec.sigmas))
    heads, scores = _json_list(m, "heads", str), _json_list(m, "scores", float)
    if not heads:
        raise CorruptEntry("field 'heads' is empty")
    if len(scores) != len(heads):
        raise CorruptEntry(f"field 'scores' has {len(scores)} values for {len(heads)} heads")
    t = _tensors(blob, len(steps), copy)
    traj = Trajectory(
        condition=Condition(id=m["condition"], prompt=m["prompt"], image=t.get("image"),
                            image_path=m.get("image_path"), negative_prompt=m.get("negative_prompt")),
        group_id=m["group"], member=member, seed=seed, spec=spec, guidance_scale=cfg_scale,
        policy_version=version, step_indices=steps, x=t.get("x"), x_next=t.get("x_next"),
        logp_old=t.get("logp_old"),
        final_latents=t["final_latents"], frames=None, trained_times=trained, bank_id=eid,
        trained_steps=trained_steps, mu_old=t.get("mu_old"),
    )
    return Entry(id=eid, trajectory=traj, heads=heads,
                 scores=torch.tensor(scores, dtype=torch.float32), composite=composite,
                 status=m["status"], created=created)


def _fields(meta: Mapping[Any, Any]) -> dict[str, str]:
    """The hash fields as text, all present, of this format, with a valid id and status."""
    m = {_text(k, "field name"): _text(v, k) for k, v in meta.items()}
    missing = [f for f in REQUIRED if f not in m]
    if m.get("format") == "1":  # checked first: a format-1 entry also lacks scheme_params
        raise CorruptEntry("field 'format' is '1': an entry of an older vgrpo, which did not store its "
                           "SDE scheme's full spec; it cannot be replayed exactly and is not read")
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


def _spec(m: dict[str, str]) -> SchemeSpec:
    """The scheme's full spec; its arguments must be exactly what encode writes for it."""
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


def _steps(m: dict[str, str], n_sigmas: int) -> tuple[list[int], list[int] | None]:
    """step_indices (each a step of the schedule) and trained_steps (a subset of them, or None)."""
    steps = _json_list(m, "step_indices", int)
    if any(not 0 <= k < n_sigmas - 1 for k in steps):  # none: a rollout that records no step
        raise CorruptEntry(f"field 'step_indices' {steps} outside 0..{n_sigmas - 2}")
    trained_steps = _json_list(m, "trained_steps", int) if "trained_steps" in m else None
    if trained_steps is not None and not set(trained_steps) <= set(steps):
        raise CorruptEntry(f"field 'trained_steps' {trained_steps} is not a subset of 'step_indices' {steps}")
    return steps, trained_steps


def _tensors(blob: bytes | None, k: int, copy: bool) -> dict[str, Tensor]:
    """The blob's tensors: safetensors only (no pickle), exactly the expected names and shapes."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise CorruptEntry("blob missing")
    try:
        t = loads(blob, copy=copy)
    except ValueError as e:
        raise CorruptEntry(f"blob is not safetensors: {e}") from None
    t = _step_tensors(t, k) if k else _final_only(t)
    image = t.get("image")
    if image is not None and (image.dtype != torch.uint8 or image.dim() != 3 or image.shape[2] != 3):
        raise CorruptEntry(f"tensor 'image' {image.dtype} {tuple(image.shape)}: expected uint8 [H, W, 3]")
    return t


def _step_tensors(t: dict[str, Tensor], k: int) -> dict[str, Tensor]:
    """The tensors of a trajectory that recorded k > 0 steps: x, x_next, logp_old, final_latents
    (and mu_old, image), checked."""
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
    if not torch.isfinite(logp_old).all():
        raise CorruptEntry("tensor 'logp_old' has non-finite values")
    mu_old = t.get("mu_old")
    if mu_old is not None and (mu_old.shape != x.shape or not mu_old.is_floating_point()):
        raise CorruptEntry(f"tensor 'mu_old' {mu_old.dtype} {tuple(mu_old.shape)}: expected float {tuple(x.shape)}")
    return t


def _final_only(t: dict[str, Tensor]) -> dict[str, Tensor]:
    """A trajectory that recorded no step (grpo.loss=nft): only `final_latents` (and an I2V image)."""
    extra = set(t) - {"final_latents", "image"}
    if extra or "final_latents" not in t:
        raise CorruptEntry(f"blob of an entry without steps: expected final_latents, got {sorted(t)}")
    final = t["final_latents"]
    if final.dim() != 4 or not final.is_floating_point():
        raise CorruptEntry(f"tensor 'final_latents' {final.dtype} {tuple(final.shape)}: expected float [C, F, H, W]")
    return t


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
