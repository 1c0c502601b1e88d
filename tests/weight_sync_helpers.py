"""Shared by the weight-sync tests (tests/test_weight_sync.py, tests/test_sp_weight_sync.py)."""

from __future__ import annotations

import torch

from learner.weight_sync import WeightPublisher


def perturbed(state: dict, seed: int) -> dict:
    """Another version of a state dict: its floats moved by seeded noise."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
            for k, v in state.items()}


class AlteredInFlight(WeightPublisher):
    """Flips one bit of the third bucket's bytes on the wire, after the sender took its digests."""

    def _broadcast(self, t):
        self.count = getattr(self, "count", 0) + 1
        if self.count == 5:  # data and digests alternate: the third bucket's data
            t = t.clone()
            t.view(torch.uint8).view(-1)[t.numel() * t.element_size() // 2] ^= 4
            self.kept = t  # alive until its broadcast completes
        return super()._broadcast(t)
