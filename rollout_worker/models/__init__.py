"""Model adapters: one VideoModel per family, built from the run config by `build_model`."""

from __future__ import annotations

import torch

from common.config import RunConfig
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
    device = default_device() if device is None else torch.device(device)
    if empty and (m.family == "toy" or components != "transformer"):
        raise ValueError("build_model(empty=True) builds a diffusers transformer alone "
                         "(components='transformer', model.family wan or hunyuan15)")
    if m.family == "toy":
        from rollout_worker.models.toy import ToyVideoModel

        return ToyVideoModel.from_config(cfg, components)  # CPU-sized by design
    if m.path is None:
        raise ModelLoadError(f"model.path is required for model.family = {m.family!r} "
                             "(a local diffusers-format directory or a hub id)")
    if m.family == "wan":
        from rollout_worker.models.wan import WanVideoModel

        return WanVideoModel.from_pretrained(m.path, m, _DTYPES[m.dtype], device, components, empty)
    if m.family == "hunyuan15":
        from rollout_worker.models.hunyuan15 import Hunyuan15VideoModel

        return Hunyuan15VideoModel.from_pretrained(m.path, m, _DTYPES[m.dtype], device, components, empty)
    raise ModelLoadError(f"model.family = {m.family!r} has no adapter")
