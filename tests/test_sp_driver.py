"""The whole driver path (`vgrpo train`'s Driver: reward pool, memory bank, weight publishing,
placement groups) for 3 steps with sequence parallelism 2 in the rollout and the learner, against
sp 1, on a tiny real Wan 2.1 T2V checkpoint and the toy reward.

Alignment is off here: J_align scores one member's step against another member's next latent, so
it magnifies the last-ulp differences any change of float summation order leaves in the weights
after step 1. Measured with it on (quickstart's γ 0.02): at step 3 loss/align moved by 7e-4 between
one learner process and two FSDP ranks without SP, and by 1e-3 at sp 2; every other figure agreed
within 3e-6. tests/test_sp_training.py covers J_align at sp 2 with a continuous reward.
"""

from __future__ import annotations

import json

import pytest

from cluster.driver.driver import Driver
from cluster.runs.run_dir import RunDir
from common.config import load_config

pytestmark = pytest.mark.timeout(900)
KEYS = ("reward_mean", "reward_std", "reward/VQ", "reward/MQ", "reward/TA", "loss", "loss/policy", "loss/kl",
        "grad_norm", "approx_kl", "clipfrac", "groups_trained")


def _train(tmp_path, checkpoint, sp: int) -> tuple[list[dict], dict, list[int]]:
    cfg = load_config("configs/quickstart.yaml", [
        "model.family=wan", f"model.path={checkpoint}", "model.num_frames=5", "model.height=32", "model.width=32",
        "model.guidance_scale=2.0", "model.max_sequence_length=8", "schedule.steps=4", "sampler.group_size=4",
        "sampler.ode_last_steps=0", "align.enabled=false", "train.steps=3", "train.groups_per_step=2",
        "train.eval_seeds=1", "health.eval_every=0", "train.checkpoint_every=1000", "optim.micro_batch=8",
        "bank.capacity=2", f"pools.rollout.parallel.sp={sp}", f"pools.learner.parallel.sp={sp}",
        "pools.rollout.num_cpus=0.25", "pools.learner.num_cpus=0.25", f"run.root={tmp_path}", f"run.name=sp{sp}"])
    run_dir = RunDir.create(cfg)
    driver = Driver(cfg, run_dir)
    driver.setup()
    import ray

    ping = ray.get(driver.rollouts[0].ping.remote(), timeout=120)
    layout = [r["sp"] for r in ray.get([r.layout.remote() for r in driver.learner.ranks], timeout=120)]
    driver.run()
    return [json.loads(line) for line in run_dir.metrics_file.read_text().splitlines()], ping, layout


def test_three_driver_steps_at_sp2_give_sp1_rewards_and_losses(ray_session, tmp_path):
    from test_sp_training import _checkpoint

    _checkpoint(tmp_path / "ckpt")
    (one, ping1, layout1), (two, ping2, layout2) = (_train(tmp_path, tmp_path / "ckpt", sp) for sp in (1, 2))
    assert (ping1["sp"], layout1) == (1, [1])
    assert ping2["sp_ranks"] == [(0, 2), (0, 2)] and layout2 == [2, 2]  # one handle, two ranks, each split
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2, 3]
    for r1, r2 in zip(one, two, strict=True):
        for k in KEYS:
            assert r2[k] == pytest.approx(r1[k], rel=1e-5, abs=1e-5), (r1["step"], k)
        assert r2["logratio_first_absmax"] == r1["logratio_first_absmax"] == 0.0
    assert len({r["reward_mean"] for r in one}) == 3  # the policy moved
