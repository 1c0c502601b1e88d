"""Sharded checkpoints for FSDP2 learner ranks: each rank writes its own shard of the trainer's
state, all into one temp dir that rank 0 renames into place after a barrier (atomic as a whole).

Layout: `<root>/step_00000042/{rank00000.pt, …, meta.json, extra.json}`. A shard holds the
trainer's state dict with every DTensor replaced by its local tensor (plain tensors only, read
back with weights_only=True). Loading rebuilds the DTensors from the live state's mesh and
placements, so a checkpoint resumes on the same number of ranks. `verify` checks every file of
one (and the rank count) in the driver, before any learner rank starts; it needs neither
torch.distributed.tensor nor FSDP, which are imported only where a shard is written or read.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from common import storage
from learner import checkpoint as single_rank
from learner.checkpoint import (
    EXTRA_FILE,
    META_FILE,
    PREFIX,
    STATE_FILE,
    CheckpointError,
    DiskFull,
    disk_full_line,
    list_checkpoints,
    load_state_file,
    out_of_space,
    prune,
    read_extra,
    seal,
    set_aside_hint,
    step_dir,
    step_dirs,
    take_stage,
    unwritten,
    verify_file,
    write_torch,
)
from learner.finite_guard import NonFiniteWeights


def shard_file(rank: int) -> str:
    return f"rank{rank:05d}.pt"


def to_local(tree: Any) -> Any:
    """DTensors → their local shards (references, no copy: torch.save moves one storage at a
    time to the host), recursively through dicts, lists and tuples. A parameter's shard is a
    view of FSDP2's padded storage, so the file holds its few padding rows too; the layout a
    loader sees (plain tensors, the same tree) is the one earlier checkpoints have."""
    from torch.distributed.tensor import DTensor  # heavy: torch.distributed.tensor (0.5 s)

    if isinstance(tree, DTensor):
        return tree.to_local().detach()
    if isinstance(tree, dict):
        return {k: to_local(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_local(v) for v in tree)
    return tree


def from_local(template: Any, loaded: Any, where: str = "state") -> Any:
    """Rewrap local shards as DTensors wherever the live `template` holds a DTensor."""
    from torch.distributed.tensor import DTensor  # heavy: torch.distributed.tensor (0.5 s)

    if isinstance(template, DTensor):
        if not isinstance(loaded, torch.Tensor):
            raise ValueError(f"checkpoint shard: {where} is not a tensor")
        return DTensor.from_local(loaded.to(template.device), template.device_mesh, template.placements,
                                  run_check=False, shape=template.shape, stride=template.stride())
    if isinstance(template, dict) and isinstance(loaded, dict):
        return {k: from_local(template[k], v, f"{where}.{k}") if k in template else v
                for k, v in loaded.items()}
    if isinstance(template, (list, tuple)) and isinstance(loaded, (list, tuple)) and len(template) == len(loaded):
        return type(loaded)(from_local(t, v, f"{where}[{i}]")
                            for i, (t, v) in enumerate(zip(template, loaded, strict=True)))
    return loaded


def list_sharded(root: str | os.PathLike) -> list[Path]:
    """Complete sharded checkpoints (meta.json is written last), oldest first."""
    return list_checkpoints(root, marker=META_FILE)


def save(root: str | os.PathLike, step: int, state: dict, extra: dict, keep: int,
         timeout_s: float | None = None) -> Path:
    """Collective: every rank calls it with its own trainer state; returns the final dir.

    timeout_s (learner.checkpoint_timeout_s) bounds the waits for the slowest rank's shard write
    and for rank 0's rename and clean-up; None waits as long as the group's collective timeout."""
    _check_finite_everywhere(state, step, dist.get_world_size())
    if storage.is_uri(root):
        return _save_objects(storage.Uri(root), step, state, extra, keep, timeout_s)
    root, rank, world = Path(root), dist.get_rank(), dist.get_world_size()
    # 1. rank 0 takes the driver's stage (its bank dump and policy are in it) or a temp dir
    box = [take_stage(root, step).name if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    tmp, final = root / box[0], step_dir(root, step)
    if rank == 0:
        (tmp / EXTRA_FILE).write_text(json.dumps(extra, sort_keys=True), encoding="utf-8")
    dist.barrier()
    # 2. every rank writes its shard (a full disk: its flag, so every rank agrees to give up)
    local = to_local(state)
    try:
        write_torch(local, tmp / shard_file(rank))
        failed = 0
    except Exception as e:  # torch's zip writer reports a full disk as RuntimeError too
        if not out_of_space(e, tmp, unwritten(local, tmp / shard_file(rank))):
            raise
        failed = 1
    _wait(timeout_s, "wrote its checkpoint shard")   # a slow rank meets the barrier's timeout, not a collective's
    flags: list = [None] * world
    dist.all_gather_object(flags, failed)
    if any(flags):
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise DiskFull(disk_full_line(root, step))
    # 3. rank 0 seals it (meta last: list_sharded only sees complete dirs), renames, prunes
    if rank == 0:
        (tmp / META_FILE).write_text(json.dumps({"world_size": world, "step": step}), encoding="utf-8")
        seal(tmp, final)
        prune(root, keep, META_FILE)
    _wait(timeout_s, "saw the checkpoint sealed")
    return final


def _check_finite_everywhere(state: dict, step: int, world: int) -> None:
    """Every rank refuses together when any rank's shard holds a non-finite weight."""
    try:
        single_rank.check_finite(to_local(state), f"checkpoint of step {step}, rank {dist.get_rank()}")
        bad = None
    except ValueError as e:
        bad = str(e)
    found: list = [None] * world
    dist.all_gather_object(found, bad)
    if any(found):
        raise NonFiniteWeights(next(f for f in found if f))


