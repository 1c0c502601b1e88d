"""The config's VAE without its weights: its config, the latent shape it gives, and the FLOPs of
an encode or a decode, counted by torch's FlopCounterMode on the meta device (nothing is
computed). A small probe is counted and scaled by the voxels: a video VAE's convolutions cost
the same per output voxel at any size (measured: Wan's full 53x320x576 decode is 8.5 MFLOP per
voxel, the 5x64x64 probe 8.9; HunyuanVideo 1.5's 26.4 at both), so the probe errs high.
"""

from __future__ import annotations

import inspect
import json
from functools import lru_cache
from pathlib import Path

from common.families import FAMILIES, release_of

_PROBE = (2, 8, 8)  # latent frames, height, width of the probe (5 x 64 x 64 pixels for Wan)


def _vae_class(family: str):
    import diffusers  # heavy: diffusers, only when a plan is made

    return getattr(diffusers, FAMILIES[family].vae)


def vae_config(cfg) -> dict:
    """A local checkpoint's vae/config.json, else the class defaults (Wan 2.1's VAE, which Wan 2.2
    A14B uses, and HunyuanVideo 1.5's) with the keys of the release model.path names (the Wan 2.2
    VAE of TI2V-5B)."""
    m = cfg.model
    if m.path is not None and (Path(m.path) / "vae" / "config.json").is_file():
        conf = json.loads((Path(m.path) / "vae" / "config.json").read_text(encoding="utf-8"))
        return {k: v for k, v in conf.items() if not k.startswith("_")}
    sig = inspect.signature(_vae_class(m.family).__init__)
    conf = {k: p.default for k, p in sig.parameters.items() if p.default is not inspect.Parameter.empty}
    release = release_of(m.family, m.path)
    return conf | (dict(release.vae) if release is not None else {})


def scale_factors(family: str, conf: dict) -> tuple[int, int, int]:
    """(latent channels, temporal factor, spatial factor), as the pipelines derive them."""
    if "z_dim" in conf:  # AutoencoderKLWan: Wan 2.2's VAE names its factors, Wan 2.1's derive from its stages
        down = list(conf["temperal_downsample"])
        return (int(conf["z_dim"]), int(conf.get("scale_factor_temporal") or 2 ** sum(down)),
                int(conf.get("scale_factor_spatial") or 2 ** len(down)))
    return (int(conf["latent_channels"]), int(conf["temporal_compression_ratio"]),
            int(conf["spatial_compression_ratio"]))


def latent_shape(cfg) -> tuple[int, int, int, int]:
    """[C, F, H, W] of one sample's latents (the sampler's `model.latent_shape`)."""
    m = cfg.model
    c, st, ss = scale_factors(m.family, vae_config(cfg))
    return c, (m.num_frames - 1) // st + 1, m.height // ss, m.width // ss


def vae_params(cfg) -> float:
    """Parameters of the config's VAE, counted on the meta device from `vae_config` (nothing is
    built for real)."""
    import torch  # lazy: torch (kept out of vgrpo --help)

    with torch.device("meta"):
        vae = _vae_class(cfg.model.family).from_config(vae_config(cfg))
    return float(sum(p.numel() for p in vae.parameters()))


@lru_cache(maxsize=16)
def _flops_per_voxel(family: str, conf_json: str, op: str) -> float:
    # lazy: torch (kept out of vgrpo --help)
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    conf = json.loads(conf_json)
    c, st, ss = scale_factors(family, conf)
    with torch.device("meta"):
        vae = _vae_class(family).from_config(conf)
    f, h, w = _PROBE
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        if op == "decode":
            out = vae.decode(torch.empty(1, c, f, h, w, device="meta")).sample
            voxels = out[0, 0].numel()
        else:
            video = torch.empty(1, 3, (f - 1) * st + 1, h * ss, w * ss, device="meta")
            vae.encode(video)
            voxels = video[0, 0].numel()
    return counter.get_total_flops() / voxels


def vae_flops(cfg, op: str, frames: int | None = None) -> float:
    """FLOPs of one encode or decode of `frames` (default model.num_frames) at model.height x width."""
    m = cfg.model
    conf = vae_config(cfg)
    voxels = (m.num_frames if frames is None else frames) * m.height * m.width
    return _flops_per_voxel(m.family, json.dumps(conf, sort_keys=True, default=list), op) * voxels
