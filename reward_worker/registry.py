"""Build a reward model by name (imports are lazy: a toy run never imports transformers)."""

from __future__ import annotations

from common.config import RewardModelConfig
from reward_worker.base import RewardModel


def build_reward_model(cfg: RewardModelConfig) -> RewardModel:
    """rewards.models[i] → a loaded RewardModel."""
    if cfg.name == "toy":
        from reward_worker.models.toy import ToyReward

        return ToyReward.from_config(cfg)
    if cfg.name == "toy_i2v":
        from reward_worker.models.toy import ToyI2VReward

        return ToyI2VReward.from_config(cfg)
    if cfg.name == "videoalign":
        from reward_worker.models.videoalign import VideoAlign

        return VideoAlign.from_pretrained(cfg)
    if cfg.name == "hpsv3":
        from reward_worker.models.hpsv3 import HPSv3

        return HPSv3.from_pretrained(cfg)
    if cfg.name == "qsave":
        from reward_worker.models.qsave import QSave

        return QSave.from_pretrained(cfg)
    raise ValueError(f"rewards.models[].name = {cfg.name!r} has no scorer yet; "
                     "use toy, toy_i2v, videoalign, hpsv3 or qsave")
