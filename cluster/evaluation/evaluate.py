"""Evaluation on fixed (prompt, seed) pairs with the ODE sampler, and the paired before/after summary."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from rich.table import Table

from cluster.evaluation.eval_set import EvalSet
from common.types import Scores
from reward_worker.actor import RewardFailed, RewardTimeout


@dataclass
class EvalResult:
    """Per-pair scores of one evaluation: `values[i, h]` is head h of pair i; `composite[i]` is R."""

    heads: list[str]
    values: np.ndarray      # [N, H]
    composite: np.ndarray   # [N]

    def mean_se(self, key: str) -> tuple[float, float]:
        x = self.column(key)
        return float(x.mean()), float(x.std(ddof=1) / math.sqrt(len(x))) if len(x) > 1 else 0.0

    def column(self, key: str) -> np.ndarray:
        return self.composite if key == "composite" else self.values[:, self.heads.index(key)]

    def record(self) -> dict[str, list]:
        """Every pair's scores, as a comparison's run record keeps them (`from_record` reads it)."""
        return {"values": self.values.tolist(), "composite": self.composite.tolist()}

    @classmethod
    def from_record(cls, d: dict, heads: list[str]) -> EvalResult:
        return cls(list(heads), np.asarray(d["values"], dtype=np.float64).reshape(-1, len(heads)),
                   np.asarray(d["composite"], dtype=np.float64))

    def to_dict(self) -> dict[str, float]:
        out = {}
        for key in ["composite", *self.heads]:
            m, se = self.mean_se(key)
            out[f"{key}_mean"], out[f"{key}_se"] = m, se
        return out


def split_pairs(rollouts: list, evals: EvalSet):
    """Round-robin shares of the pairs, one per rollout actor that gets any: (actor, pair indices,
    prompts, seeds, first-frame paths or None). Each sample depends only on its own seed, so the
    split does not change the result."""
    n = len(rollouts)
    for i, actor in enumerate(rollouts):
        share = list(range(i, len(evals), n))
        if share:
            part = evals.subset(share)
            yield actor, share, part.prompts, list(part.seeds), part.images


def sample_pairs(rollouts: list, evals: EvalSet):
    """ODE videos of the evaluation pairs, split over the rollout actors (I2V: each actor reads
    the first-frame files itself). uint8 [N, F, H, W, 3]"""
    import ray  # heavy: ray

    calls = list(split_pairs(rollouts, evals))
    refs = [a.sample_videos.remote(prompts, seeds, "ode", imgs) for a, _, prompts, seeds, imgs in calls]
    frames = [None] * len(evals)
    for (_, share, *_), part in zip(calls, ray.get(refs), strict=True):
        for k, f in zip(share, part, strict=True):
            frames[k] = f
    return torch.stack(frames)


def score_pairs(rollouts: list, evals: EvalSet, keep: set[int] | frozenset[int] = frozenset(), weights=None):
    """Each rollout actor ODE-samples its share of the pairs and scores it with the reward pool
    itself (the data plane, as for training groups). Back come every pair's score row and the
    frames of the pairs in `keep` only: (Scores [N, H], {pair index: uint8 [F, H, W, 3]}).
    `weights` (a WeightsRecord): each actor samples with them for this evaluation alone, then
    holds its own version again (RolloutWorker.evaluating); None: with the weights it holds."""
    calls = list(split_pairs(rollouts, evals))
    refs = [a.evaluate_pairs.remote(prompts, seeds, imgs, [j for j, k in enumerate(share) if k in keep], weights)
            for a, share, prompts, seeds, imgs in calls]
    rows: list = [None] * len(evals)
    frames: dict[int, torch.Tensor] = {}
    heads = None
    for (_, share, *_), (scores, kept) in zip(calls, _get_scored(refs), strict=True):
        if heads is not None and scores.heads != heads:
            raise RuntimeError(f"rollout actors report different reward heads: {heads} vs {scores.heads}")
        heads = scores.heads
        for j, k in enumerate(share):
            rows[k] = scores.values[j]
        frames |= {share[j]: f for j, f in kept.items()}
    return Scores(heads, torch.stack(rows)), frames


def _get_scored(refs: list) -> list:
    """ray.get, with a reward model's failure raised as itself (naming the model), as when the
    caller scored the videos with its own RewardClient."""
    import ray  # heavy: ray

    try:
        return ray.get(refs)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, RewardFailed | RewardTimeout):
            raise e.cause from None
        raise


@dataclass
class PairedDiff:
    key: str
    before: float
    after: float
    diff: float
    se: float

    @property
    def z(self) -> float:
        return self.diff / self.se if self.se > 0 else (math.inf if self.diff > 0 else 0.0)


def paired(before: EvalResult, after: EvalResult) -> list[PairedDiff]:
    """Paired differences over the same (prompt, seed) pairs: mean and its standard error."""
    if before.values.shape != after.values.shape or before.heads != after.heads:
        raise ValueError("before/after evaluations must use the same pairs and heads")
    rows = []
    for key in ["composite", *before.heads]:
        d = after.column(key) - before.column(key)
        se = float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else 0.0
        rows.append(PairedDiff(key, float(before.column(key).mean()), float(after.column(key).mean()),
                               float(d.mean()), se))
    return rows


def summary_table(before: EvalResult, after: EvalResult, title: str):
    t = Table(title=title)
    for col in ("reward", "before", "after", "after − before", "z"):
        t.add_column(col, justify="right" if col != "reward" else "left")
    for row in paired(before, after):
        b_se = before.mean_se(row.key)[1]
        a_se = after.mean_se(row.key)[1]
        t.add_row(row.key, f"{row.before:.3f} ± {b_se:.3f}", f"{row.after:.3f} ± {a_se:.3f}",
                  f"{row.diff:+.3f} ± {row.se:.3f}", f"{row.z:.1f}")
    return t
