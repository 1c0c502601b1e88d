"""DPM-Solver++(2M) for flow matching: the higher-order ODE solver MixGRPO-Flash runs after its
window and DiffusionNFT samples with (`sampler.post_solver: dpm2`; docs/algorithm.md section 2b).

Flow matching is the diffusion x_σ = α·x_0 + σ·ε with α = 1 - σ, so with λ = log(α/σ) and the
data prediction x̂_0 = x - σ·v, one step σ_s → σ_t (h = λ_t - λ_s) is

    first order (= DDIM = Euler):  x_t = (σ_t/σ_s)·x - α_t·(e^{-h} - 1)·D_0
    second order (2M):             x_t = (σ_t/σ_s)·x - α_t·(e^{-h} - 1)·(D_0 + ½·D_1),
                                   D_0 = x̂_0(s),  D_1 = (D_0 - x̂_0(s_prev)) / r,  r = (λ_s - λ_prev) / h

The first order runs where there is no previous x̂_0, where the step starts at σ = 1 (λ = -∞)
or follows one that did, and on the last step (σ_t = 0, where it returns x̂_0), as the
DPM-Solver++ multistep code does.
"""

from __future__ import annotations

import math

from torch import Tensor


def _lam(sigma: float) -> float:
    return math.log((1.0 - sigma) / sigma)


class DPMSolver2M:
    """Steps one trajectory (a batch of them); `observe` feeds the x̂_0 of steps it did not take."""

    def __init__(self) -> None:
        self.prev: tuple[float, Tensor] | None = None   # (σ, x̂_0) of the previous step

    def observe(self, x: Tensor, v: Tensor, sigma: float) -> None:
        """Remember x̂_0 = x - σ·v at σ (a step another rule took, e.g. an SDE step in the window)."""
        self.prev = (float(sigma), x.float() - float(sigma) * v.float())

    def step(self, x: Tensor, v: Tensor, sigma: float, sigma_next: float) -> Tensor:
        """x at σ_next; fp32. σ and σ_next are the step's ends, 1 ≥ σ > σ_next ≥ 0."""
        s, t = float(sigma), float(sigma_next)
        d0 = x.float() - s * v.float()
        prev, self.prev = self.prev, (s, d0)
        if t <= 0.0:                    # the last step lands on the data prediction
            return d0
        if s >= 1.0:                    # λ_s = -∞: the first-order step is the Euler step
            return x.float() - (s - t) * v.float()
        h = _lam(t) - _lam(s)
        coef = -(1.0 - t) * math.expm1(-h)
        out = (t / s) * x.float() + coef * d0
        if prev is None or prev[0] >= 1.0:
            return out
        r = (_lam(s) - _lam(prev[0])) / h
        return out + 0.5 * coef * (d0 - prev[1]) / r
