"""The one-GPU recipe's toy-width twin (issue 47): configs/toy_1gpu_shared.yaml has the pool shape
of configs/wan21_t2v_1p3b_1gpu.yaml (rollout, reward and learner on one GPU at 0.5 / 0.2 / 0.3,
weights through the object store) with the toy model, and trains end to end on the CPU with the
three roles sharing the session cluster's one simulated GPU (pools.simulated_gpus)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from cluster.cli import main
from cluster.driver.driver import Driver
from cluster.driver.probe import ProbeSpec, probe
from cluster.runs.run_dir import RunDir
from common.config import load_config

ROOT = Path(__file__).resolve().parents[1]
TWIN, RECIPE = (str(ROOT / f"configs/{n}.yaml") for n in ("toy_1gpu_shared", "wan21_t2v_1p3b_1gpu"))
ROLES = ("rollout", "reward", "learner")
STEPS = 2
pytestmark = pytest.mark.timeout(600)


def test_the_one_gpu_recipes_toy_twin_trains_with_its_three_roles_sharing_one_simulated_gpu(
        ray_session, tmp_path, capsys):
    import ray

    def gpu_of_actor(self):  # asked inside each actor: what Ray gave it, and whether it touched CUDA
        import ray
        import torch

        ctx = ray.get_runtime_context()
        res = ctx.get_assigned_resources()
        return (ctx.get_accelerator_ids()["GPU"],
                sum(v for k, v in res.items() if k == "GPU" or k.startswith("GPU_group_") and k.count("_") == 2),
                torch.cuda.is_initialized())

    def lora(self):  # the rollout actor's LoRA tensors (B starts at zero: nonzero = the learner's weights)
        return {n: p.detach().clone() for n, p in self.model.trainable_module().named_parameters() if "lora_" in n}

    # the twin is the recipe's layout: the same shares of one GPU and the same weight transport
    twin, recipe = load_config(TWIN), load_config(RECIPE)
    for role in ROLES:
        assert getattr(twin.pools, role).num_gpus == getattr(recipe.pools, role).num_gpus, role
    assert twin.weight_sync.transport == recipe.weight_sync.transport == "object_store"
    assert twin.pools.simulated_gpus and not recipe.pools.simulated_gpus and not load_config(None).pools.simulated_gpus
    # `vgrpo plan` prints the toy's layout: one device, the three roles on it
    assert main(["plan", "-c", TWIN]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("GPU 0:"))
    assert "rollout + reward + learner" in line and "0.5 + 0.2 + 0.3 = 1 of the GPU" in line, line
    # without the simulation, the preflight's role check refuses a GPU share where torch sees no CUDA
    if not torch.cuda.is_available():
        refused, _ = probe(ProbeSpec("learner", gpus=0.3))
        assert len(refused) == 1 and "but torch sees no CUDA device" in refused[0], refused
        assert probe(ProbeSpec("learner", gpus=0.3, simulated=True))[0] == []

    cfg = load_config(TWIN, [f"train.steps={STEPS}", "train.groups_per_step=2", "sampler.group_size=4",
                             "schedule.steps=4", "train.eval_seeds=1", "train.checkpoint_every=1000",
                             f"run.root={tmp_path}", "run.name=twin"])
    run_dir = RunDir.create(cfg)
    driver = Driver(cfg, run_dir)
    try:
        driver.setup()
        rollout = driver.rollouts[0]
        before = ray.get(rollout.__ray_call__.remote(lora))
        assert before and all(float(t.abs().sum()) == 0 for n, t in before.items() if "lora_B" in n)
        driver.run()
        assert driver.stop_reason is None and driver.step == STEPS
        # 1. the three roles sit on the one GPU, by the recipe's fractions, and compute on the CPU
        actors = {"rollout": driver.rollouts, "reward": list(driver.rewards.actors.values()),
                  "learner": driver.learner.ranks}
        placed = {role: ray.get([a.__ray_call__.remote(gpu_of_actor) for a in group])
                  for role, group in actors.items()}
        assert all(len(v) == 1 for v in placed.values()), placed
        assert {role: v[0][0] for role, v in placed.items()} == {r: ["0"] for r in ROLES}, placed
        assert {role: v[0][1] for role, v in placed.items()} == pytest.approx(
            {r: getattr(cfg.pools, r).num_gpus for r in ROLES}), placed
        assert not any(v[0][2] for v in placed.values()), placed  # no CUDA context anywhere
        # 2. it trained: every step's row, finite losses; the learner's weights reached the rollout
        #    actor (one version per step, through the object store) and moved its LoRA off zero
        rows = [json.loads(line) for line in run_dir.metrics_file.read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
        assert all(math.isfinite(r["reward_mean"]) and math.isfinite(r["loss"]) for r in rows), rows
        assert ray.get(rollout.version.remote()) == STEPS == driver.learner.version()
        after = ray.get(rollout.__ray_call__.remote(lora))
        assert after.keys() == before.keys() and all(torch.isfinite(t).all() for t in after.values())
        moved = [n for n in after if "lora_B" in n and float((after[n] - before[n]).abs().max()) > 0]
        assert moved, "the rollout actor's LoRA never changed: no weights came from the learner"
    finally:
        driver.teardown()
