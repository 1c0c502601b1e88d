"""GRPO-Guard (grpo.loss=grpo_guard, docs/algorithm.md section 6c): FlowGRPO's clipped surrogate on
recorded SDE steps, with the importance ratio normalised (RatioNorm) and each step's loss
reweighted by 1/|dt|, against the implicit over-optimisation of low-noise steps.

Per row (member i, recorded step k: x_k → x_{k+1}), with s = the step's std (FlowGRPO's
std_dev_t·√|dt|), |dt| = σ_k − σ_{k+1}, g = s/√|dt| (std_dev_t), μ_θ and μ_old the current and
the sampling policy's means at x_k:

    b  = mean((μ_θ − μ_old)²) / (2·s²)                           the ratio-mean bias
    r̃  = exp((log π_θ − log π_old + b)·s)                        RatioNorm
    L  = mean_rows[ max(−A·r̃, −A·clip(r̃, 1 − ε, 1 + ε)) / |dt| ]
       + β·mean_rows[ mean((μ_θ − μ_π0)²) / (2·g²) ]             FlowGRPO's KL to π_0

ε = grpo.params.clip (2e-6), β = grpo.params.kl (0): flow_grpo's config/grpo_guard.py. Upstream
(flow_grpo's scripts/train_sd3_GRPO_Guard.py, verl-omni's GRPOGuardLoss) trains a micro-batch at
one step j, so its std_dev_t.mean() and sqrt_dt.mean() are that step's s and √|dt|; here rows of
different steps may share a micro-batch and each row takes its own, which is the same number.
Every mean over rows is a sum over the micro-batch divided by the batch-wide row count, as in
learner/losses.py. The equalizer's and Flash-GRPO's step weights (grpo.equalizer, grpo.rectify)
are not applied: 1/|dt| is this method's step weight.
"""

from __future__ import annotations

import torch
from torch import Tensor

from common.sde import Scheme, gaussian_kl
from learner.losses import PolicyStep, policy_step
from learner.methods.base import Declared
from learner.methods.grpo import _onpolicy_stats
from learner.rows import MicroBatch, build_rows, micro_batches

KEYS = ["loss", "loss/policy", "loss/kl", "ratio_mean", "approx_kl", "clipfrac", "guard/bias",
        "onpolicy/rows", "onpolicy/clip", "onpolicy/approx_kl", "kl/d_pi0"]


def guard_loss(mb: MicroBatch, step: PolicyStep, clip: float, beta: float, n_rows: int,
               ref_mu: Tensor | None = None, pi0_mu: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """This micro-batch's share of L (module docstring) and detached sums for the step's stats.

    ref_mu: π_0's mean at the rows' x_k, no grad (needed when β > 0); pi0_mu: the same for the
    health checks' KL to π_0 (no loss term)."""
    if beta > 0 and ref_mu is None:
        raise ValueError("grpo.params.kl > 0 needs π_0's mean (ref_mu)")
    if mb.mu_old is None:
        raise ValueError("GRPO-Guard needs the rollout's recorded μ_old (its declaration records it)")
    m = mb.mask
    s = torch.as_tensor(step.std, dtype=torch.float32, device=step.logp.device).expand_as(step.logp)  # [B]
    dt = (mb.sigma - mb.sigma_next).float()                                                    # [B] |dt|
    logratio = step.logp - mb.logp_old                                                         # [B]
    bias = ((step.mu - mb.mu_old.float()) ** 2).flatten(1).mean(1) / (2 * s ** 2)              # [B]
    ratio = torch.exp((logratio + bias) * s)                                                   # [B] r̃
    per_row = torch.maximum(-mb.adv * ratio, -mb.adv * ratio.clamp(1.0 - clip, 1.0 + clip)) / dt
    policy_loss = (m * per_row).sum() / n_rows
    kl = torch.zeros_like(per_row)
    if beta > 0:
        kl = ((step.mu - ref_mu.float()) ** 2).flatten(1).mean(1) / (2 * s ** 2 / dt)          # [B] /(2·g²)
    kl_loss = beta * (m * kl).sum() / n_rows
    loss = policy_loss + kl_loss
    with torch.no_grad():
        raw = logratio.exp()
        akl = (raw - 1) - logratio                              # approx-KL of the raw ratio (health)
        clipped = ((ratio - 1).abs() > clip).float()            # what RatioNorm's clip cuts
        onp = m * (mb.on_policy.float() if mb.on_policy is not None else torch.zeros_like(m))
        d_pi0 = gaussian_kl(step.mu, pi0_mu, s) if pi0_mu is not None else torch.zeros_like(per_row)
        sums = {"loss": loss.detach(), "loss/policy": policy_loss.detach(), "loss/kl": kl_loss.detach(),
                "ratio_mean": (m * ratio).sum() / n_rows, "approx_kl": (m * akl).sum() / n_rows,
                "clipfrac": (m * clipped).sum() / n_rows, "guard/bias": (m * bias).sum() / n_rows,
                "onpolicy/rows": onp.sum(), "onpolicy/clip": (onp * clipped).sum(),
                "onpolicy/approx_kl": (onp * akl).sum(), "kl/d_pi0": (m * d_pi0).sum() / n_rows,
                "logratio_absmax": (m * logratio.abs()).max(),
                "onpolicy/logratio_absmax": (onp * logratio.abs()).max()}
    return loss, sums


class GRPOGuard(Declared):
    keys = KEYS

    def __init__(self, cfg):
        super().__init__(cfg)
        self.clip, self.beta = self.p["clip"], self.p["kl"]

    def rows(self, batch, version: int):
        rows = build_rows(batch, self.cfg)  # with μ_old: the declaration records it
        rows.on_policy = rows.policy_version == version
        return rows

    def micro_batches(self, rows, size: int, rank: int, world_size: int):
        return micro_batches(rows, size, rank, world_size)

    def micro_loss(self, trainer, rows, mb, cond_all, lam_kl: float):
        """π_0's velocity first (no grad; for the loss's KL or the health checks'), then the step."""
        policy, scheme = trainer.policy, rows.scheme
        mb = mb.to(trainer.device)
        cond = cond_all.index(mb.cond_idx)
        nxt = mb.sigma_next
        health = self.measures_pi0(trainer, trainer.version)
        pi0_v = policy.anchor_velocity("pi0", mb.x.float(), mb.sigma, cond, nxt) if self.beta > 0 or health else None
        step = policy_step(mb, cond, lambda x, sigma, c: policy.velocity(x, sigma, c, nxt), scheme)
        pi0_mu = _mean(scheme, mb, pi0_v) if pi0_v is not None else None
        return guard_loss(mb, step, self.clip, self.beta, rows.n, pi0_mu if self.beta > 0 else None,
                          pi0_mu if health else None)

    def step_stats(self, trainer, stats, onpolicy_absmax: float) -> None:
        stats.update(_onpolicy_stats(stats, onpolicy_absmax))
        if not self.measures_pi0(trainer, trainer.version - 1):
            del stats["kl/d_pi0"]  # not measured at this step

    def after_step(self, trainer, stats) -> None:
        pass  # no moving anchor, no λ_KL: its KL weight is fixed (grpo.params.kl)

    def measures_pi0(self, trainer, version: int) -> bool:
        """Every health.kl_pi0_every steps, when π_0 is kept (LoRA keeps it)."""
        every = self.cfg.health.kl_pi0_every
        return every > 0 and version % every == 0 and "pi0" in trainer.policy.anchors


def _mean(scheme: Scheme, mb: MicroBatch, v: Tensor) -> Tensor:
    return scheme.mean(mb.x, v, mb.sigma, mb.sigma_next)
