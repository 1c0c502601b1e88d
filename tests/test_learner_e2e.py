"""A tiny end-to-end learning run: sample → reward → train_step, with the default objective
(dual KL, equalizer, alignment), LoRA on a tiny Wan transformer. A fixed synthetic reward
(the mean of the first channel of the final latents) must rise over the untrained model on
the same evaluation seeds."""

from __future__ import annotations

import torch
from helpers_tiny import TinyVideoModel, sample_group

from common.config import RunConfig
from common.types import Condition, TrainBatch
from learner.trainer import Trainer

CONDS = [Condition(f"c{i}", f"prompt {i}") for i in range(4)]


def reward(group) -> torch.Tensor:
    final = torch.stack([t.final_latents for t in group.members])  # [G, C, F, H, W]
    return final[:, 0].mean(dim=(1, 2, 3))                          # [G]


def evaluate(model) -> float:
    rs = [reward(sample_group(model, c, group_size=4, seed=1000 + 10 * s + i, steps=3)).mean()
          for i, c in enumerate(CONDS) for s in range(2)]
    return float(torch.stack(rs).mean())


def test_training_raises_a_fixed_reward():
    model = TinyVideoModel(seed=0)
    cfg = RunConfig.model_validate({"optim": {"micro_batch": 16, "lr": 1e-2, "lora_rank": 8}})
    tr = Trainer(cfg, model).setup()
    before = evaluate(model)
    for i in range(100):
        g = sample_group(model, CONDS[i % 4], group_size=4, seed=i, steps=3, version=tr.version)
        g.composite = reward(g)
        st = tr.train_step(TrainBatch([g]))
        assert st["logratio_first_absmax"] < 1e-5
    after = evaluate(model)
    assert after > before + 0.5, (before, after)
