"""Verifiable rewards for the toy world: VQ, MQ and TA, each in [0, 1] (1 = a perfect rendering).

The measurements live in common/toyscore.py (documented there) so pretraining can use the
same yardstick; this class is the RewardModel face of them. A video whose prompt is not a
toy-world prompt gets NaN heads (an invalid member, not a crash). I2V condition images are
accepted and not scored.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from common import toyscore
from reward_worker.base import RewardModel


class ToyReward(RewardModel):
    name = "toy"
    heads = toyscore.HEADS

    def __init__(self, weights: dict[str, float] | None = None):
        weights = dict(weights or {})
        unknown = sorted(set(weights) - set(self.heads))
        if unknown:
            raise ValueError(f"rewards.models[toy].weights: unknown head(s) {unknown}; expected {list(self.heads)}")
        self.weights = {h: float(weights.get(h, 1.0)) for h in self.heads}

    @classmethod
    def from_config(cls, cfg) -> ToyReward:
        """From a common.config.RewardModelConfig."""
        return cls(cfg.weights)

    def score(self, frames: Tensor, prompts: list[str], images: Tensor | None = None) -> Tensor:
        if frames.dtype != torch.uint8 or frames.dim() != 5 or frames.shape[-1] != 3:
            raise ValueError(f"frames must be uint8 [B, F, H, W, 3], got {frames.dtype} {tuple(frames.shape)}")
        if len(prompts) != frames.shape[0]:
            raise ValueError(f"got {len(prompts)} prompts for {frames.shape[0]} videos")
        out = torch.full((len(prompts), len(self.heads)), math.nan)        # [B, 3]
        for i, (video, prompt) in enumerate(zip(frames.cpu().numpy(), prompts, strict=True)):
            try:
                s = toyscore.score_video(video, prompt)
            except ValueError:
                continue
            out[i] = torch.tensor([s[h] for h in self.heads])
        return out

    def composite(self, values: Tensor) -> Tensor:
        """R = Σ_h w_h·S_h over this model's heads: [B, 3] → [B]."""
        w = torch.tensor([self.weights[h] for h in self.heads], dtype=torch.float32)
        return values.float() @ w
