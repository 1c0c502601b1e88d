"""The exported policy written by the learner ranks that hold it, in diffusers' sharded
safetensors layout (common/policy_layout.py): no rank gathers the whole model.

Every rank walks the payload's tensors in the layout's order. Each tensor is cast to its wire
dtype on the rank's shard (the dtype the rollout holds it in: model.dtype for the fp32 masters),
gathered (a collective under FSDP2: every rank takes part), written by its owner straight from
the gathered tensor into its shard file (the header first: its offsets follow from the shapes),
and freed before the next. So a rank's host holds one tensor at a time: on a GPU the one it
copies out to write; with the weights on the host (learner.cpu_offload, a CPU learner) the
gathered tensor and this rank's cast shard of it. No rank holds a shard.

A non-finite weight is refused before any file is made: every rank checks its shard of each
tensor (min and max, in the wire dtype) and all refuse together. A write that fails on one rank
(a full disk, an object store's error) does not stop it in the middle of the walk, which would
leave the others waiting in a gather: it stops writing, walks on, and every rank then learns of
it together and raises the same error. Rank 0 writes each expert's
config.json (a full fine-tune) and its index last, once every shard is written: the index marks
the policy complete. Local paths and object-store URIs alike (common/storage.py).
"""

from __future__ import annotations

import errno
import json
from collections.abc import Callable
from typing import IO

import torch
import torch.distributed as dist
from torch import Tensor, nn

from common import policy_layout as layout_
from common import storage
from learner.finite_guard import NonFiniteWeights, check_weights


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def policy_meta(ema: bool, version: int, decay: float) -> dict[str, str]:
    """What every shard's metadata and the index say of the weights: the moving average or the
    live weights, the version, the decay."""
    return {"format": "pt", "vgrpo.weights": "ema" if ema else "live", "vgrpo.version": str(version),
            "vgrpo.ema_decay": repr(float(decay)) if ema else "0.0"}


def expert_configs(module: nn.Module, class_name: str) -> dict[str, str]:
    """config.json of each trained expert (a diffusers model), named as the family's transformer
    class (FSDP2 renames the module's class); none for a module without a diffusers config."""
    parts = dict(module.items()) if isinstance(module, nn.ModuleDict) else {layout_.EXPERTS[0]: module}
    out = {}
    for expert, m in parts.items():
        if not hasattr(m, "to_json_string"):
            continue
        conf = json.loads(m.to_json_string())
        conf["_class_name"] = class_name
        out[expert] = json.dumps(conf, indent=2, sort_keys=True) + "\n"
    return out


def write(path, tensors: dict[str, Tensor], meta: dict[str, str], *, wire: dict[str, torch.dtype] | None = None,
          configs: dict[str, str] | None = None, rank: int = 0, world: int = 1,
          wait: Callable[[], None] | None = None) -> layout_.Layout:
    """Write `tensors` (plain tensors, or this rank's DTensor shards) under `path` (a folder, local
    or a URI) in their `wire` dtypes. Collective when world > 1: every rank calls it with its own
    shards. `wait`: called on every rank after its last write, before the ranks compare notes (a
    barrier bounded by learner.checkpoint_timeout_s: a slow rank meets its timeout, not a
    collective's). Raises on every rank alike: NonFiniteWeights, OSError (a full disk), or
    RuntimeError."""
    wire = wire or {k: v.dtype for k, v in tensors.items()}
    plan = layout_.plan([(k, tuple(v.shape), dtype_name(wire[k])) for k, v in tensors.items()], world)
    root = storage.location(path)
    _check_finite(plan, tensors, wire, root, world)   # before any file is made: a refusal leaves none
    failure = _write_shards(root, plan, tensors, wire, meta, rank)
    found = [failure]
    if world > 1:
        if wait is not None:
            wait()
        found = [None] * world
        dist.all_gather_object(found, failure)
    bad = failure or next((f for f in found if f), None)
    if bad is not None:
        raise _error(bad)
    if rank == 0:  # every shard is in: the configs, then each index (the marker) last
        for expert, text in (configs or {}).items():
            storage.write(str(root / expert / layout_.CONFIG_FILE), text.encode("utf-8"))
        for expert in plan.experts():
            index = json.dumps(plan.index(expert, meta), indent=2, sort_keys=True) + "\n"
            storage.write(str(root / expert / layout_.WEIGHTS_INDEX), index.encode("utf-8"))
    return plan


