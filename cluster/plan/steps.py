"""The steps a group member trains, and so stores, counted from the config exactly as the
sampler draws them (rollout_worker/sampler.py), without loading the model."""

from __future__ import annotations

import json
from pathlib import Path

from common.families import FAMILIES, release_of
from common.methods import method_of

_BOUNDARY = {"i2v": 0.9, "t2v": 0.875}  # Wan 2.2 A14B's boundary_ratio, as its model_index.json sets it


def has_two_experts(cfg) -> bool:
    """Wan 2.2 A14B: a high-noise `transformer` and a low-noise `transformer_2`."""
    m = cfg.model
    if not FAMILIES[m.family].expert_boundary:
        return False
    if m.path is not None and (Path(m.path) / "model_index.json").is_file():
        index = json.loads((Path(m.path) / "model_index.json").read_text(encoding="utf-8"))
        return (index.get("transformer_2") or [None])[0] is not None
    release = release_of(m.family, m.path)
    return m.boundary_ratio is not None or (release is not None and release.two_experts)


def per_token_timesteps(cfg) -> bool:
    """Wan 2.2 TI2V-5B: one timestep per video token (model_index.json `expand_timesteps`, or the
    release model.path names); its I2V holds the first latent frame instead of concatenating a
    condition (rollout_worker/models/wan.py)."""
    m = cfg.model
    if m.path is not None and (Path(m.path) / "model_index.json").is_file():
        index = json.loads((Path(m.path) / "model_index.json").read_text(encoding="utf-8"))
        return bool(index.get("expand_timesteps", False))
    release = release_of(m.family, m.path)
    return release is not None and release.expand_timesteps


class _ExpertRule:
    """The sampler's `model.trains_sigma` without the model: Wan 2.2 with train_experts=high_noise
    trains only the steps its high-noise expert serves."""

    def __init__(self, cfg):
        m = cfg.model
        boundary = m.boundary_ratio if m.boundary_ratio is not None else _BOUNDARY[m.task]
        self.boundary_timestep = boundary * 1000.0 if has_two_experts(cfg) else None
        self.train_experts = m.train_experts

    def trains_sigma(self, sigma: float) -> bool:
        # lazy: torch, numpy (kept out of vgrpo --help)
        from rollout_worker.models.wan import expert_trains

        return expert_trains(sigma, self.boundary_timestep, self.train_experts)


def stored_steps_per_member(cfg) -> int:
    """Transitions one group member stores in the bank: the steps it trains, counted exactly as
    the sampler draws them (rollout_worker/sampler.draw_trained_steps over trainable_steps:
    never a step without noise, one of the last `ode_last_steps`, or one a frozen expert serves).

    This is the group format: each member stores only the steps it trains (rollout_worker/
    sampler.sample_group), whatever else alignment makes the group run with the scheme."""
    # lazy: torch, PIL (kept out of vgrpo --help)
    from common.sde import Schedule, scheme_from_config
    from rollout_worker.sampler import draw_trained_steps

    if not method_of(cfg).records_steps:  # ODE rollouts record no step: final latents only
        return 0
    schedule = Schedule.from_config(cfg.schedule)
    scheme = scheme_from_config(cfg, schedule)
    draws = draw_trained_steps(schedule, scheme, cfg.sampler, seed=0, members=cfg.sampler.group_size,
                               model=_ExpertRule(cfg))
    return max(len(d) for d in draws)