def _wait(timeout_s: float | None, what: str) -> None:
    if timeout_s is None:
        dist.barrier()
    else:
        from learner.fsdp import barrier  # heavy: torch.distributed.fsdp (0.5 s)

        barrier(timeout_s, "learner.checkpoint_timeout_s", what)


def _save_objects(root: storage.Uri, step: int, state: dict, extra: dict, keep: int,
                  timeout_s: float | None = None) -> storage.Uri:
    """The object-store form of `save`: no rename, so the step dir is written in place and
    meta.json, written last by rank 0 after every shard is in, is what makes it listed."""
    rank, world = dist.get_rank(), dist.get_world_size()
    final = step_dir(root, step)
    if rank == 0:
        if (final / META_FILE).exists():  # a re-save: unlisted before any file changes
            storage.remove(final / META_FILE)
        storage.write(final / EXTRA_FILE, json.dumps(extra, sort_keys=True).encode())
    dist.barrier()
    storage.write(final / shard_file(rank), lambda f: torch.save(to_local(state), f))
    _wait(timeout_s, "the checkpoint's shard writes")
    if rank == 0:
        storage.write(final / META_FILE, json.dumps({"world_size": world, "step": step}).encode())
        for stale in list_sharded(root)[:-keep]:
            storage.remove(stale / META_FILE)   # unlisted first, then removed
            storage.remove(stale)
    _wait(timeout_s, "rank 0's marker and clean-up")
    return final


def load(path: str | os.PathLike, template: dict,
         params: list[torch.Tensor] | None = None) -> tuple[dict, dict, Path]:
    """This rank's (state rebuilt on `template`'s DTensors, extra, dir). Not a collective.
    params: the optimizer's parameters, in its order, for a resume before any step, whose
    optimizer has no state yet to rebuild the saved one on (`_with_optimizer_state`)."""
    p = storage.location(path)
    if not (p / META_FILE).is_file():
        found = list_sharded(p)
        if not found:
            raise CheckpointError(f"{p}: no sharded checkpoint here (expected {META_FILE} or "
                                    f"{PREFIX}NNNNNNNN/ dirs)")
        p = found[-1]
    rank, world = dist.get_rank(), dist.get_world_size()
    read_meta(p, world)
    loaded = load_state_file(p / shard_file(rank))
    if params is not None:
        template = _with_optimizer_state(template, loaded, params)
    return from_local(template, loaded), read_extra(p / EXTRA_FILE), p


