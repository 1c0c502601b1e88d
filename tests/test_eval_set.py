"""The one set of evaluation pairs (cluster/evaluation/eval_set.EvalSet): prompt-major with the
seeds inner, as the before/after evaluation has always sampled them (so `make run` is unchanged),
every I2V pair with its first frame, and the subsets its callers take."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.data.prompts import load_prompts
from cluster.evaluation.eval_set import EvalSet
from common.config import ConfigError, load_config
from common.toyworld import EVAL_SEED_BASE


def test_quickstart_pairs_are_prompt_major_text_only():
    cfg = load_config("configs/quickstart.yaml")
    evals = EvalSet.load(cfg.train.eval_prompts, cfg.train.eval_seeds, cfg.model)
    prompts = [c.prompt for c in load_prompts(cfg.train.eval_prompts)]
    seeds = [EVAL_SEED_BASE + i for i in range(cfg.train.eval_seeds)]  # the fixed evaluation seeds
    assert evals.pairs == [(p, s) for p in prompts for s in seeds]
    assert evals.images is None and evals.per_prompt == len(seeds) and len(evals) == len(prompts) * len(seeds)
    assert [c.prompt for c in evals.prompt_conditions] == prompts
    assert evals.firsts(2) == [0, len(seeds)]  # the GIFs: the first seed of the first two prompts
    # the tracker's step video: the first seed of every prompt first, as its own list was built
    n = len(prompts) + 1
    assert evals.subset(evals.grid(n)).pairs == [(p, s) for s in seeds for p in prompts][:n]


def test_toy_i2v_pairs_carry_their_first_frames():
    cfg = load_config("configs/toy_i2v.yaml")
    evals = EvalSet.load(cfg.train.eval_prompts, 2, cfg.model)
    conds = load_prompts(cfg.train.eval_prompts)
    assert evals.images == [c.image_path for c in conds for _ in range(2)]
    assert all(Path(p).is_file() for p in evals.images)
    part = evals.subset(evals.grid(3))
    assert part.images == [conds[0].image_path, conds[1].image_path, conds[2].image_path]
    assert [c.name for c in part.conditions] == [c.name for c in conds[:3]]


def test_a_prompt_set_that_does_not_fit_the_task_is_refused():
    i2v = load_config("configs/toy_i2v.yaml").model
    with pytest.raises(ConfigError, match="needs a first frame per prompt"):
        EvalSet.load("toy-eval", 2, i2v)
    with pytest.raises(ValueError, match="do not make pairs"):
        EvalSet(EvalSet.of_pairs([("a red square moving up", 1)]).conditions, (1, 2))
