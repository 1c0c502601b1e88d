"""Model adapters: one VideoModel per family, built from the run config by `build_model`."""

from __future__ import annotations

import importlib

import torch

from common.config import RunConfig
from common.families import family_of
from rollout_worker.models.base import DTYPES as _DTYPES
from rollout_worker.models.base import Components, Cond, ModelLoadError, VideoModel

__all__ = ["Components", "Cond", "ModelLoadError", "VideoModel", "build_model", "default_device"]

def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def build_model(cfg: RunConfig, device: torch.device | str | None = None,
                components: Components = "all", empty: bool = False) -> VideoModel:
    """The adapter for `cfg.model.family`, loaded from `cfg.model.path` (families import lazily).

    components="transformer" loads the transformer(s) alone, without text/image encoders or VAE
    (what the learner builds: it trains on the conditions the rollout encoded). empty (with it):
    their parameters on the meta device, no weights read: the sharded learner reads each rank's
    own rows from the checkpoint's files (learner/shard_load.py)."""
    m = cfg.model
    spec = family_of(m.family)
    device = default_device() if device is None else torch.device(device)
    if empty and (not spec.lean_sharded or components != "transformer"):
        raise ValueError("build_model(empty=True) builds a diffusers transformer alone "
                         f"(components='transformer', a family with lean_sharded; not {m.family!r})")
    module, name = spec.adapter.split(":")
    adapter = getattr(importlib.import_module(module), name)  # the family's own imports, only now
    if not spec.needs_path:
        return adapter.from_config(cfg, components)  # ships its own weights (the toy: CPU-sized by design)
    if m.path is None:
        raise ModelLoadError(f"model.path is required for model.family = {m.family!r} "
                             "(a local diffusers-format directory or a hub id)")
    return adapter.from_pretrained(m.path, m, _DTYPES[m.dtype], device, components, empty)
