"""The interface every reward model implements.

A reward model has named heads and scores a batch of decoded videos:
uint8 frames [B, F, H, W, 3], prompts, optional condition images → float [B, heads].
A head that cannot be scored for a video is NaN there; the reward actor turns that into an
invalid member instead of a crash.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from torch import Tensor


class RewardModel(ABC):
    name: str = "base"
    heads: tuple[str, ...] = ()
    """Named outputs, for example ("VQ", "MQ", "TA")."""

    @abstractmethod
    def score(self, frames: Tensor, prompts: list[str], images: Tensor | None = None) -> Tensor:
        """frames uint8 [B, F, H, W, 3], prompts [B], images uint8 [B, H, W, 3] or None → fp32 [B, len(heads)]."""

    def head_names(self) -> list[str]:
        """Heads as reported to the composite and metrics, prefixed only when names collide."""
        return list(self.heads)
