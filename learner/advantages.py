"""Group-relative advantages (docs/algorithm.md section 4).

    A_i = (R_i - mean) / (std + eps), clipped to ±adv_clip

The statistics run over a "stats set" (the fresh group, or the group plus its bank entries;
with grpo.adv_std=batch the std is every fresh reward's of the step instead) and are applied to
every member that trains (fresh and bank). Which std (population or unbiased) and which eps is the
run's declared normalisation (grpo.adv_norm, common/methods.py ADV_NORMS: each upstream's own).
A group whose rewards are all equal gets A = 0 exactly, everywhere.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from common.methods import ADV_NORMS, AdvantageNorm

DEFAULT_NORM = ADV_NORMS["population"]
NO_SIGNAL_RTOL = 1e-6  # a spread below this (relative to the rewards' scale) is fp32 rounding, not signal
SPREAD_PREFIX = "spread/zero/"  # step-record keys: share of the step's groups with no spread, per head


def no_signal(ref: Tensor) -> Tensor:
    """Per column of the stats set [M] or [M, H]: True where its values carry no signal.

    Equal rewards that went through fp32 arithmetic can differ by an ulp; (R - mean) / (std + 1e-8)
    would blow those ulps up to |A| ≈ 1, all of one sign. So a spread within a relative 1e-6
    counts as none.
    """
    ref = ref.double()
    spread = ref.amax(0) - ref.amin(0)
    scale = ref.abs().amax(0).clamp_min(1.0)
    return spread <= NO_SIGNAL_RTOL * scale


def normalize(values: Tensor, stats_mask: Tensor, std: Tensor | None = None,
              norm: AdvantageNorm = DEFAULT_NORM) -> Tensor:
    """(values - mean) / (std + norm.eps), with mean and std over values[stats_mask]. [N] or [N, H]

    The std is the population (norm.ddof 0) or the unbiased one (1). `std` given
    (grpo.adv_std=batch): divide by it instead of the stats set's own (the mean stays the stats
    set's). Computed in float64 (then returned as fp32), and exactly 0 in every column whose stats
    set carries no signal.
    """
    ref = values[stats_mask].double()                           # [M] or [M, H]
    mean = ref.mean(0)
    std = ref.std(0, correction=norm.ddof) if std is None else std.double()
    adv = (values.double() - mean) / (std + norm.eps)
    return torch.where(no_signal(ref), torch.zeros_like(adv), adv).float()


def group_advantages(rewards: Tensor, stats_mask: Tensor, adv_clip: float,
                     head_scores: Tensor | None = None, head_weights: Tensor | None = None,
                     mode: Literal["composite", "per_head"] = "composite", std: Tensor | None = None,
                     norm: AdvantageNorm = DEFAULT_NORM) -> Tensor:
    """Advantages of one condition's members.

    rewards      [N] composite R_i of every member (fresh, then bank)
    stats_mask   [N] bool, which members the mean and std are taken over
    head_scores  [N, H] per-head S_h (per_head mode only)
    head_weights [H] w_h (per_head mode only)
    mode         `per_head` normalises each head, then sums with w_h (DanceGRPO)
    std          [] or [H] the divisor instead of the stats set's std (grpo.adv_std=batch)
    norm         the std's kind and eps (grpo.adv_norm)
    returns      [N] fp32, clipped to ±adv_clip
    """
    if mode == "per_head":
        if head_scores is None or head_weights is None:
            raise ValueError("per-head advantages need head scores and head weights "
                             "(grpo.per_head_advantages=true with a batch that has no scores)")
        adv = normalize(head_scores.float(), stats_mask, std, norm) @ head_weights.float()  # [N]
    else:
        adv = normalize(rewards.float(), stats_mask, std, norm)                       # [N]
    return adv.clamp(-adv_clip, adv_clip)


def is_zero_std(rewards: Tensor, stats_mask: Tensor) -> bool:
    """A group whose rewards carry no signal (every advantage is 0)."""
    return bool(no_signal(rewards[stats_mask]))


def group_spread(groups) -> dict[str, float]:
    """Share of the groups (fresh members only) whose rewards carry no signal (`no_signal`), for
    the composite and each head: `spread/zero/composite`, `spread/zero/<head>` (health's check)."""
    groups = list(groups)
    if not groups:
        return {}
    out = {f"{SPREAD_PREFIX}composite": sum(bool(no_signal(g.composite)) for g in groups) / len(groups)}
    scored = [g for g in groups if g.scores is not None]
    if scored:
        for h_i, head in enumerate(scored[0].scores.heads):
            out[f"{SPREAD_PREFIX}{head}"] = sum(bool(no_signal(g.scores.values[:, h_i])) for g in scored) / len(scored)
    return out
