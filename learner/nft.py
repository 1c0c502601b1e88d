"""DiffusionNFT (docs/algorithm.md section 6b): a flow-matching loss on the clean final latents of
ODE rollouts, contrasting an implicit positive and negative policy, weighted by the normalised
reward. No log-probs, no SDE; the rollouts are sampled by v_old, a slowly following copy of θ.

Rows are (member i, timestep j) pairs: x_0 = the member's final latents, σ_j one of the
sampling schedule's σ_0 … σ_{T-1} (int(T·nft.timestep_fraction) distinct ones per member, drawn
at random), x_t = (1 - σ_j)·x_0 + σ_j·ε with fresh noise ε. Per row

    r    = clip((A / c) / 2 + 1/2, 0, 1)                 normalised reward, c = grpo.adv_clip
    v⁺   = β·v_θ + (1 - β)·v_old                         implicit positive policy
    v⁻   = (1 + β)·v_old - β·v_θ                         implicit negative policy
    x̂⁺_0 = x_t - σ·v⁺,  x̂⁻_0 = x_t - σ·v⁻
    L±   = mean((x̂±_0 - x_0)²) / sg(max(mean|x̂±_0 - x_0|, 1e-5))      adaptive weighting
    L    = c·mean_rows[(r·L⁺ + (1 - r)·L⁻) / β] + λ·mean_rows[mean((v_θ - v_π0)²)]   λ = nft.kl

Every mean over rows is a sum over the micro-batch divided by the batch-wide row count, so
micro-batch losses (and ranks' gradients) sum to the full-batch loss, as in learner/losses.py.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from common.config import NFTConfig, RunConfig
from common.types import Cond, TrainBatch
from learner.advantages import is_zero_std
from learner.losses import VelocityFn
from learner.rows import batch_std, member_advantages, rank_rows

NFT_KEYS = ["loss", "loss/policy", "loss/kl", "nft/old_deviate", "nft/kl_div", "nft/r_mean"]
WEIGHT_FLOOR = 1e-5  # its clip(min=0.00001) on the adaptive weight


@dataclass
class NFTRows:
    x0: Tensor           # [N, C, F, H, W] the member's clean final latents
    xt: Tensor           # [N, C, F, H, W] (1 - σ)·x0 + σ·ε
    sigma: Tensor        # [N] σ of the row
    r: Tensor            # [N] normalised reward in [0, 1]
    cond_idx: Tensor     # [N] long, the row of `cond` (the fresh group's index)
    cond: Cond | None    # [G, ...] each fresh group's encoded condition, as the rollout encoded it
    stats: dict[str, float]

    @property
    def n(self) -> int:
        return self.x0.shape[0]


@dataclass
class NFTMicroBatch:
    x0: Tensor
    xt: Tensor
    sigma: Tensor
    r: Tensor
    mask: Tensor         # [B] 1 for real rows, 0 for padding
    cond_idx: Tensor

    def to(self, device) -> NFTMicroBatch:
        return NFTMicroBatch(**{k: v.to(device) for k, v in self.__dict__.items()})


def normalised_reward(adv: Tensor, adv_clip: float) -> Tensor:
    """r = clip((clip(A, ±c) / c) / 2 + 1/2, 0, 1): the optimality probability the loss weighs by."""
    return ((adv.clamp(-adv_clip, adv_clip) / adv_clip) / 2.0 + 0.5).clamp(0.0, 1.0)


def build_nft_rows(batch: TrainBatch, cfg: RunConfig) -> NFTRows:
    """Rows of the fresh groups: advantages as section 4 (grpo.adv_std=batch: its global std),
    int(T·timestep_fraction) distinct schedule σ per member and fresh noise, seeded by the run's
    seed and the batch's version so a step replays."""
    if not batch.fresh:
        raise ValueError("empty TrainBatch: no fresh groups")
    sigmas = torch.tensor(batch.fresh[0].members[0].spec.sigmas[:-1], dtype=torch.float32)  # the sampler's
    n_t = max(1, int(len(sigmas) * cfg.nft.timestep_fraction))
    gen = torch.Generator().manual_seed(zlib.crc32(f"nft:{cfg.train.seed}:{batch.version}".encode()))
    std = batch_std(batch, cfg)
    x0s, sig, rs, cond_idx, rewards, zero = [], [], [], [], [], []
    for gi, group in enumerate(batch.fresh):
        adv, reward, mask = member_advantages(group, [], cfg, std)
        r = normalised_reward(adv, cfg.grpo.adv_clip)
        rewards.append(reward)
        zero.append(is_zero_std(reward, mask))
        for mi, t in enumerate(group.members):
            picks = torch.randperm(len(sigmas), generator=gen)[:n_t]
            x0s += [t.final_latents.float()] * n_t
            sig.append(sigmas[picks])
            rs.append(r[mi].expand(n_t))
            cond_idx += [gi] * n_t
    x0, sigma = torch.stack(x0s), torch.cat(sig)
    eps = torch.randn(x0.shape, generator=gen)
    s = sigma.view(-1, *([1] * (x0.dim() - 1)))
    all_r = torch.cat(rewards)
    stats = {"reward_mean": float(all_r.mean()), "reward_std": float(all_r.std(unbiased=False)),
             "zero_std_frac": sum(zero) / len(zero), "num_rows": float(len(sigma))}
    return NFTRows(x0=x0, xt=(1 - s) * x0 + s * eps, sigma=sigma, r=torch.cat(rs), cond_idx=torch.tensor(cond_idx),
                   cond=_group_conds(batch), stats=stats)


