"""Sharded checkpoints for FSDP2 learner ranks: each rank writes its own shard of the trainer's
state, all into one temp dir that rank 0 renames into place after a barrier (atomic as a whole).

Layout: `<root>/step_00000042/{rank00000.pt, …, meta.json, extra.json}`. A shard holds the
trainer's state dict with every DTensor replaced by its local tensor (plain tensors only, read
back with weights_only=True). Loading rebuilds the DTensors from the live state's mesh and
placements, so a checkpoint resumes on the same number of ranks.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from learner.checkpoint import EXTRA_FILE, PREFIX, list_checkpoints, step_dir

META_FILE = "meta.json"


def shard_file(rank: int) -> str:
    return f"rank{rank:05d}.pt"


def to_local(tree: Any) -> Any:
    """DTensors → their local shards, recursively through dicts, lists and tuples."""
    if isinstance(tree, DTensor):
        return tree.to_local().detach().clone()
    if isinstance(tree, dict):
        return {k: to_local(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_local(v) for v in tree)
    return tree


def from_local(template: Any, loaded: Any, where: str = "state") -> Any:
    """Rewrap local shards as DTensors wherever the live `template` holds a DTensor."""
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


def save(root: str | os.PathLike, step: int, state: dict, extra: dict, keep: int) -> Path:
    """Collective: every rank calls it with its own trainer state; returns the final dir."""
    root, rank, world = Path(root), dist.get_rank(), dist.get_world_size()
    # 1. rank 0 names the temp dir and tells the others
    box = [f".tmp-{PREFIX}{step:08d}-{uuid.uuid4().hex[:8]}" if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    tmp, final = root / box[0], step_dir(root, step)
    if rank == 0:
        tmp.mkdir(parents=True)
        (tmp / EXTRA_FILE).write_text(json.dumps(extra, sort_keys=True), encoding="utf-8")
    dist.barrier()
    # 2. every rank writes its shard
    torch.save(to_local(state), tmp / shard_file(rank))
    dist.barrier()
    # 3. rank 0 seals it (meta last: list_sharded only sees complete dirs) and renames
    if rank == 0:
        (tmp / META_FILE).write_text(json.dumps({"world_size": world, "step": step}), encoding="utf-8")
        if final.exists():
            old = root / f".old-{final.name}-{uuid.uuid4().hex[:8]}"
            final.rename(old)
            shutil.rmtree(old, ignore_errors=True)
        tmp.rename(final)
        for stale in list_sharded(root)[:-keep]:
            shutil.rmtree(stale, ignore_errors=True)
    dist.barrier()
    return final


def load(path: str | os.PathLike, template: dict) -> tuple[dict, dict, Path]:
    """This rank's (state rebuilt on `template`'s DTensors, extra, dir). Not a collective."""
    p = Path(path)
    if not (p / META_FILE).is_file():
        found = list_sharded(p)
        if not found:
            raise FileNotFoundError(f"{p}: no sharded checkpoint here (expected {META_FILE} or "
                                    f"{PREFIX}NNNNNNNN/ dirs)")
        p = found[-1]
    meta = json.loads((p / META_FILE).read_text(encoding="utf-8"))
    rank, world = dist.get_rank(), dist.get_world_size()
    if meta["world_size"] != world:
        raise ValueError(f"{p}: written by {meta['world_size']} learner ranks, this group has {world} "
                         f"(set pools.learner.num_actors={meta['world_size']})")
    loaded = torch.load(p / shard_file(rank), map_location="cpu", weights_only=True)
    extra = json.loads((p / EXTRA_FILE).read_text(encoding="utf-8"))
    return from_local(template, loaded), extra, p
