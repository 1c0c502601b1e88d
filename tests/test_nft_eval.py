"""DiffusionNFT on real Ray: its rollouts sample v_old, but every evaluation samples θ, as its
upstream's eval_fn does (docs/algorithm.md section 6b). The held-out evaluation during training and
the final evaluation are recomputed in this process from the learner's two payloads (θ and v_old),
each loaded into a fresh toy model and ODE-sampled by the sampler's own function; v_old lags θ by
half (nft.old_rate 0.5), so the two score apart."""

from __future__ import annotations

import numpy as np
import torch
from helpers_eval import local_eval

from common.config import load_config

STEPS = 2


def _cfg(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red square moving left\na blue square moving up\n")
    return load_config("configs/quickstart.yaml", [
        f"train.prompts={prompts}", f"train.steps={STEPS}", "train.groups_per_step=2", "train.eval_seeds=2",
        "sampler.group_size=4", "schedule.steps=4", "optim.micro_batch=8", "optim.lr=0.01",
        "grpo.loss=nft", "grpo.adv_std=batch", "grpo.equalizer=false", "grpo.per_head_advantages=false",
        "kl.strategy=none", "align.enabled=false", "bank.enabled=false", "sampler.shared_noise=false",
        "sampler.initial_noise=group", "nft.old_rate=0.5", "nft.old_max=0.5",
        f"health.eval_every={STEPS}", "health.eval_seeds=2", f"run.root={tmp_path}", "run.name=nft"])


def test_nft_evaluates_theta_while_its_rollouts_sample_v_old(ray_session, tmp_path):
    import ray

    from cluster.data.prompts import load_prompts
    from cluster.driver.driver import Driver
    from cluster.runs.run_dir import RunDir
    from common.toyworld import eval_seeds

    cfg = _cfg(tmp_path)
    driver = Driver(cfg, RunDir.create(cfg))
    torch.set_num_threads(1)  # as the actors sample
    try:
        driver.setup()
        driver.run()
        after = driver.evaluate("after", gifs=0)
        theta, v_old = driver.learner.weights_payload(ema=True), driver.learner.weights_payload()
        versions = ray.get([a.version.remote() for a in driver.rollouts])
    finally:
        driver.teardown()
    assert driver.step == STEPS and versions == [STEPS + 1] * len(versions)  # θ goes out as N + 1 at the end
    assert any(not torch.equal(theta[k], v_old[k]) for k in theta)

    pairs = [(c.prompt, s) for c in load_prompts(cfg.train.eval_prompts) for s in eval_seeds(cfg.train.eval_seeds)]
    with_theta, with_old = local_eval(cfg, theta, pairs), local_eval(cfg, v_old, pairs)
    assert np.abs(with_theta - with_old).max() > 1e-4, "v_old must score otherwise"
    held_out = dict(driver.health.monitor.evals)
    assert sorted(held_out) == [0, STEPS] and len(held_out[STEPS].composite) == len(pairs)
    np.testing.assert_allclose(held_out[STEPS].composite, with_theta, atol=1e-6)   # during training: θ
    np.testing.assert_allclose(after.composite, with_theta, atol=1e-6)             # the final evaluation: θ
