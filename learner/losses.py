"""The per-micro-batch loss, term by term with docs/algorithm.md sections 3 and 5–7.

    L       = mean_{i,k}[ w_k·max(-A_i·r, -A_i·clip(r, 1-ε, 1+ε)) ] + λ_KL·(β_anchor·D_anchor + β_step·D_step)
    L_total = L + γ·J_align

J_align is a RECONSTRUCTION (TAGRPO's equations are lost; docs/algorithm.md), in two forms
(`align.form`); weighting it by the equalizer's w_k is this project's choice.

`compute_loss` is a pure function of the policy's velocity function and one micro-batch
(anchor velocities come in precomputed); each term is its own function (`policy_step`,
`clipped_surrogate`, `trust_region`, `alignment`). Every mean over (i, k) is a sum divided by the
batch-wide count, so summing the micro-batch losses (and the ranks' gradients) gives the
full-batch loss exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from common.config import RunConfig
from common.methods import KL_STRATEGIES
from common.sde import Scheme, gaussian_kl
from common.types import Cond
from learner.rows import MicroBatch

VelocityFn = Callable[[Tensor, Tensor, Cond], Tensor]  # (x [B, ...], σ [B], cond) → v [B, ...]


@dataclass(frozen=True)
class LossConfig:
    clip_eps: float
    strategy: Literal["none", "fixed", "step", "moving", "dual"]
    beta_anchor: float
    beta_step: float
    d_step: Literal["k1", "exact"]
    gamma: float          # 0 with alignment off
    align_form: Literal["loglik", "clipped"] = "clipped"

    @classmethod
    def from_run(cls, cfg: RunConfig) -> LossConfig:
        return cls(cfg.grpo.clip_eps, cfg.kl.strategy, cfg.kl.beta_anchor, cfg.kl.beta_step,
                   cfg.kl.d_step, cfg.align.gamma if cfg.align.enabled else 0.0, cfg.align.form)

    @property
    def anchor(self) -> str | None:
        """The anchor D_anchor is taken against: π_0 (`fixed`), the moving one, or none."""
        return KL_STRATEGIES[self.strategy].anchor

    @property
    def uses_step(self) -> bool:
        return KL_STRATEGIES[self.strategy].step

    @property
    def needs_mu_old(self) -> bool:
        """The sampling policy's mean per row: the exact D_step, or the bounded J_align."""
        return (self.uses_step and self.d_step == "exact") or (self.gamma > 0 and self.align_form == "clipped")


