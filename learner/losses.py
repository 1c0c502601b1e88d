"""The per-micro-batch loss, line by line with ALGORITHM.md sections 3–6.

    L       = mean_{i,k}[ w_k·max(-A_i·r, -A_i·clip(r, 1-ε, 1+ε)) ] + λ_KL·(β_anchor·D_anchor + β_step·D_step)
    L_total = L + γ·J_align

J_align is a RECONSTRUCTION (TAGRPO's equations are lost; docs/algorithm.md), in two forms
(`align.form`); weighting it by the equalizer's w_k is this project's choice.

`compute_loss` is a pure function of the policy's velocity function and one micro-batch
(anchor velocities come in precomputed). Every mean over (i, k) is a sum divided by the
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
from common.sde import Scheme, gaussian_kl
from learner.rows import MicroBatch
from rollout_worker.models.base import Cond

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
        return {"fixed": "pi0", "moving": "moving", "dual": "moving"}.get(self.strategy)

    @property
    def uses_step(self) -> bool:
        return self.strategy in ("step", "dual")

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
    m = mb.mask                                                            # [B] 0 on padding
    std = scheme.std(mb.sigma, mb.sigma_next).to(mb.x.device)              # [B]

    # 1. new log-probs: velocity → scheme mean → Gaussian log-density (as the sampler does)
    x = mb.x.float()                                                       # stored latents may be bf16
    new_v = velocity_fn(x, mb.sigma, cond)                                 # [B, C, F, H, W]
    new_mu = scheme.mean(mb.x, new_v, mb.sigma, mb.sigma_next)             # [B, C, F, H, W] fp32
    new_logp = scheme.log_prob(mb.x_next, new_mu, std)                     # [B]

    # 2. clipped surrogate (section 3), weighted per step by the equalizer (section 4)
    logratio = new_logp - mb.logp_old                                      # [B]
    ratio = logratio.exp()
    pg_loss1 = -mb.adv * ratio
    pg_loss2 = -mb.adv * ratio.clamp(1 - lc.clip_eps, 1 + lc.clip_eps)
    pg_loss = torch.max(pg_loss1, pg_loss2)                                # [B]
    policy_loss = (m * mb.weight * pg_loss).sum() / n_rows

    # 3. dual trust region (section 5)
    d_anchor = torch.zeros_like(new_logp)
    if lc.anchor is not None:
        anchor_mu = scheme.mean(mb.x, anchor_v, mb.sigma, mb.sigma_next)
        d_anchor = gaussian_kl(new_mu, anchor_mu, std)                     # [B]
    if lc.uses_step and lc.d_step == "exact":
        d_step = gaussian_kl(new_mu, mb.mu_old, std)                       # [B] to the sampling policy
    else:
        d_step = mb.logp_old - new_logp                                    # [B] k1
    beta_anchor = lc.beta_anchor if lc.anchor is not None else 0.0
    beta_step = lc.beta_step if lc.uses_step else 0.0
    kl_loss = lam_kl * (beta_anchor * (m * d_anchor).sum() + beta_step * (m * d_step).sum()) / n_rows

    # 4. trajectory alignment (section 6): step from x^i_k to the winner's / loser's x_{k+1}
    align_loss = torch.zeros((), device=new_logp.device)
    if lc.gamma > 0 and n_align > 0:
        logp_pos = scheme.log_prob(mb.x_pos, new_mu, std)                  # [B]
        logp_neg = scheme.log_prob(mb.x_neg, new_mu, std)                  # [B]
        if lc.align_form == "clipped":  # the clipped surrogate on r± = π_θ(x±|x^i) / π_old(x±|x^i)
            r_pos = (logp_pos - scheme.log_prob(mb.x_pos, mb.mu_old, std)).exp()
            r_neg = (logp_neg - scheme.log_prob(mb.x_neg, mb.mu_old, std)).exp()
            j = (torch.min(mb.a_pos * r_pos, mb.a_pos * r_pos.clamp(1 - lc.clip_eps, 1 + lc.clip_eps))
                 + torch.min(mb.a_neg * r_neg, mb.a_neg * r_neg.clamp(1 - lc.clip_eps, 1 + lc.clip_eps)))
        else:                           # the log-likelihood form: unbounded in the loser's direction
            j = mb.a_pos * logp_pos + mb.a_neg * logp_neg
        # the equalizer weights w_k too (this project's choice): unweighted, low-noise steps dominate
        align_loss = -(m * mb.align_mask * mb.weight * j).sum() / n_align

    loss = policy_loss + kl_loss + lc.gamma * align_loss

    with torch.no_grad():
        sums = {
            "loss": loss.detach(), "loss/policy": policy_loss.detach(), "loss/kl": kl_loss.detach(),
            "loss/align": align_loss.detach(),
            "ratio_mean": (m * ratio).sum() / n_rows,
            "approx_kl": (m * ((ratio - 1) - logratio)).sum() / n_rows,
            "clipfrac": (m * ((ratio - 1).abs() > lc.clip_eps).float()).sum() / n_rows,
            "kl/d_anchor": (m * d_anchor).sum() / n_rows,
            "kl/d_step": (m * d_step).sum() / n_rows,
            "logratio_absmax": (m * logratio.abs()).max(),
        }
        # the same on rows the current weights sampled (health's numerics check, cluster/health/checks.py)
        onp = m * (mb.on_policy.float() if mb.on_policy is not None else torch.zeros_like(m))
        sums.update({"onpolicy/rows": onp.sum(),
                     "onpolicy/clip": (onp * ((ratio - 1).abs() > lc.clip_eps).float()).sum(),
                     "onpolicy/approx_kl": (onp * ((ratio - 1) - logratio)).sum(),
                     "onpolicy/logratio_absmax": (onp * logratio.abs()).max()})
        d_pi0 = torch.zeros_like(new_logp)
        if pi0_v is not None:
            d_pi0 = gaussian_kl(new_mu, scheme.mean(mb.x, pi0_v, mb.sigma, mb.sigma_next), std)  # [B]
        sums["kl/d_pi0"] = (m * d_pi0).sum() / n_rows
    return loss, sums
