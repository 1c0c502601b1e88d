"""Verifiable rewards for the toy world: VQ, MQ and TA (`toy`), plus IA for image-to-video
(`toy_i2v`), each in [0, 1] (1 = a perfect rendering).

The measurements live in common/toyscore.py (documented there) so pretraining can use the
same yardstick; these classes are the RewardModel face of them. A video whose prompt is not a
toy-world prompt gets NaN heads (an invalid member, not a crash). `toy` accepts I2V condition
images and does not score them; `toy_i2v` needs them (IA: the first frame matches the image,
the square keeps its colour and size) and scores MQ and TA with the I2V travel.
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
        return self._score(frames, prompts, None)

    def _score(self, frames: Tensor, prompts: list[str], images: Tensor | None) -> Tensor:
        if frames.dtype != torch.uint8 or frames.dim() != 5 or frames.shape[-1] != 3:
            raise ValueError(f"frames must be uint8 [B, F, H, W, 3], got {frames.dtype} {tuple(frames.shape)}")
        if len(prompts) != frames.shape[0]:
            raise ValueError(f"got {len(prompts)} prompts for {frames.shape[0]} videos")
        out = torch.full((len(prompts), len(self.heads)), math.nan)        # [B, heads]
        imgs = [None] * len(prompts) if images is None else list(images.cpu().numpy())
        for i, (video, prompt, img) in enumerate(zip(frames.cpu().numpy(), prompts, imgs, strict=True)):
            try:
                s = toyscore.score_video(video, prompt, img)
            except ValueError:
                continue
            out[i] = torch.tensor([s[h] for h in self.heads])
        return out

    def composite(self, values: Tensor) -> Tensor:
        """R = Σ_h w_h·S_h over this model's heads: [B, heads] → [B]."""
        w = torch.tensor([self.weights[h] for h in self.heads], dtype=torch.float32)
        return values.float() @ w


class ToyI2VReward(ToyReward):
    name = "toy_i2v"
    heads = toyscore.I2V_HEADS

    def score(self, frames: Tensor, prompts: list[str], images: Tensor | None = None) -> Tensor:
        if images is None:
            raise ValueError("rewards.models[toy_i2v] scores image-to-video: it needs each video's first "
                             "frame (an I2V prompt set: a manifest or toy-i2v-train); for T2V use 'toy'")
        if images.dtype != torch.uint8 or tuple(images.shape) != (frames.shape[0], *frames.shape[2:]):
            raise ValueError(f"images must be uint8 [{frames.shape[0]}, {frames.shape[2]}, {frames.shape[3]}, 3], "
                             f"got {images.dtype} {tuple(images.shape)}")
        return self._score(frames, prompts, images)