def compute_loss(mb: MicroBatch, cond: Cond, velocity_fn: VelocityFn, scheme: Scheme,
                 lc: LossConfig, lam_kl: float, n_rows: int, n_align: int,
                 anchor_v: Tensor | None = None, pi0_v: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Returns (this micro-batch's share of L_total, detached sums for the step's stats).

    cond: the micro-batch's encoded conditions (rows aligned with mb).
    anchor_v: velocity of the D_anchor anchor on mb.x, no grad.
    pi0_v: velocity of π_0 on mb.x, no grad, when the KL to π_0 is measured (health; no loss term).
    """
    if lc.anchor is not None and anchor_v is None:
        raise ValueError(f"kl.strategy={lc.strategy!r} needs the {lc.anchor!r} anchor's velocity (anchor_v)")
    if lc.needs_mu_old and mb.mu_old is None:
        raise ValueError("kl.d_step='exact' and align.form='clipped' need the rollout's recorded μ_old")
    step = policy_step(mb, cond, velocity_fn, scheme)
    policy_loss, ratio, logratio = clipped_surrogate(mb, step, lc, n_rows)
    kl_loss, d_anchor, d_step = trust_region(mb, step, scheme, lc, lam_kl, n_rows, anchor_v)
    align_loss = alignment(mb, step, scheme, lc, n_align)
    loss = policy_loss + kl_loss + lc.gamma * align_loss
    with torch.no_grad():
        sums = {"loss": loss.detach(), "loss/policy": policy_loss.detach(), "loss/kl": kl_loss.detach(),
                "loss/align": align_loss.detach()}
        sums.update(ratio_stats(mb, ratio, logratio, lc, n_rows))
        sums["kl/d_anchor"] = (mb.mask * d_anchor).sum() / n_rows
        sums["kl/d_step"] = (mb.mask * d_step).sum() / n_rows
        d_pi0 = torch.zeros_like(step.logp)
        if pi0_v is not None:
            d_pi0 = gaussian_kl(step.mu, scheme.mean(mb.x, pi0_v, mb.sigma, mb.sigma_next), step.std)  # [B]
        sums["kl/d_pi0"] = (mb.mask * d_pi0).sum() / n_rows
    return loss, sums


@dataclass
class PolicyStep:
    """The current policy's Gaussian for each row's step: mean μ_θ, its std and log π_θ(x_{k+1} | x_k)."""

    mu: Tensor     # [B, C, F, H, W] fp32
    std: Tensor    # [B]
    logp: Tensor   # [B]


def policy_step(mb: MicroBatch, cond: Cond, velocity_fn: VelocityFn, scheme: Scheme) -> PolicyStep:
    """New log-probs (section 3): velocity → scheme mean → Gaussian log-density, as the sampler does."""
    std = scheme.std(mb.sigma, mb.sigma_next).to(mb.x.device)              # [B]
    x = mb.x.float()                                                       # stored latents may be bf16
    new_v = velocity_fn(x, mb.sigma, cond)                                 # [B, C, F, H, W]
    new_mu = scheme.mean(mb.x, new_v, mb.sigma, mb.sigma_next)             # [B, C, F, H, W] fp32
    return PolicyStep(new_mu, std, scheme.log_prob(mb.x_next, new_mu, std))


def clipped_surrogate(mb: MicroBatch, step: PolicyStep, lc: LossConfig, n_rows: int
                      ) -> tuple[Tensor, Tensor, Tensor]:
    """L_clip (section 6), each row weighted by its step weight w_k (section 5): (L_clip, r, log r)."""
    logratio = step.logp - mb.logp_old                                     # [B]
    ratio = logratio.exp()
    pg_loss1 = -mb.adv * ratio
    pg_loss2 = -mb.adv * ratio.clamp(1 - lc.clip_eps, 1 + lc.clip_eps)
    pg_loss = torch.max(pg_loss1, pg_loss2)                                # [B]
    return (mb.mask * mb.weight * pg_loss).sum() / n_rows, ratio, logratio


def trust_region(mb: MicroBatch, step: PolicyStep, scheme: Scheme, lc: LossConfig, lam_kl: float,
                 n_rows: int, anchor_v: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """The dual trust region (section 6): (λ_KL·(β_anchor·D_anchor + β_step·D_step), D_anchor, D_step)."""
    d_anchor = torch.zeros_like(step.logp)
    if lc.anchor is not None:
        anchor_mu = scheme.mean(mb.x, anchor_v, mb.sigma, mb.sigma_next)
        d_anchor = gaussian_kl(step.mu, anchor_mu, step.std)               # [B]
    if lc.uses_step and lc.d_step == "exact":
        d_step = gaussian_kl(step.mu, mb.mu_old, step.std)                 # [B] to the sampling policy
    else:
        d_step = mb.logp_old - step.logp                                   # [B] k1
    beta_anchor = lc.beta_anchor if lc.anchor is not None else 0.0
    beta_step = lc.beta_step if lc.uses_step else 0.0
    m = mb.mask
    kl_loss = lam_kl * (beta_anchor * (m * d_anchor).sum() + beta_step * (m * d_step).sum()) / n_rows
    return kl_loss, d_anchor, d_step


def alignment(mb: MicroBatch, step: PolicyStep, scheme: Scheme, lc: LossConfig, n_align: int) -> Tensor:
    """J_align (section 7, a RECONSTRUCTION): step from x^i_k to the winner's / loser's x_{k+1}."""
    if not (lc.gamma > 0 and n_align > 0):
        return torch.zeros((), device=step.logp.device)
    std = step.std
    logp_pos = scheme.log_prob(mb.x_pos, step.mu, std)                     # [B]
    logp_neg = scheme.log_prob(mb.x_neg, step.mu, std)                     # [B]
    if lc.align_form == "clipped":  # the clipped surrogate on r± = π_θ(x±|x^i) / π_old(x±|x^i)
        r_pos = (logp_pos - scheme.log_prob(mb.x_pos, mb.mu_old, std)).exp()
        r_neg = (logp_neg - scheme.log_prob(mb.x_neg, mb.mu_old, std)).exp()
        j = (torch.min(mb.a_pos * r_pos, mb.a_pos * r_pos.clamp(1 - lc.clip_eps, 1 + lc.clip_eps))
             + torch.min(mb.a_neg * r_neg, mb.a_neg * r_neg.clamp(1 - lc.clip_eps, 1 + lc.clip_eps)))
    else:                           # the log-likelihood form: unbounded in the loser's direction
        j = mb.a_pos * logp_pos + mb.a_neg * logp_neg
    # the equalizer weights w_k too (this project's choice): unweighted, low-noise steps dominate
    return -(mb.mask * mb.align_mask * mb.weight * j).sum() / n_align


def ratio_stats(mb: MicroBatch, ratio: Tensor, logratio: Tensor, lc: LossConfig, n_rows: int
                ) -> dict[str, Tensor]:
    """r's mean, approx-KL, clip fraction and max |log r|: over every row, and the sums over the rows
    the current weights sampled (health's numerics check, cluster/health/checks.py). No grad."""
    m = mb.mask
    clipped = ((ratio - 1).abs() > lc.clip_eps).float()
    out = {"ratio_mean": (m * ratio).sum() / n_rows,
           "approx_kl": (m * ((ratio - 1) - logratio)).sum() / n_rows,
           "clipfrac": (m * clipped).sum() / n_rows,
           "logratio_absmax": (m * logratio.abs()).max()}
    onp = m * (mb.on_policy.float() if mb.on_policy is not None else torch.zeros_like(m))
    out.update({"onpolicy/rows": onp.sum(), "onpolicy/clip": (onp * clipped).sum(),
                "onpolicy/approx_kl": (onp * ((ratio - 1) - logratio)).sum(),
                "onpolicy/logratio_absmax": (onp * logratio.abs()).max()})
    return out