def _with_optimizer_state(template: dict, loaded: dict, params: list[torch.Tensor]) -> dict:
    """A template whose optimizer state models the saved one: a fresh optimizer has none, so each
    parameter's own state tensors (AdamW's moments, shaped as its shard) take its placement;
    scalars (the step count) stay plain tensors, as the optimizer keeps them."""
    from torch.distributed.tensor import DTensor  # heavy: torch.distributed.tensor (0.5 s)

    saved = (loaded.get("optimizer") or {}).get("state") or {}
    live = (template.get("optimizer") or {}).get("state")
    if not saved or live:
        return template
    state = {}
    for i, entry in saved.items():
        local = params[i].to_local() if isinstance(params[i], DTensor) else params[i]
        state[i] = {k: params[i] for k, v in entry.items()
                    if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == local.shape}
    return {**template, "optimizer": {**template["optimizer"], "state": state}}


def read_meta(d: Path, world_size: int) -> dict:
    """meta.json of sharded checkpoint `d`, checked against this run's learner rank count."""
    f = d / META_FILE
    try:
        meta = json.loads(f.read_text(encoding="utf-8"))
        written = meta["world_size"]
    except FileNotFoundError:
        raise CheckpointError(f"{f}: missing (the sharded checkpoint is incomplete); {set_aside_hint(d)}") from None
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{f}: damaged ({type(e).__name__}: {e}); {set_aside_hint(d)}") from None
    if not isinstance(written, int) or isinstance(written, bool) or written < 1:
        raise CheckpointError(f"{f}: world_size {written!r} is not a positive integer; {set_aside_hint(d)}")
    if written != world_size:
        raise CheckpointError(f"{d}: written by {written} learner ranks, this run has {world_size} "
                              f"(set pools.learner.num_actors={written}, or num_actors × parallel.sp = {written})")
    return meta


def verify(d: str | os.PathLike, world_size: int, state_keys: tuple[str, ...] = (),
           extra_keys: tuple[str, ...] = ()) -> None:
    """Raise CheckpointError (one line: file, fault, fix) unless sharded step dir `d` reads back
    whole for `world_size` ranks: meta.json, every rank's shard, extra.json."""
    d = storage.location(d)
    read_meta(d, world_size)
    for r in range(world_size):
        verify_file(d / shard_file(r), state_keys)
    try:
        read_extra(d / EXTRA_FILE, extra_keys)
    except CheckpointError as e:
        raise CheckpointError(f"{e}; {set_aside_hint(d)}") from None


# What Trainer.state_dict and Driver.checkpoint write, and a resume reads back.
TRAINER_KEYS = ("version", "finetune", "policy", "optimizer", "kl", "rng")
DRIVER_KEYS = ("step", "cursor")


def verify_newest(root: str | os.PathLike, world_size: int) -> Path:
    """The newest step dir under root, verified whole for a run with `world_size` learner ranks
    (a single-rank or a sharded checkpoint). A damaged newest checkpoint is an error, never a
    silent fall back to an older one: the message says how to fall back on purpose."""
    dirs = step_dirs(root)
    if not dirs:
        raise CheckpointError(f"{root}: no checkpoint to resume from (no {PREFIX}NNNNNNNN dirs)")
    d = dirs[-1]
    if world_size > 1 or (d / META_FILE).exists():
        if world_size > 1 and (d / STATE_FILE).is_file() and not (d / META_FILE).exists():
            raise CheckpointError(f"{d}: a single-rank checkpoint ({STATE_FILE}), this run has {world_size} "
                                  "learner ranks (set pools.learner.num_actors=1)")
        verify(d, world_size, TRAINER_KEYS, DRIVER_KEYS)
    else:
        single_rank.verify(d, TRAINER_KEYS, DRIVER_KEYS)
    return d
