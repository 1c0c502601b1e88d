"""optim.ema_decay on real Ray: a finished run evaluates and exports the weights' moving average.

The learner keeps the average (its math is checked against torch's AveragedModel in
test_learner_trainer.py). Here, the driver's final evaluation must sample that average and not the
live weights: its scores are recomputed in this process from the learner's two payloads, each loaded
into a fresh toy model and ODE-sampled by the sampler's own function. The checkpoint's
policy/ (what `vgrpo eval` loads) is the average too.
"""

from __future__ import annotations

import numpy as np
import torch
from helpers_eval import local_eval

from cluster.runs.policy_file import read_policy
from common.config import load_config

STEPS = 3


def _cfg(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red square moving left\na blue square moving up\n")
    return load_config("configs/quickstart.yaml", [
        f"train.prompts={prompts}", f"train.steps={STEPS}", "train.groups_per_step=2", "train.eval_seeds=2",
        "sampler.group_size=4", "schedule.steps=4", "bank.capacity=4", "optim.micro_batch=8",
        "optim.lr=0.01", "optim.ema_decay=0.9", f"run.root={tmp_path}", "run.name=ema"])


def test_a_run_with_ema_evaluates_and_exports_the_moving_average(ray_session, tmp_path):
    import ray

    from cluster.data.prompts import load_prompts
    from cluster.driver.driver import Driver
    from cluster.runs.run_dir import RunDir
    from common.toyworld import eval_seeds

    cfg = _cfg(tmp_path)
    run_dir = RunDir.create(cfg)
    driver = Driver(cfg, run_dir)
    torch.set_num_threads(1)  # as the actors sample
    try:
        driver.setup()
        driver.run()
        path = driver.checkpoint()
        after = driver.evaluate("after", gifs=0)
        ema, live = driver.learner.weights_payload(ema=True), driver.learner.weights_payload()
        versions = ray.get([a.version.remote() for a in driver.rollouts])
    finally:
        driver.teardown()
    assert driver.step == STEPS and versions == [STEPS + 1] * len(versions)  # the average goes out as N + 1
    moved = [k for k in ema if not torch.equal(ema[k], live[k])]
    assert moved, "after 3 steps the average must differ from the live weights"
    exported = read_policy(path)   # policy/: diffusers' sharded layout, written by the learner ranks
    assert set(exported) == set(ema) and all(torch.equal(exported[k], ema[k]) for k in ema)

    pairs = [(c.prompt, s) for c in load_prompts(cfg.train.eval_prompts) for s in eval_seeds(cfg.train.eval_seeds)]
    with_ema, with_live = local_eval(cfg, ema, pairs), local_eval(cfg, live, pairs)
    assert len(after.composite) == len(pairs)
    np.testing.assert_allclose(after.composite, with_ema, atol=1e-6)
    assert np.abs(after.composite - with_live).max() > 1e-4, "the live weights must score otherwise"
