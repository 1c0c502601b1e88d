"""Build a reward model by name from its declaration (common/scorers.py; imports are lazy: a toy
run never imports transformers), and the reward heads a config's models report, known before any
model is loaded."""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from common.config import ConfigError, RewardModelConfig
from common.rewards import RewardHeads
from common.scorers import scorer_spec
from reward_worker.base import RewardModel


def scorer_class(name: str) -> type[RewardModel]:
    """The class of a declared reward model (common/scorers.py), imported now."""
    try:
        spec = scorer_spec(name)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    module, cls = spec.impl.split(":")
    return getattr(importlib.import_module(module), cls)


def build_reward_model(cfg: RewardModelConfig) -> RewardModel:
    """rewards.models[i] → a loaded RewardModel."""
    cls = scorer_class(cfg.name)
    return cls.from_pretrained(cfg) if scorer_spec(cfg.name).needs_path else cls.from_config(cfg)


def config_heads(cfgs: Sequence[RewardModelConfig]) -> RewardHeads:
    """The heads the configured scorers report, from their declarations (nothing is imported or
    loaded): a head name two models share is refused here, before a run starts."""
    return RewardHeads.build(cfgs, [scorer_spec(c.name).heads for c in cfgs])
