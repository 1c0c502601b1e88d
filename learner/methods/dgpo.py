"""DGPO (grpo.loss=dgpo, docs/algorithm.md section 6c): Direct Group Preference Optimization, a
group-level preference loss on the clean final latents of ODE rollouts (Luo-Yihong/DGPO,
scripts/train_sd3_dgpo.py).

Rows: per optimizer step, M = grpo.params.timesteps distinct indices j of the sampling schedule
drawn from 0 … trunc_steps (one draw for the whole step, as upstream draws once per epoch); for
each fresh group and each j, one noise ε shared by the group's members (its use_shared_noise):
x_t = (1 − σ_j)·x_0 + σ_j·ε, target u = ε − x_0. A unit is (group, j): its G rows, one per member.
Per row, with v_θ, v_old (the EMA reference, anchor `old`) and v_π0 at (x_t, σ_j):

    d     = mean((u − v_θ)²),  d_old = mean((u − v_old)²),  d_ref = mean((u − v_π0)²)
    ρ     = exp(d_old − d);    cut = ρ > 1 + c if A > 0 else ρ < 1 − c       its PPO-style clip
    d̃     = sg(d) where cut else d
    w_g   = σ( Σ_{i∈unit} A_i·β_dpo·(sg(d̃_i) − d_ref_i) / G )               the unit's group weight, no grad
    L     = mean_rows[ w_g·A·d̃ ] + β·mean_rows[ mean((v_θ − v_π0)²) ]

c = grpo.params.clip, β_dpo = grpo.params.beta_dpo, β = grpo.params.kl, A clamped to ±grpo.adv_clip.
The group weight needs every member of a unit in one micro-batch: this method's micro-batches hold
whole units (its declaration's micro_batch_rows), and the ranks split by units. After each
optimizer step t the reference follows θ: v_old ← d·v_old + (1 − d)·θ, d = min(ref_decay_max,
ref_decay_rate·(t − 1)) (its ema_ref, decay min(0.3, 0.001·global_step) before the increment).
Every mean over rows is a sum over the micro-batch divided by the batch-wide row count.
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
from learner.rows import batch_std, member_advantages

KEYS = ["loss", "loss/policy", "loss/kl", "dgpo/weight_mean", "dgpo/clipfrac", "dgpo/dsm", "dgpo/dsm_ref"]


@dataclass
class DGPORows:
    x0: Tensor           # [N, C, F, H, W] the member's clean final latents
    xt: Tensor           # [N, C, F, H, W] (1 - σ)·x0 + σ·ε, ε shared by the unit
    target: Tensor       # [N, C, F, H, W] ε - x0
    sigma: Tensor        # [N]
    adv: Tensor          # [N] A (clamped to ±grpo.adv_clip)
    cond_idx: Tensor     # [N] long, the fresh group's index
    cond: Cond | None
    unit: int            # rows per unit (the group size G); row r is in unit r // unit
    stats: dict[str, float]

    @property
    def n(self) -> int:
        return self.x0.shape[0]


@dataclass
class DGPOMicroBatch:
    xt: Tensor
    target: Tensor
    sigma: Tensor
    adv: Tensor
    mask: Tensor         # [B] 1 for real rows, 0 for a padding unit
    cond_idx: Tensor

    def to(self, device) -> DGPOMicroBatch:
        return DGPOMicroBatch(**{k: v.to(device) for k, v in self.__dict__.items()})


def draw_timesteps(n_steps: int, trunc_steps: int, m: int, gen: torch.Generator) -> list[int]:
    """M distinct schedule indices from 0 … min(trunc_steps, T - 1) (its random.sample)."""
    pool = min(trunc_steps, n_steps - 1) + 1
    return sorted(int(i) for i in torch.randperm(pool, generator=gen)[:min(m, pool)])


def build_dgpo_rows(batch: TrainBatch, cfg) -> DGPORows:
    if not batch.fresh:
        raise ValueError("empty TrainBatch: no fresh groups")
    p = method_params(cfg)
    sigmas = torch.tensor(batch.fresh[0].members[0].spec.sigmas, dtype=torch.float32)
    gen = torch.Generator().manual_seed(zlib.crc32(f"dgpo:{cfg.train.seed}:{batch.version}".encode()))
    js = draw_timesteps(len(sigmas) - 1, int(p["trunc_steps"]), int(p["timesteps"]), gen)
    std = batch_std(batch, cfg)
    G = batch.fresh[0].size
    x0s, sig, advs, cond_idx, eps, rewards, zero = [], [], [], [], [], [], []
    for gi, group in enumerate(batch.fresh):
        if group.size != G:
            raise ValueError(f"group {group.group_id} has {group.size} members, the batch's first {G}: "
                             "DGPO's group weight needs equal groups")
        adv, reward, mask = member_advantages(group, [], cfg, std)
        rewards.append(reward)
        zero.append(is_zero_std(reward, mask))
        x0 = torch.stack([t.final_latents.float() for t in group.members])            # [G, ...]
        for j in js:                                                                     # one unit per (group, j)
            e = torch.randn(x0.shape[1:], generator=gen)
            x0s.append(x0)
            eps.append(e.expand_as(x0))
            sig.append(sigmas[j].expand(G))
            advs.append(adv)
            cond_idx += [gi] * G
    x0, e, sigma = torch.cat(x0s), torch.cat(eps), torch.cat(sig)
    s = sigma.view(-1, *([1] * (x0.dim() - 1)))
    all_r = torch.cat(rewards)
    stats = {"reward_mean": float(all_r.mean()), "reward_std": float(all_r.std(unbiased=False)),
             "zero_std_frac": sum(zero) / len(zero), "num_rows": float(len(sigma))}
    conds = [g.members[0].cond for g in batch.fresh]
    return DGPORows(x0=x0, xt=(1 - s) * x0 + s * e, target=e - x0, sigma=sigma, adv=torch.cat(advs),
                    cond_idx=torch.tensor(cond_idx), cond=None if any(c is None for c in conds) else Cond.cat(conds),
                    unit=G, stats=stats)


def dgpo_micro_batches(rows: DGPORows, size: int, rank: int = 0, world_size: int = 1) -> Iterator[DGPOMicroBatch]:
    """This rank's micro-batches, each max(1, size // G) whole units; the ranks take every
    world_size-th unit, padded with masked units so every rank yields the same count and sizes."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    G = rows.unit
    units = torch.arange(rank, rows.n // G, world_size)
    length = -(-(rows.n // G) // world_size)
    real = torch.cat([torch.ones(len(units)), torch.zeros(length - len(units))])
    units = torch.cat([units, torch.full((length - len(units),), int(units[0]) if len(units) else 0,
                                         dtype=torch.long)])
    per = max(1, size // G)
    for start in range(0, length, per):
        u = units[start:start + per]
        i = (u.view(-1, 1) * G + torch.arange(G)).flatten()
        yield DGPOMicroBatch(xt=rows.xt[i], target=rows.target[i], sigma=rows.sigma[i], adv=rows.adv[i],
                             mask=real[start:start + per].repeat_interleave(G), cond_idx=rows.cond_idx[i])


def dgpo_loss(mb: DGPOMicroBatch, cond: Cond, velocity_fn: VelocityFn, old_v: Tensor, ref_v: Tensor, G: int,
              beta_dpo: float, clip: float, beta: float, n_rows: int) -> tuple[Tensor, dict[str, Tensor]]:
    """This micro-batch's share of L (module docstring), its rows whole units of G, and detached sums."""
    m = mb.mask
    v = velocity_fn(mb.xt, mb.sigma, cond).float()
    d = ((mb.target - v) ** 2).flatten(1).mean(1)                                     # [B]
    with torch.no_grad():
        d_old = ((mb.target - old_v.float()) ** 2).flatten(1).mean(1)
        d_ref = ((mb.target - ref_v.float()) ** 2).flatten(1).mean(1)
        ratio = torch.exp(-d + d_old)
        cut = torch.where(mb.adv > 0, ratio > 1.0 + clip, ratio < 1.0 - clip)
    d = torch.where(cut, d.detach(), d)
    with torch.no_grad():
        unit_sum = (mb.adv * beta_dpo * (d.detach() - d_ref) / G).view(-1, G).sum(1)  # [B / G]
        w = torch.sigmoid(unit_sum).repeat_interleave(G)                              # [B]
    policy_loss = (m * w * mb.adv * d).sum() / n_rows
    kl = ((v - ref_v.float()) ** 2).flatten(1).mean(1)
    kl_loss = beta * (m * kl).sum() / n_rows
    loss = policy_loss + kl_loss
    with torch.no_grad():
        sums = {"loss": loss.detach(), "loss/policy": policy_loss.detach(), "loss/kl": kl_loss.detach(),
                "dgpo/weight_mean": (m * w).sum() / n_rows, "dgpo/clipfrac": (m * cut.float()).sum() / n_rows,
                "dgpo/dsm": (m * d).sum() / n_rows, "dgpo/dsm_ref": (m * d_ref).sum() / n_rows}
    return loss, sums


class DGPO(Declared):
    keys = KEYS

    def rows(self, batch, version: int):
        return build_dgpo_rows(batch, self.cfg)

    def micro_batches(self, rows, size: int, rank: int, world_size: int):
        return dgpo_micro_batches(rows, size, rank, world_size)

    def micro_loss(self, trainer, rows, mb, cond_all, lam_kl: float):
        """v_old and v_π0 first, no grad; then the loss with grad."""
        policy, p = trainer.policy, self.p
        mb = mb.to(trainer.device)
        cond = cond_all.index(mb.cond_idx)
        old_v = policy.anchor_velocity("old", mb.xt, mb.sigma, cond)
        ref_v = policy.anchor_velocity("pi0", mb.xt, mb.sigma, cond)
        return dgpo_loss(mb, cond, policy.velocity, old_v, ref_v, rows.unit, p["beta_dpo"], p["clip"], p["kl"],
                         rows.n)

    def after_step(self, trainer, stats) -> None:
        p = self.p
        trainer.policy.update_ema(min(p["ref_decay_max"], p["ref_decay_rate"] * (trainer.version - 1)), "old")

    def measures_pi0(self, trainer, version: int) -> bool:
        return False  # its KL to π_0 is in the loss (loss/kl)
