"""A TrainBatch flattened into (sample, trained step) rows, and its micro-batches.

One row is one transition x^i_k → x^i_{k+1} of member i (fresh or bank), with its
advantage A_i, equalizer weight w_k, and the rows of its group's winner and loser at the same
step k (for J_align). Rows are built once per optimizer step on the CPU; micro-batches index
them and move to the device.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from common.config import RunConfig
from common.rewards import RewardHeads
from common.sde import Schedule, Scheme, equalizer_weights, make_scheme
from common.types import Condition, TrainBatch, Trajectory
from learner.advantages import group_advantages, is_zero_std


@dataclass
class Rows:
    x: Tensor            # [N, C, F, H, W] x^i_k
    x_next: Tensor       # [N, C, F, H, W] x^i_{k+1}
    logp_old: Tensor     # [N]
    mu_old: Tensor | None  # [N, C, F, H, W] the sampling policy's mean at x^i_k (when recorded)
    sigma: Tensor        # [N] σ_k
    sigma_next: Tensor   # [N] σ_{k+1}
    adv: Tensor          # [N] A_i
    weight: Tensor       # [N] w_k (1 with the equalizer off)
    cond_idx: Tensor     # [N] long, index into `conditions`
    targets: Tensor      # [M, C, F, H, W] every recorded x_{k+1} of the batch (J_align's x±_{k+1})
    pos_row: Tensor      # [N] long, the winner's x⁺_{k+1} at the row's step k in `targets` (-1: none)
    neg_row: Tensor      # [N] long, the loser's x⁻_{k+1} in `targets` (-1: none)
    a_pos: Tensor        # [N] A⁺ of the row's group
    a_neg: Tensor        # [N] A⁻
    conditions: list[Condition]
    scheme: Scheme
    stats: dict[str, float]
    policy_version: Tensor | None = None  # [N] long, the version that sampled each row
    on_policy: Tensor | None = None       # [N] bool, set by the learner: sampled by its current weights

    @property
    def n(self) -> int:
        return self.x.shape[0]

    @property
    def n_align(self) -> int:
        return int(((self.pos_row >= 0) & (self.neg_row >= 0)).sum())


@dataclass
class MicroBatch:
    x: Tensor            # [B, C, F, H, W]
    x_next: Tensor       # [B, C, F, H, W]
    x_pos: Tensor        # [B, C, F, H, W] winner's x⁺_{k+1} (x_next where none)
    x_neg: Tensor        # [B, C, F, H, W]
    logp_old: Tensor     # [B]
    sigma: Tensor        # [B]
    sigma_next: Tensor   # [B]
    adv: Tensor          # [B]
    weight: Tensor       # [B]
    a_pos: Tensor        # [B]
    a_neg: Tensor        # [B]
    align_mask: Tensor   # [B] 1 where both winner and loser recorded step k
    mask: Tensor         # [B] 1 for real rows, 0 for padding (keeps ranks in lockstep)
    cond_idx: Tensor     # [B] long
    mu_old: Tensor | None = None  # [B, C, F, H, W] fp32
    on_policy: Tensor | None = None  # [B] bool: sampled by the learner's current weights (health stats)

    def to(self, device) -> MicroBatch:
        return MicroBatch(**{k: None if v is None else v.to(device) for k, v in self.__dict__.items()})


def _scheme_of(trajs: list[Trajectory], cfg: RunConfig) -> Scheme:
    t0 = trajs[0]
    for t in trajs:
        if (t.scheme, t.eta, list(t.sigmas)) != (t0.scheme, t0.eta, list(t0.sigmas)):
            raise ValueError(f"trajectory {t.group_id}/{t.member} was sampled with {t.scheme} η={t.eta} "
                             f"on another schedule than {t0.group_id}/{t0.member}; one batch needs one "
                             f"scheme and schedule")
    return make_scheme(t0.scheme, t0.eta, Schedule.explicit(t0.sigmas), cfg.sde.flow_first_step,
                       cfg.sde.clamp_c, cfg.sde.cps_log_prob)


def build_rows(batch: TrainBatch, cfg: RunConfig) -> Rows:
    """Advantages (section 3), equalizer weights (section 4) and align targets (section 6) per row.

    A row is a (member, step) the member trains; `targets` holds every recorded next latent, so a
    winner's x⁺_{k+1} is found even at a step the winner itself does not train.
    """
    g_cfg = cfg.grpo
    need_mu = cfg.records_mu_old
    cols: dict[str, list] = {k: [] for k in ("x", "x_next", "logp_old", "mu_old", "k", "adv", "cond", "win", "lose",
                                             "version")}
    a_pos_rows, a_neg_rows = [], []
    targets: list[Tensor] = []
    target_at: dict[tuple[int, int], int] = {}   # (member, k) -> index into targets
    all_trajs: list[Trajectory] = []
    fresh_rewards, fresh_adv, zero_std = [], [], []
    for gi, group in enumerate(batch.fresh):
        # 1. the members: the fresh group, then the bank entries of the same condition
        if group.composite is None:
            raise ValueError(f"group {group.group_id} has no composite reward; score it before training")
        bank = batch.bank[gi] if gi < len(batch.bank) else []
        trajs = list(group.members) + [b[0] for b in bank]
        rewards = torch.cat([group.composite.float(),
                             torch.tensor([float(b[2]) for b in bank], dtype=torch.float32)])  # [N]
        fresh = torch.arange(len(trajs)) < group.size                                          # [N]
        stats_mask = fresh if g_cfg.adv_stats == "group" else torch.ones_like(fresh)
        # 2. advantages
        heads, weights = None, None
        if g_cfg.per_head_advantages:
            if group.scores is None:
                raise ValueError(f"group {group.group_id} has no per-head scores; "
                                 f"grpo.per_head_advantages needs them")
            heads = torch.cat([group.scores.values.float()] + [b[1].float().view(1, -1) for b in bank])
            weights = RewardHeads.of(cfg.rewards.models, group.scores.heads).vector()
        adv = group_advantages(rewards, stats_mask, g_cfg.adv_clip, heads, weights,
                               "per_head" if g_cfg.per_head_advantages else "composite")  # [N]
        fresh_rewards.append(group.composite.float())
        fresh_adv.append(adv[fresh])
        zero_std.append(is_zero_std(rewards, stats_mask))
        # 3. winner and loser over fresh + bank
        win, lose = int(rewards.argmax()), int(rewards.argmin())
        base = len(all_trajs)
        for mi, t in enumerate(trajs):
            if need_mu and t.mu_old is None:
                raise ValueError(f"trajectory {t.group_id}/{t.member} has no recorded μ_old, which "
                                 f"kl.d_step=exact and align.form=clipped need; it was sampled with "
                                 f"another config")
            for j, k in enumerate(t.step_indices):
                target_at[(base + mi, int(k))] = len(targets)
                targets.append(t.x_next[j])
                if not t.trains(k):
                    continue
                cols["x"].append(t.x[j])
                cols["x_next"].append(t.x_next[j])
                cols["logp_old"].append(t.logp_old[j].float())
                if need_mu:
                    cols["mu_old"].append(t.mu_old[j].float())
                cols["k"].append(int(k))
                cols["version"].append(int(t.policy_version))
                cols["adv"].append(adv[mi])
                cols["cond"].append(gi)
                cols["win"].append(base + win)
                cols["lose"].append(base + lose)
                a_pos_rows.append(adv[win])
                a_neg_rows.append(adv[lose])
        all_trajs.extend(trajs)
    if not all_trajs:
        raise ValueError("empty TrainBatch: no fresh groups")
    if not cols["x"]:
        raise ValueError("the TrainBatch has no trained steps (check sampler.train_steps)")
    scheme = _scheme_of(all_trajs, cfg)
    sigmas = all_trajs[0].sigmas

    # 4. the winner's and loser's next latent at each row's step k
    pos_row = [target_at.get((w, k), -1) for w, k in zip(cols["win"], cols["k"], strict=True)]
    neg_row = [target_at.get((lo, k), -1) for lo, k in zip(cols["lose"], cols["k"], strict=True)]

    ks = torch.tensor(cols["k"])
    if g_cfg.equalizer:
        w_k = equalizer_weights(scheme, Schedule.explicit(sigmas))  # [T] over the whole schedule
        weight = w_k[ks]
    else:
        weight = torch.ones(len(ks))
    sig = torch.tensor(sigmas, dtype=torch.float32)
    b_rewards, b_adv = torch.cat(fresh_rewards), torch.cat(fresh_adv)
    found = sum(1 for p, q in zip(pos_row, neg_row, strict=True) if p >= 0 and q >= 0)
    stats = {
        "reward_mean": float(b_rewards.mean()),
        "reward_std": float(b_rewards.std(unbiased=False)),
        "adv_std": float(b_adv.std(unbiased=False)),
        "zero_std_frac": sum(zero_std) / len(zero_std),
        "num_rows": float(len(ks)),
    }
    if cfg.align.enabled:
        stats["align/rows_wanted"] = float(len(ks))
        stats["align/rows_used"] = float(found)
    return Rows(
        x=torch.stack(cols["x"]), x_next=torch.stack(cols["x_next"]),
        logp_old=torch.stack(cols["logp_old"]),
        mu_old=torch.stack(cols["mu_old"]) if need_mu else None,
        sigma=sig[ks], sigma_next=sig[ks + 1],
        adv=torch.stack(cols["adv"]).float(), weight=weight.float(), cond_idx=torch.tensor(cols["cond"]),
        targets=torch.stack(targets), pos_row=torch.tensor(pos_row), neg_row=torch.tensor(neg_row),
        a_pos=torch.stack(a_pos_rows).float(), a_neg=torch.stack(a_neg_rows).float(),
        conditions=[g.condition for g in batch.fresh], scheme=scheme, stats=stats,
        policy_version=torch.tensor(cols["version"], dtype=torch.long),
    )


def rank_rows(n: int, rank: int, world_size: int) -> tuple[Tensor, Tensor]:
    """Rank `rank`'s rows (every world_size-th) padded to ceil(n / world_size): (index [L], mask [L])."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    idx = torch.arange(rank, n, world_size)
    length = -(-n // world_size)
    pad = length - len(idx)
    mask = torch.cat([torch.ones(len(idx)), torch.zeros(pad)])
    idx = torch.cat([idx, torch.full((pad,), idx[0].item() if len(idx) else 0, dtype=torch.long)])
    return idx, mask


def micro_batches(rows: Rows, size: int, rank: int = 0, world_size: int = 1) -> Iterator[MicroBatch]:
    """This rank's micro-batches of at most `size` rows; every rank yields the same count and sizes."""
    idx, mask = rank_rows(rows.n, rank, world_size)
    ok_align = (rows.pos_row >= 0) & (rows.neg_row >= 0)
    for start in range(0, len(idx), size):
        i, m = idx[start:start + size], mask[start:start + size]
        own = rows.x_next[i]                                     # stands in where no target exists
        pos = torch.where(_bcast(rows.pos_row[i] >= 0, own), rows.targets[rows.pos_row[i].clamp_min(0)], own)
        neg = torch.where(_bcast(rows.neg_row[i] >= 0, own), rows.targets[rows.neg_row[i].clamp_min(0)], own)
        yield MicroBatch(
            x=rows.x[i], x_next=own, x_pos=pos, x_neg=neg,
            logp_old=rows.logp_old[i], sigma=rows.sigma[i], sigma_next=rows.sigma_next[i],
            adv=rows.adv[i], weight=rows.weight[i], a_pos=rows.a_pos[i], a_neg=rows.a_neg[i],
            align_mask=ok_align[i].float(), mask=m, cond_idx=rows.cond_idx[i],
            mu_old=None if rows.mu_old is None else rows.mu_old[i],
            on_policy=None if rows.on_policy is None else rows.on_policy[i],
        )


def _bcast(flag: Tensor, like: Tensor) -> Tensor:
    return flag.view(-1, *([1] * (like.dim() - 1)))
