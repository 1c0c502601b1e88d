"""Each baseline's advantages equal its own upstream's normalisation: the std kind (population or
unbiased) and the epsilon are declared (common/methods.py ADV_NORMS, named by a row's
grpo.adv_norm), and the rows of configs/compare_toy.yaml read them. The upstream formulas are
written out here from the cited code, on a fixed batch of two groups of G = 8 with three heads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from cluster.compare.matrix import load_matrix
from common.methods import ADV_NORMS, adv_norm_of
from common.sde import ODE, Schedule
from common.types import Condition, Group, Scores, TrainBatch, Trajectory
from learner.advantages import group_advantages
from learner.rows import batch_std, member_advantages

ROOT = Path(__file__).resolve().parents[1]
HEADS = ["VQ", "MQ", "TA"]                       # the toy reward's heads, weight 1 each (quickstart)
SCORES = [  # [G, H] per group: a fixed batch, spreads of different sizes per head
    [[0.61, 0.20, 0.90], [0.55, 0.31, 0.10], [0.70, 0.25, 0.50], [0.52, 0.40, 0.80],
     [0.66, 0.22, 0.30], [0.58, 0.35, 0.70], [0.63, 0.28, 0.20], [0.60, 0.30, 0.60]],
    [[0.40, 0.50, 0.35], [0.45, 0.52, 0.90], [0.38, 0.47, 0.15], [0.50, 0.55, 0.65],
     [0.42, 0.49, 0.40], [0.47, 0.58, 0.85], [0.36, 0.44, 0.05], [0.44, 0.51, 0.55]],
]


def _batch() -> TrainBatch:
    spec = ODE().spec(Schedule.linear(4, 3.0))
    groups = []
    for gi, s in enumerate(SCORES):
        cond = Condition(f"c{gi}", f"prompt {gi}")
        members = [Trajectory(condition=cond, group_id=f"g{gi}", member=i, seed=0, spec=spec, guidance_scale=1.0,
                              policy_version=0, step_indices=[], x=None, x_next=None, logp_old=None,
                              final_latents=torch.zeros(1)) for i in range(len(s))]
        values = torch.tensor(s, dtype=torch.float32)
        groups.append(Group(cond, f"g{gi}", 0, members, Scores(list(HEADS), values), values.sum(1)))
    return TrainBatch(groups)


def _vgrpo(row: str) -> torch.Tensor:
    """The advantages the row's learner computes for each fresh member, groups concatenated."""
    cfg = load_matrix(ROOT / "configs" / "compare_toy.yaml").config(row, 0)
    batch = _batch()
    std = batch_std(batch, cfg)
    return torch.cat([member_advantages(g, [], cfg, std)[0] for g in batch.fresh]).double()


# --- upstream, written out ----------------------------------------------------------------------

def dance_grpo(scores: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """DanceGRPO, fastvideo/train_grpo_hunyuan.py (XueZeyue/DanceGRPO @ 15cc71d, lines 370-395): per
    reward head and group, (r - r.mean()) / (r.std() + 1e-8) with torch's (unbiased) std, then the
    heads summed with their coefficients (vq_coef·A_vq + mq_coef·A_mq). MixGRPO's
    fastvideo/train_grpo_flux.py (Tencent-Hunyuan/MixGRPO @ e5cdd6a, lines 428-456,
    multi_reward_mix = advantage_aggr, trimmed_ratio 0) computes the same, weighted by reward_weights."""
    out = []
    for group in scores:
        adv = torch.zeros(group.shape[0], dtype=torch.float64)
        for h in range(group.shape[1]):
            r = torch.tensor(group[:, h], dtype=torch.float64)
            adv += weights[h] * (r - r.mean()) / (r.std() + 1e-8)
        out.append(adv)
    return torch.cat(out).numpy()


def flow_grpo(rewards: np.ndarray, global_std: bool) -> np.ndarray:
    """flow_grpo's PerPromptStatTracker.update (yifan123/flow_grpo @ ac4c86e,
    flow_grpo/stat_tracking.py lines 22-31, type 'grpo'): per prompt, mean = np.mean(its rewards),
    std = np.std(its rewards) + 1e-4, or with global_std np.std(every reward of the batch) + 1e-4;
    (r - mean) / std. DiffusionNFT (NVlabs/DiffusionNFT @ 24af555) and Flash-GRPO
    (Shredded-Pork/Flash-GRPO @ 4211013) train with their copies of it (flow_grpo/stat_tracking.py
    lines 22-31 and 22-33), with sample.global_std = True."""
    rewards = np.asarray(rewards, dtype=np.float64)          # [groups, G] of the composite
    out = []
    for group in rewards:
        std = (np.std(rewards) if global_std else np.std(group)) + 1e-4
        out.append((group - np.mean(group)) / std)
    return np.concatenate(out)


S = np.array(SCORES, dtype=np.float64)
W = np.ones(len(HEADS))
COMPOSITE = np.array(SCORES, dtype=np.float32).sum(2)       # the fp32 composite the rows are given


@pytest.mark.parametrize("row, want", [
    ("DanceGRPO", lambda: dance_grpo(S, W)),
    ("MixGRPO", lambda: dance_grpo(S, W)),
    ("MixGRPO-Flash", lambda: dance_grpo(S, W)),
    ("FlowGRPO", lambda: flow_grpo(COMPOSITE, global_std=False)),
    ("DiffusionNFT", lambda: flow_grpo(COMPOSITE, global_std=True)),
    ("Flash-GRPO", lambda: flow_grpo(COMPOSITE, global_std=True)),
])
def test_each_row_normalises_as_its_upstream(row, want):
    expect = torch.tensor(want())
    assert float(expect.abs().max()) < 5.0                  # inside adv_clip: the normalisation alone
    assert torch.allclose(_vgrpo(row), expect, rtol=1e-6, atol=1e-6), row


def test_the_declarations_are_the_std_kind_and_epsilon():
    assert (ADV_NORMS["dance_grpo"].ddof, ADV_NORMS["dance_grpo"].eps) == (1, 1e-8)
    assert (ADV_NORMS["flow_grpo"].ddof, ADV_NORMS["flow_grpo"].eps) == (0, 1e-4)
    assert (ADV_NORMS["population"].ddof, ADV_NORMS["population"].eps) == (0, 1e-8)  # vgrpo's own: unchanged
    m = load_matrix(ROOT / "configs" / "compare_toy.yaml")
    assert adv_norm_of(m.config("SAGE-GRPO", 0)) == ADV_NORMS["population"]
    # the unbiased std is √(G/(G−1)) the population one: at G = 8 the population-std advantages
    # are 1.069× DanceGRPO's
    r = torch.tensor(S[0, :, 0])
    mask = torch.ones(8, dtype=torch.bool)
    pop = group_advantages(r, mask, 5.0, norm=ADV_NORMS["population"])
    unb = group_advantages(r, mask, 5.0, norm=ADV_NORMS["dance_grpo"])
    assert torch.allclose(pop / unb, torch.full((8,), (8 / 7) ** 0.5, dtype=torch.float32), rtol=1e-5)
