"""Wan 2.2's two experts against the steps a config trains: with model.train_experts=high_noise
only the high-noise expert is trained (and the learner builds it alone), so every trained row
must be one it runs (t = 1000σ at or above the boundary)."""

from __future__ import annotations

from common.config import RunConfig
from common.sde import Schedule


def rows_on_frozen_expert(cfg: RunConfig, boundary_ratio: float | None) -> str | None:
    """Wan 2.2 with model.train_experts=high_noise and sampler.train_steps=threshold: the one-line
    refusal when the threshold asks to train steps the frozen low-noise expert runs (σ_k above
    the threshold but t = 1000σ_k below the boundary), else None. boundary_ratio: the config's,
    or the checkpoint's when the config leaves it out (the learner checks that one)."""
    if boundary_ratio is None or cfg.model.train_experts != "high_noise" or cfg.sampler.train_steps != "threshold":
        return None
    schedule = Schedule.from_config(cfg.schedule)
    frozen = [s for s in schedule.sigmas[:-1] if s > cfg.sampler.sigma_threshold and s * 1000.0 < boundary_ratio * 1000.0]
    if not frozen:
        return None
    return (f"sampler.sigma_threshold = {cfg.sampler.sigma_threshold:g} asks to train steps at σ = "
            f"{', '.join(f'{s:.3g}' for s in frozen)}, which the frozen low-noise expert runs (model.train_experts="
            f"high_noise, boundary_ratio {boundary_ratio:g}); set sampler.sigma_threshold >= {boundary_ratio:g} "
            "or model.train_experts=all")
