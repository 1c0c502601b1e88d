"""A TrainBatch flattened into (sample, trained step) rows, and its micro-batches.

One row is one transition x^i_k → x^i_{k+1} of member i (fresh or bank), with its
advantage A_i, equalizer weight w_k, and the rows of its group's winner and loser at the same
step k (for J_align): a member stores only the steps it trains, so the winner's x⁺_{k+1} is the
winner's own row at step k, where it trained k, and there is none otherwise. Rows are built once
per optimizer step on the CPU; micro-batches index them and move to the device. The conditions
are the encoded ones that came with the trajectories (`Trajectory.cond`), each distinct one once.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from common.config import RunConfig
from common.methods import adv_norm_of
from common.rewards import RewardHeads
from common.sde import Schedule, Scheme, SchemeSpec, equalizer_weights, grad_scale, scheme_from_spec
from common.types import Cond, Group, TrainBatch, Trajectory
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
    cond_idx: Tensor     # [N] long, the row of `cond` the row is conditioned on
    pos_row: Tensor      # [N] long, the winner's row at the row's step k (its x⁺_{k+1}; -1: none)
    neg_row: Tensor      # [N] long, the loser's row at step k (its x⁻_{k+1}; -1: none)
    a_pos: Tensor        # [N] A⁺ of the row's group
    a_neg: Tensor        # [N] A⁻
    cond: Cond | None    # [D, ...] the batch's D distinct encoded conditions (None: the
                         # trajectories carry none; cond_idx is then the fresh group's index)
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


def _scheme_of(trajs: list[Trajectory]) -> tuple[Scheme, SchemeSpec]:
    """The one scheme the batch was sampled with, from the trajectories' spec alone (never the
    learner's config: a trajectory replays with exactly what sampled it)."""
    t0 = trajs[0]
    for t in trajs:
        if t.spec != t0.spec:
            raise ValueError(f"trajectory {t.group_id}/{t.member} was sampled with {t.spec.describe()}, "
                             f"{t0.group_id}/{t0.member} with {t0.spec.describe()}; one batch needs one "
                             f"scheme and schedule")
    return scheme_from_spec(t0.spec), t0.spec


