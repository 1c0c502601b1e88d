"""Build a reward model by name (imports are lazy: a toy run never imports transformers), and
the reward heads a config's models report, known before any model is loaded."""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from common.config import ConfigError, RewardModelConfig
from common.rewards import RewardHeads
from reward_worker.base import RewardModel

# rewards.models[].name -> (module, class); each class names its heads without loading anything
SCORERS: dict[str, tuple[str, str]] = {
    "toy": ("reward_worker.models.toy", "ToyReward"),
    "toy_i2v": ("reward_worker.models.toy", "ToyI2VReward"),
    "videoalign": ("reward_worker.models.videoalign", "VideoAlign"),
    "hpsv3": ("reward_worker.models.hpsv3", "HPSv3"),
    "qsave": ("reward_worker.models.qsave", "QSave"),
}
LOCAL = ("toy", "toy_i2v")  # scorers built from the config alone (no checkpoint)


def scorer_class(name: str) -> type[RewardModel]:
    if name not in SCORERS:
        raise ConfigError(f"rewards.models[].name = {name!r} has no scorer yet; use one of {', '.join(SCORERS)}")
    module, cls = SCORERS[name]
    return getattr(importlib.import_module(module), cls)


def build_reward_model(cfg: RewardModelConfig) -> RewardModel:
    """rewards.models[i] → a loaded RewardModel."""
    cls = scorer_class(cfg.name)
    return cls.from_config(cfg) if cfg.name in LOCAL else cls.from_pretrained(cfg)


def config_heads(cfgs: Sequence[RewardModelConfig]) -> RewardHeads:
    """The heads the configured scorers report, from their classes (nothing is loaded): a
    head name two models share is refused here, before a run starts."""
    return RewardHeads.build(cfgs, [scorer_class(c.name).heads for c in cfgs])
