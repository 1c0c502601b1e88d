"""The λ_KL schedule (ALGORITHM.md section 5, config `kl.schedule`).

1. constant:  λ = kl.lam
2. two_stage: λ = lam_low before switch_step, then lam_high
3. milder:    λ = lam_low before switch_step, then lam_mid
4. adaptive:  a Lagrange multiplier in [lam_low, lam_high] tracking a target KL δ,
              λ ← clip(λ·exp(α·(KL/δ - 1)), lam_low, lam_high), starting at clip(lam).
"""

from __future__ import annotations

import math

from common.config import KLConfig


class KLController:
    """Holds λ_KL; `value(step)` gives λ for an optimizer step, `update(kl)` feeds the measured KL."""

    def __init__(self, cfg: KLConfig):
        self.cfg = cfg
        self.lam = min(max(cfg.lam, cfg.lam_low), cfg.lam_high)  # adaptive's multiplier

    def value(self, step: int) -> float:
        c = self.cfg
        if c.schedule == "constant":
            return c.lam
        if c.schedule == "two_stage":
            return c.lam_low if step < c.switch_step else c.lam_high
        if c.schedule == "milder":
            return c.lam_low if step < c.switch_step else c.lam_mid
        return self.lam

    def update(self, kl: float) -> float:
        """After an optimizer step, with the measured KL term; returns the new λ (adaptive only moves)."""
        c = self.cfg
        if c.schedule == "adaptive" and math.isfinite(kl):
            # Reconstruction: the paper's appendix with the exact rule is lost (ALGORITHM.md §5).
            ratio = min(kl / c.target - 1.0, 50.0)  # cap the exponent so one outlier cannot overflow
            self.lam = min(max(self.lam * math.exp(c.alpha * ratio), c.lam_low), c.lam_high)
        return self.lam

    def state_dict(self) -> dict:
        return {"lam": self.lam, "schedule": self.cfg.schedule}

    def load_state_dict(self, state: dict) -> None:
        if state.get("schedule") != self.cfg.schedule:
            raise ValueError(f"KL controller state was saved with kl.schedule={state.get('schedule')!r}, "
                             f"but this run uses {self.cfg.schedule!r}")
        self.lam = float(state["lam"])