def _write_shards(root, plan: layout_.Layout, tensors: dict[str, Tensor], wire: dict[str, torch.dtype],
                  meta: dict[str, str], rank: int) -> tuple[str, int, str] | None:
    """This rank's part of the walk; returns its failure as (kind, errno, message), or None."""
    mine = {e.key: f for f in plan.files_of(rank) for e in f.entries}
    handles: dict[tuple[str, str], IO[bytes]] = {}
    failure = None
    try:
        for e in plan.entries:
            local = tensors[e.key].detach().to(wire[e.key])   # the cast on this rank's shard
            full = _full(local)                                # every rank gathers every tensor
            del local
            f = mine.get(e.key)
            if f is not None and failure is None:
                try:
                    h = handles.get((f.expert, f.name))
                    if h is None:
                        h = handles[(f.expert, f.name)] = storage.open_write(str(root / f.expert / f.name))
                        h.write(f.header(meta))
                    _write_tensor(h, full)
                except Exception as ex:  # noqa: BLE001 — every rank must walk on (see the module doc)
                    failure = _summary(ex)
            del full
    finally:
        for h in handles.values():
            try:
                h.close()
            except Exception as ex:  # noqa: BLE001 — an object store's last part fails here
                failure = failure or _summary(ex)
    return failure


def _check_finite(plan: layout_.Layout, tensors: dict[str, Tensor], wire: dict[str, torch.dtype], root,
                  world: int) -> None:
    """Every rank checks its shard of every tensor as it would be written (cast to its wire
    dtype, one at a time: min and max, no mask); all refuse together when any finds NaN/inf."""
    bad = None
    for e in plan.entries:
        t = tensors[e.key].detach().to(wire[e.key])
        local = t.to_local() if hasattr(t, "to_local") else t
        try:
            check_weights({e.key: local}, f"the policy of this checkpoint ({root})")
        except NonFiniteWeights as ex:
            bad = str(ex)
            break
        finally:
            del t, local
    found = [bad]
    if world > 1:
        found = [None] * world
        dist.all_gather_object(found, bad)
    bad = bad or next((f for f in found if f), None)
    if bad is not None:
        raise NonFiniteWeights(bad)


def _full(t: Tensor) -> Tensor:
    """A DTensor's full value (a collective), or the tensor itself (learner.fsdp.full_value)."""
    full = getattr(t, "full_tensor", None)
    return full() if full is not None else t


def _write_tensor(h: IO[bytes], t: Tensor) -> None:
    """A tensor's bytes as they lie in memory (little-endian, C order), with no copy on the host
    (one copy out of a GPU)."""
    if t.numel() == 0:
        return
    host = t.detach().cpu().contiguous().reshape(-1)
    h.write(memoryview(host.view(torch.uint8).numpy()))


def _summary(e: BaseException) -> tuple[str, int, str]:
    kind = "nonfinite" if isinstance(e, NonFiniteWeights) else "os" if isinstance(e, OSError) else "error"
    code = getattr(e, "errno", None) or 0
    text = str(e).strip().splitlines()
    return kind, code, f"{type(e).__name__}: {text[0]}" if text and kind == "error" else (text[0] if text else type(e).__name__)


def _error(failure: tuple[str, int, str]) -> Exception:
    kind, code, text = failure
    if kind == "nonfinite":
        return NonFiniteWeights(text)
    if kind == "os":
        return OSError(code or errno.EIO, text)
    return RuntimeError(f"writing the policy failed on a learner rank: {text}")
