"""Pieces the real-run health tests inject into the actors: a learner whose model runs under CPU
bf16 autocast while the sampler's does not, and a reward whose composite is bought with another
head (the brighter the video, the higher `gamed` and the lower `quality`)."""

from __future__ import annotations

import torch

from reward_worker.base import RewardModel


class AutocastToyLearner:
    """Model factory for LearnerGroup: the toy model, its velocity under CPU bf16 autocast."""

    def __init__(self, cfg_data: dict):
        self.cfg_data = cfg_data

    def __call__(self):
        from common.config import RunConfig
        from rollout_worker.models.toy import ToyVideoModel

        model = ToyVideoModel.from_config(RunConfig.model_validate(self.cfg_data))
        inner = model.velocity

        def velocity(x, sigma, cond):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return inner(x, sigma, cond).float()

        model.velocity = velocity
        return model


class GamedReward(RewardModel):
    """`gamed` = mean brightness in [0, 1]; `quality` = 1 - gamed, exactly at its expense."""

    name = "toy"
    heads = ("gamed", "quality")

    def score(self, frames, prompts, images=None):
        bright = frames.float().mean(dim=(1, 2, 3, 4)) / 255.0  # [B]
        return torch.stack([bright, 1.0 - bright], dim=1)


class GamedFactory:
    def __call__(self, cfg):
        return GamedReward()