def member_advantages(group: Group, bank: list[tuple[Trajectory, Tensor, float]], cfg: RunConfig,
                      std: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """A_i of the group's fresh members, then its bank entries (section 4). `std`: the divisor
    instead of the stats set's own (grpo.adv_std=batch, `batch_std`). Returns (adv [N],
    rewards [N], the mask of the members the group statistics are taken over [N])."""
    g_cfg = cfg.grpo
    rewards = torch.cat([_composite(group).float(),
                         torch.tensor([float(b[2]) for b in bank], dtype=torch.float32)])  # [N]
    fresh = torch.arange(len(rewards)) < group.size                                       # [N]
    stats_mask = fresh if g_cfg.adv_stats == "group" else torch.ones_like(fresh)
    heads, weights = None, None
    if g_cfg.per_head_advantages:
        _require_scores([group])
        heads = torch.cat([group.scores.values.float()] + [b[1].float().view(1, -1) for b in bank])
        weights = RewardHeads.of(cfg.rewards.models, group.scores.heads).vector()
    adv = group_advantages(rewards, stats_mask, g_cfg.adv_clip, heads, weights,
                           "per_head" if g_cfg.per_head_advantages else "composite", std, adv_norm_of(cfg))  # [N]
    return adv, rewards, stats_mask


def batch_std(batch: TrainBatch, cfg: RunConfig) -> Tensor | None:
    """With grpo.adv_std=batch, the std (grpo.adv_norm's kind) of every fresh reward of the step (per
    head in per-head mode): the divisor each group's advantages then share (section 4). None otherwise."""
    if cfg.grpo.adv_std != "batch":
        return None
    ddof = adv_norm_of(cfg).ddof
    if cfg.grpo.per_head_advantages:
        _require_scores(batch.fresh)
        return torch.cat([g.scores.values.double() for g in batch.fresh]).std(0, correction=ddof)
    return torch.cat([_composite(g).double() for g in batch.fresh]).std(correction=ddof)


def step_weights(scheme: Scheme, schedule: Schedule, ks: Tensor, g_cfg) -> Tensor:
    """Each row's step weight (section 5): the equalizer's w_k = median(N)/N_k over the schedule,
    Flash-GRPO's rectified w = (1/N_k) / mean over the rows of 1/N_k, or 1."""
    if g_cfg.equalizer:
        return equalizer_weights(scheme, schedule)[ks]  # [T] over the whole schedule
    if g_cfg.rectify:
        inv = torch.stack([1.0 / grad_scale(scheme, *schedule.pair(k)).reshape(()).double() for k in range(schedule.steps)])
        c = inv[ks]
        return (c / c.mean()).float()
    return torch.ones(len(ks))


def _composite(group: Group) -> Tensor:
    if group.composite is None:
        raise ValueError(f"group {group.group_id} has no composite reward; score it before training")
    return group.composite


def _require_scores(groups: list[Group]) -> None:
    for g in groups:
        if g.scores is None:
            raise ValueError(f"group {g.group_id} has no per-head scores; grpo.per_head_advantages needs them")


@dataclass
class _Columns:
    """The rows' columns, group by group, and where each (trajectory, step) row is."""

    x: list[Tensor] = field(default_factory=list)
    x_next: list[Tensor] = field(default_factory=list)
    logp_old: list[Tensor] = field(default_factory=list)
    mu_old: list[Tensor] = field(default_factory=list)
    k: list[int] = field(default_factory=list)
    version: list[int] = field(default_factory=list)
    adv: list[Tensor] = field(default_factory=list)
    cond: list[int] = field(default_factory=list)
    win: list[int] = field(default_factory=list)       # the winner's index among all trajectories
    lose: list[int] = field(default_factory=list)
    a_pos: list[Tensor] = field(default_factory=list)
    a_neg: list[Tensor] = field(default_factory=list)
    row_at: dict[tuple[int, int], int] = field(default_factory=dict)  # (trajectory, k) -> row
    conds: list[Cond | None] = field(default_factory=list)          # the distinct conditions, in order
    cond_at: dict[object, int] = field(default_factory=dict)        # a condition's key -> its index
    n_trajs: int = 0

    def add_group(self, gi: int, trajs: list[Trajectory], adv: Tensor, rewards: Tensor, need_mu: bool) -> None:
        """A row per (member, step) the member stored, which is one it trains. The winner and
        loser are taken over fresh + bank members."""
        win, lose, base = int(rewards.argmax()), int(rewards.argmin()), self.n_trajs
        for mi, t in enumerate(trajs):
            if need_mu and t.mu_old is None:
                raise ValueError(f"trajectory {t.group_id}/{t.member} has no recorded μ_old, which "
                                 f"kl.d_step=exact and align.form=clipped need; it was sampled with "
                                 f"another config")
            ci = self.cond_index(t, gi)
            for j, k in enumerate(t.step_indices):
                self.row_at[(base + mi, int(k))] = len(self.x)
                self.x.append(t.x[j])
                self.x_next.append(t.x_next[j])
                self.logp_old.append(t.logp_old[j].float())
                if need_mu:
                    self.mu_old.append(t.mu_old[j].float())
                self.k.append(int(k))
                self.version.append(int(t.policy_version))
                self.adv.append(adv[mi])
                self.cond.append(ci)
                self.win.append(base + win)
                self.lose.append(base + lose)
                self.a_pos.append(adv[win])
                self.a_neg.append(adv[lose])
        self.n_trajs += len(trajs)

    def cond_index(self, t: Trajectory, gi: int) -> int:
        """The index of t's encoded condition among the batch's distinct ones: one per object
        (a group's members and a condition's bank entries share one), or per fresh group when
        the trajectories carry none."""
        key = ("group", gi) if t.cond is None else id(t.cond)
        if key not in self.cond_at:
            self.cond_at[key] = len(self.conds)
            self.conds.append(t.cond)
        return self.cond_at[key]

    def stacked_cond(self) -> Cond | None:
        """The distinct conditions' rows in one Cond [D, ...], or None when no trajectory has one."""
        got = self.conds
        if all(c is None for c in got):
            return None
        if any(c is None for c in got):
            raise ValueError("a batch mixes trajectories with and without their encoded condition "
                             "(Trajectory.cond); every one must carry it")
        return Cond.cat(got)

    def align_rows(self) -> tuple[Tensor, Tensor]:
        """Each row's winner's and loser's row at the row's step k (-1: that member did not train k)."""
        pos = [self.row_at.get((w, k), -1) for w, k in zip(self.win, self.k, strict=True)]
        neg = [self.row_at.get((lo, k), -1) for lo, k in zip(self.lose, self.k, strict=True)]
        return torch.tensor(pos), torch.tensor(neg)


def build_rows(batch: TrainBatch, cfg: RunConfig) -> Rows:
    """Advantages (section 4), step weights (section 5) and align targets (section 7) per row.

    A row is a (member, step) the member trains (each member stores only those); the winner's
    x⁺_{k+1} at a row's step k is the winner's own row at k, found only where it trained k.
    """
    need_mu = cfg.records_mu_old
    cols, all_trajs = _Columns(), []
    fresh_rewards, fresh_adv, zero_std = [], [], []
    std = batch_std(batch, cfg)
    for gi, group in enumerate(batch.fresh):
        bank = batch.bank[gi] if gi < len(batch.bank) else []
        trajs = list(group.members) + [b[0] for b in bank]
        adv, rewards, stats_mask = member_advantages(group, bank, cfg, std)
        fresh_rewards.append(group.composite.float())
        fresh_adv.append(adv[:group.size])
        zero_std.append(is_zero_std(rewards, stats_mask))
        cols.add_group(gi, trajs, adv, rewards, need_mu)
        all_trajs.extend(trajs)
    if not all_trajs:
        raise ValueError("empty TrainBatch: no fresh groups")
    if not cols.x:
        raise ValueError("the TrainBatch has no trained steps (check sampler.train_steps)")
    scheme, spec = _scheme_of(all_trajs)
    ks = torch.tensor(cols.k)
    pos_row, neg_row = cols.align_rows()
    weight = step_weights(scheme, spec.schedule(), ks, cfg.grpo)
    sig = torch.tensor(spec.sigmas, dtype=torch.float32)
    found = int(((pos_row >= 0) & (neg_row >= 0)).sum())
    return Rows(
        x=torch.stack(cols.x), x_next=torch.stack(cols.x_next), logp_old=torch.stack(cols.logp_old),
        mu_old=torch.stack(cols.mu_old) if need_mu else None,
        sigma=sig[ks], sigma_next=sig[ks + 1],
        adv=torch.stack(cols.adv).float(), weight=weight.float(), cond_idx=torch.tensor(cols.cond),
        pos_row=pos_row, neg_row=neg_row,
        a_pos=torch.stack(cols.a_pos).float(), a_neg=torch.stack(cols.a_neg).float(),
        cond=cols.stacked_cond(), scheme=scheme,
        stats=_batch_stats(cfg, torch.cat(fresh_rewards), torch.cat(fresh_adv), zero_std, len(ks), found),
        policy_version=torch.tensor(cols.version, dtype=torch.long),
    )


def _batch_stats(cfg: RunConfig, rewards: Tensor, adv: Tensor, zero_std: list[bool], rows: int,
                 found: int) -> dict[str, float]:
    """The fresh members' reward and advantage spread, and how many rows found J_align's targets."""
    stats = {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std(unbiased=False)),
        "adv_std": float(adv.std(unbiased=False)),
        "zero_std_frac": sum(zero_std) / len(zero_std),
        "num_rows": float(rows),
    }
    if cfg.align.enabled:
        stats["align/rows_wanted"] = float(rows)
        stats["align/rows_used"] = float(found)
    return stats


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
        pos = torch.where(_bcast(rows.pos_row[i] >= 0, own), rows.x_next[rows.pos_row[i].clamp_min(0)], own)
        neg = torch.where(_bcast(rows.neg_row[i] >= 0, own), rows.x_next[rows.neg_row[i].clamp_min(0)], own)
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
