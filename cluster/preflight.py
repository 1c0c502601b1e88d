"""Checks `vgrpo train` runs before it creates a run directory: every input a run reads at
start-up (prompt sets, model path, reward checkpoints, tracker packages), each failure one
line naming the field and the fix."""

from __future__ import annotations

from pathlib import Path

from common.config import ConfigError, RunConfig

SCORERS = ("toy", "videoalign", "hpsv3", "qsave")  # reward names with a scorer in reward_worker/


def check_prompts(cfg: RunConfig) -> None:
    from cluster.prompts import load_prompts

    for field in ("prompts", "eval_prompts"):
        try:
            load_prompts(getattr(cfg.train, field))
        except ConfigError as e:
            raise ConfigError(f"train.{field}: {e}") from None


def check_rewards(cfg: RunConfig) -> None:
    """Reward checkpoints that are named as local paths must exist; hub ids are left to the loader."""
    from rollout_worker.models.base import is_local

    for i, m in enumerate(cfg.rewards.models):
        field = f"rewards.models[{i}]"
        if m.name not in SCORERS:
            raise ConfigError(f"{field}.name = {m.name!r} has no scorer yet; use one of {', '.join(SCORERS)}")
        if m.name == "toy":
            continue
        if m.path is None:
            raise ConfigError(f"{field}.path is required for name = {m.name!r}; "
                              "point it at the downloaded checkpoint")
        for key in ("path", "base_path"):
            value = getattr(m, key)
            if value and is_local(value) and not Path(value).expanduser().exists():
                raise ConfigError(f"{field}.{key} = {value!r} does not exist; download the checkpoint "
                                  "there or fix the path")


def preflight(cfg: RunConfig) -> None:
    """Everything a run checks before it starts Ray, Redis or writes a file."""
    from cluster.driver import check_model_path
    from cluster.tracking import check_installed

    check_installed(cfg)
    check_prompts(cfg)
    check_model_path(cfg)
    check_rewards(cfg)