def _group_conds(batch: TrainBatch) -> Cond | None:
    """One encoded condition per fresh group (its members share it), or None when none carries one."""
    got = [g.members[0].cond for g in batch.fresh]
    if all(c is None for c in got):
        return None
    if any(c is None for c in got):
        raise ValueError("a batch mixes groups with and without their encoded condition (Trajectory.cond)")
    return Cond.cat(got)


def nft_micro_batches(rows: NFTRows, size: int, rank: int = 0, world_size: int = 1) -> Iterator[NFTMicroBatch]:
    """This rank's micro-batches of at most `size` rows; every rank yields the same count and sizes."""
    idx, mask = rank_rows(rows.n, rank, world_size)
    for start in range(0, len(idx), size):
        i = idx[start:start + size]
        yield NFTMicroBatch(x0=rows.x0[i], xt=rows.xt[i], sigma=rows.sigma[i], r=rows.r[i],
                            mask=mask[start:start + size], cond_idx=rows.cond_idx[i])


def nft_loss(mb: NFTMicroBatch, cond: Cond, velocity_fn: VelocityFn, old_v: Tensor, nc: NFTConfig,
             adv_clip: float, n_rows: int, ref_v: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """This micro-batch's share of L (module docstring) and detached sums for the step's stats.

    old_v: v_old at (x_t, σ), no grad; ref_v: v_π0 there, no grad (needed when nft.kl > 0).
    """
    if nc.kl > 0 and ref_v is None:
        raise ValueError("nft.kl > 0 needs π_0's velocity (ref_v)")
    m = mb.mask
    v = velocity_fn(mb.xt, mb.sigma, cond).float()                          # [B, C, F, H, W]
    old = old_v.float().detach()
    s = mb.sigma.view(-1, *([1] * (v.dim() - 1)))
    pos = contrast_term(mb.xt - s * (nc.beta * v + (1 - nc.beta) * old), mb.x0)        # [B] L⁺
    neg = contrast_term(mb.xt - s * ((1 + nc.beta) * old - nc.beta * v), mb.x0)        # [B] L⁻
    per_row = (mb.r * pos + (1.0 - mb.r) * neg) / nc.beta
    policy_loss = adv_clip * (m * per_row).sum() / n_rows
    kl = torch.zeros_like(per_row)
    if nc.kl > 0:
        kl = ((v - ref_v.float()) ** 2).flatten(1).mean(1)                 # [B]
    kl_loss = nc.kl * (m * kl).sum() / n_rows
    loss = policy_loss + kl_loss
    with torch.no_grad():
        sums = {"loss": loss.detach(), "loss/policy": policy_loss.detach(), "loss/kl": kl_loss.detach(),
                "nft/old_deviate": (m * ((v - old) ** 2).flatten(1).mean(1)).sum() / n_rows,
                "nft/kl_div": (m * kl).sum() / n_rows, "nft/r_mean": (m * mb.r).sum() / n_rows}
    return loss, sums


def contrast_term(x0_pred: Tensor, x0: Tensor) -> Tensor:
    """mean((x̂_0 - x_0)²) / sg(max(mean|x̂_0 - x_0|, 1e-5)) per row [B]: its adaptive weighting,
    the weight taken in float64 and without gradient."""
    with torch.no_grad():
        w = (x0_pred.double() - x0.double()).abs().flatten(1).mean(1).clamp_min(WEIGHT_FLOOR)  # [B]
    return ((x0_pred - x0) ** 2).flatten(1).mean(1) / w.to(x0_pred.dtype)
