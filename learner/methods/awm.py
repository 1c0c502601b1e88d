"""Advantage Weighted Matching (grpo.loss=awm, docs/algorithm.md section 6c): the pretraining
flow-matching loss on the clean final latents of the rollouts, weighted by the advantage
(scxue/advantage_weighted_matching, advantage_weighted_matching/scripts/train_sd3_awm.py). The
rollouts record no step; they are stochastic only where a step ends at σ in [0.3, 0.9] (the
declaration's sde_band, its stochasticity_control_function), deterministic elsewhere.

Rows: per member, M = grpo.params.timesteps schedule indices, one in each of the M strata of
linspace(first_index, int(T·timestep_fraction), M + 1) (its time_type discrete_wo_init; discrete
with first_index 0), each with fresh noise ε: x_t = (1 − σ)·x_0 + σ·ε. Per row, with v_θ, v_π0 and
v_old (its `ema` adapter, anchor `old`) at (x_t, σ):

    ℓ   = −mean((v_θ − (ε − x_0))²)                                    in float64
    ℓ_w = −((−ℓ + 1e-10)^p − (1e-10)^p)·σ / p                          its ghuber weighting, p = ghuber_power
    ρ   = exp(ℓ_w − sg(ℓ_w))                                            on-policy: its old log-prob is θ's own
    Â   = clip(A, ±c_A) / c_A · advantage_max                           c_A = grpo.adv_clip
    L   = mean_rows[ max(−Â·ρ, −Â·clip(ρ, 1 − ε, 1 + ε)) ]
        + β·mean_rows[ mean((v_θ − v_π0)²) ] + β_ema·mean_rows[ mean((v_θ − v_old)²) ]

ε = grpo.params.clip (1), β = kl (0.003), β_ema = ema_kl (1): its dgx_awm.py ocr recipe. After
optimizer step t, v_old ← d·v_old + (1 − d)·θ with d = min(ema_decay_max, ema_decay_rate·t) (its
kl_ema_decay_type linear: min(0.3, 0.001·global_step)). Upstream draws a micro-batch's indices
once for its samples; here each member draws its own. Every mean over rows is a sum over the
micro-batch divided by the batch-wide row count.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from common.methods import method_params
from common.types import Cond, TrainBatch
from learner.advantages import is_zero_std
from learner.losses import VelocityFn
from learner.methods.base import Declared
from learner.rows import batch_std, member_advantages, rank_rows

KEYS = ["loss", "loss/policy", "loss/kl", "loss/ema_kl", "awm/mse", "awm/adv_abs"]
TINY = 1e-10  # its ghuber offset


@dataclass
class AWMRows:
    x0: Tensor           # [N, C, F, H, W] the member's clean final latents
    xt: Tensor           # [N, C, F, H, W] (1 - σ)·x0 + σ·ε
    eps: Tensor          # [N, C, F, H, W] ε
    sigma: Tensor        # [N]
    adv: Tensor          # [N] Â
    cond_idx: Tensor     # [N] long, the fresh group's index
    cond: Cond | None
    stats: dict[str, float]

    @property
    def n(self) -> int:
        return self.x0.shape[0]


@dataclass
class AWMMicroBatch:
    x0: Tensor
    xt: Tensor
    eps: Tensor
    sigma: Tensor
    adv: Tensor
    mask: Tensor         # [B] 1 for real rows, 0 for padding
    cond_idx: Tensor

    def to(self, device) -> AWMMicroBatch:
        return AWMMicroBatch(**{k: v.to(device) for k, v in self.__dict__.items()})


def stratified_indices(n_steps: int, fraction: float, m: int, first: int, gen: torch.Generator) -> list[int]:
    """One schedule index per stratum of linspace(first, int(T·fraction), m + 1), truncated to
    integers (its discrete time types): lower + ⌊u·(upper − lower)⌋, u ~ U[0, 1)."""
    bounds = torch.linspace(first, int(n_steps * fraction), m + 1).long()
    u = torch.rand(m, generator=gen)
    return (bounds[:-1] + (u * (bounds[1:] - bounds[:-1])).long()).clamp(0, n_steps - 1).tolist()


def build_awm_rows(batch: TrainBatch, cfg) -> AWMRows:
    if not batch.fresh:
        raise ValueError("empty TrainBatch: no fresh groups")
    p = method_params(cfg)
    sigmas = torch.tensor(batch.fresh[0].members[0].spec.sigmas, dtype=torch.float32)
    T = len(sigmas) - 1
    gen = torch.Generator().manual_seed(zlib.crc32(f"awm:{cfg.train.seed}:{batch.version}".encode()))
    std = batch_std(batch, cfg)
    clip = cfg.grpo.adv_clip
    x0s, sig, advs, cond_idx, rewards, zero = [], [], [], [], [], []
    for gi, group in enumerate(batch.fresh):
        adv, reward, mask = member_advantages(group, [], cfg, std)       # clamped to ±grpo.adv_clip
        adv = adv / clip * p["advantage_max"]
        rewards.append(reward)
        zero.append(is_zero_std(reward, mask))
        for mi, t in enumerate(group.members):
            js = stratified_indices(T, p["timestep_fraction"], int(p["timesteps"]), int(p["first_index"]), gen)
            x0s += [t.final_latents.float()] * len(js)
            sig.append(sigmas[js])
            advs.append(adv[mi].expand(len(js)))
            cond_idx += [gi] * len(js)
    x0, sigma = torch.stack(x0s), torch.cat(sig)
    eps = torch.randn(x0.shape, generator=gen)
    s = sigma.view(-1, *([1] * (x0.dim() - 1)))
    all_r = torch.cat(rewards)
    stats = {"reward_mean": float(all_r.mean()), "reward_std": float(all_r.std(unbiased=False)),
             "zero_std_frac": sum(zero) / len(zero), "num_rows": float(len(sigma))}
    conds = [g.members[0].cond for g in batch.fresh]
    return AWMRows(x0=x0, xt=(1 - s) * x0 + s * eps, eps=eps, sigma=sigma, adv=torch.cat(advs),
                   cond_idx=torch.tensor(cond_idx), cond=None if any(c is None for c in conds) else Cond.cat(conds),
                   stats=stats)


def awm_micro_batches(rows: AWMRows, size: int, rank: int = 0, world_size: int = 1) -> Iterator[AWMMicroBatch]:
    idx, mask = rank_rows(rows.n, rank, world_size)
    for start in range(0, len(idx), size):
        i = idx[start:start + size]
        yield AWMMicroBatch(x0=rows.x0[i], xt=rows.xt[i], eps=rows.eps[i], sigma=rows.sigma[i], adv=rows.adv[i],
                            mask=mask[start:start + size], cond_idx=rows.cond_idx[i])


def weighted_log_prob(v: Tensor, eps: Tensor, x0: Tensor, sigma: Tensor, power: float) -> Tensor:
    """ℓ_w per row [B] (float64): its ghuber weighting of −mean((v − (ε − x_0))²)."""
    lp = -((v.double() - (eps.double() - x0.double())) ** 2).flatten(1).mean(1)
    tiny = torch.tensor(TINY, dtype=lp.dtype)
    return -(torch.pow(-lp + TINY, power) - torch.pow(tiny, power)) * sigma.double() / power


def awm_loss(mb: AWMMicroBatch, cond: Cond, velocity_fn: VelocityFn, ref_v: Tensor | None, old_v: Tensor | None,
             p: dict[str, float], n_rows: int) -> tuple[Tensor, dict[str, Tensor]]:
    """This micro-batch's share of L (module docstring) and detached sums for the step's stats."""
    if (p["kl"] > 0 and ref_v is None) or (p["ema_kl"] > 0 and old_v is None):
        raise ValueError("AWM's KL terms need π_0's (kl > 0) and the EMA's (ema_kl > 0) velocities")
    m = mb.mask.double()
    v = velocity_fn(mb.xt, mb.sigma, cond).float()
    lw = weighted_log_prob(v, mb.eps, mb.x0, mb.sigma, p["ghuber_power"])         # [B]
    ratio = torch.exp(lw - lw.detach())
    adv = mb.adv.double()
    per_row = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1.0 - p["clip"], 1.0 + p["clip"]))
    policy_loss = (m * per_row).sum() / n_rows
    zeros = torch.zeros_like(lw)
    kl = ((v - ref_v.float()) ** 2).flatten(1).mean(1).double() if p["kl"] > 0 else zeros
    ema_kl = ((v - old_v.float()) ** 2).flatten(1).mean(1).double() if p["ema_kl"] > 0 else zeros
    kl_loss = p["kl"] * (m * kl).sum() / n_rows
    ema_loss = p["ema_kl"] * (m * ema_kl).sum() / n_rows
    loss = policy_loss + kl_loss + ema_loss
    with torch.no_grad():
        mse = ((v - (mb.eps - mb.x0)) ** 2).flatten(1).mean(1).double()
        sums = {"loss": loss.detach(), "loss/policy": policy_loss.detach(), "loss/kl": kl_loss.detach(),
                "loss/ema_kl": ema_loss.detach(), "awm/mse": (m * mse).sum() / n_rows,
                "awm/adv_abs": (m * adv.abs()).sum() / n_rows}
    return loss, sums


class AWM(Declared):
    keys = KEYS

    def rows(self, batch, version: int):
        return build_awm_rows(batch, self.cfg)

    def micro_batches(self, rows, size: int, rank: int, world_size: int):
        return awm_micro_batches(rows, size, rank, world_size)

    def micro_loss(self, trainer, rows, mb, cond_all, lam_kl: float):
        """v_π0 and v_old first, no grad; then the loss with grad."""
        policy, p = trainer.policy, self.p
        mb = mb.to(trainer.device)
        cond = cond_all.index(mb.cond_idx)
        ref_v = policy.anchor_velocity("pi0", mb.xt, mb.sigma, cond) if p["kl"] > 0 else None
        old_v = policy.anchor_velocity("old", mb.xt, mb.sigma, cond) if p["ema_kl"] > 0 else None
        return awm_loss(mb, cond, policy.velocity, ref_v, old_v, p, rows.n)

    def after_step(self, trainer, stats) -> None:
        p = self.p
        if "old" in trainer.policy.anchors:  # kept while ema_kl > 0
            trainer.policy.update_ema(min(p["ema_decay_max"], p["ema_decay_rate"] * trainer.version), "old")

    def measures_pi0(self, trainer, version: int) -> bool:
        return False  # its KL to π_0 is in the loss (loss/kl)
