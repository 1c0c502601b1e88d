"""Three training steps with sequence parallelism 2 in the rollout and the learner, against sp 1.

A tiny real Wan 2.1 T2V checkpoint (two blocks, CFG) saved in diffusers format; the rollout is
a real `RolloutActor` on the shared local Ray (at sp 2 a leader and the follower it starts,
one driver-facing handle), the learner a real `LearnerGroup` (at sp 2 one data-parallel rank
of two processes on the (dp, sp) mesh). Each step: every rollout generates the step's groups,
the rewards are a fixed function of the final latents, the learner trains on them and its
weights go back to its rollout. sp 2 must give sp 1's trajectories, rewards and losses within
1e-5, and replay the stored log-probs exactly (log r = 0 at the first micro-batch, before any
update). The reward is continuous in the latents on purpose: a reward of the decoded uint8
frames (red minus blue) let a last-ulp difference in the weights after step 1 flip a pixel's
rounding now and then, which the advantages' 1/std (a std of 0.003 there) turned into 1e-4
between the two runs' losses (measured); with this reward they agree to 1e-7.
"""

from __future__ import annotations

import pytest
import torch

from common.config import RunConfig
from common.types import Condition, TrainBatch

pytestmark = pytest.mark.timeout(900)

STEPS, CONDITIONS = 3, ["a red cat", "a blue dog runs"]
STAT_KEYS = ("loss", "loss/policy", "loss/kl", "loss/align", "ratio_mean", "approx_kl", "clipfrac",
             "kl/d_anchor", "kl/d_step", "grad_norm", "reward_mean", "num_rows")


def _checkpoint(path) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    from rollout_worker.models.tiny import tiny_wan_components

    WanPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), **tiny_wan_components("t2v", layers=2)).save_pretrained(path)


# DiffusionNFT (learner/nft.py): ODE rollouts from each member's own noise, its loss on their clean
# final latents; nothing reads a recorded step, so KL and alignment are off
NFT = {"grpo": {"loss": "nft", "adv_std": "batch", "equalizer": False}, "kl": {"strategy": "none"},
       "align": {"enabled": False}, "bank": {"enabled": False},
       "sampler": {"group_size": 3, "shared_noise": False, "initial_noise": "group"}}
NFT_STAT_KEYS = ("loss", "loss/policy", "nft/old_deviate", "grad_norm", "reward_mean", "num_rows")


def _cfg(path, sp: int, over: dict | None = None) -> RunConfig:
    pool = {"num_cpus": 0.25, "torch_threads": 1, "max_restarts": 0, "parallel": {"sp": sp}}
    return RunConfig.model_validate({**{
        "model": {"family": "wan", "path": str(path), "num_frames": 5, "height": 32, "width": 32,
                  "guidance_scale": 2.0, "max_sequence_length": 8},
        "schedule": {"steps": 4, "shift": 3.0}, "sampler": {"group_size": 3},
        "optim": {"finetune": "lora", "lora_rank": 4, "lr": 3e-3, "micro_batch": 4},
        "kl": {"strategy": "dual", "schedule": "constant", "lam": 0.1},
        "pools": {"rollout": pool, "learner": pool}, "train": {"seed": 5}}, **(over or {})})


def _reward(group) -> torch.Tensor:
    """A fixed linear read-out of each member's final latents (a continuous reward: decoded uint8
    frames would round a last-ulp difference into a whole intensity level now and then)."""
    z = torch.stack([m.final_latents.float() for m in group.members])  # [G, C, F, H, W]
    u = torch.randn(z.shape[1:], generator=torch.Generator().manual_seed(11))
    return (z * u).flatten(1).mean(dim=1)


def _run(ray, path, sp: int, over: dict | None = None, resume: bool = True) -> dict:
    from learner.actor import LearnerGroup
    from rollout_worker.actor import RolloutActor

    cfg = _cfg(path, sp, over)
    rollout = RolloutActor.options(resources={"rollout": 1}, num_cpus=0.25, max_restarts=0).remote(cfg, 0)
    learner = LearnerGroup(cfg, num_ranks=1)
    out = {"groups": [], "stats": [], "ping": ray.get(rollout.ping.remote(), timeout=300),
           "layout": ray.get([r.layout.remote() for r in learner.ranks], timeout=300)}
    try:
        for step in range(STEPS):
            groups = []
            for c, prompt in enumerate(CONDITIONS):
                g = ray.get(rollout.generate.remote(Condition(id=f"c{c}", prompt=prompt), 100 * step + c), timeout=300)
                g.composite = _reward(g)
                groups.append(g)
            out["groups"].append(groups)
            out["stats"].append(learner.train_step(TrainBatch(fresh=groups, version=step)).values)
            ray.get(rollout.set_weights.remote(learner.weights_payload(), learner.version()), timeout=300)
        if not resume:
            return out
        # a checkpoint (sharded at sp 2) resumes: the next step's loss equals the uninterrupted one's
        ckpt = learner.save_checkpoint(path.parent / f"ckpt-sp{sp}")
        batch = TrainBatch(fresh=groups, version=STEPS)
        after = learner.train_step(batch)["loss"]
        learner.load_checkpoint(ckpt)
        out["resume"] = (after, learner.train_step(batch)["loss"], sorted(p.name for p in ckpt.iterdir()))
    finally:
        learner.shutdown()
        ray.kill(rollout)
    return out


@pytest.fixture(scope="module")
def runs(ray_session, tmp_path_factory):
    path = tmp_path_factory.mktemp("wan") / "ckpt"
    _checkpoint(path)
    return {sp: _run(ray_session, path, sp) for sp in (1, 2)}


def test_sp2_runs_on_two_ranks_behind_one_handle(runs):
    assert runs[1]["ping"]["sp"] == 1 and "sp_ranks" not in runs[1]["ping"]
    assert runs[2]["ping"]["sp_ranks"] == [(0, 2), (0, 2)]  # leader and follower, version 0, split in 2
    assert [r["sp"] for r in runs[1]["layout"]] == [1]
    assert runs[2]["layout"] == [{"rank": r, "dp_rank": 0, "dp_size": 1, "sp": 2} for r in (0, 1)]


def test_sp2_gives_sp1_trajectories_rewards_and_losses(runs):
    one, two = runs[1], runs[2]
    for step in range(STEPS):
        for g1, g2 in zip(one["groups"][step], two["groups"][step], strict=True):
            assert g2.policy_version == g1.policy_version == step
            torch.testing.assert_close(g2.composite, g1.composite, rtol=0, atol=1e-5)
            for m1, m2 in zip(g1.members, g2.members, strict=True):
                assert m2.step_indices == m1.step_indices  # the steps each member trains (stored alone)
                torch.testing.assert_close(m2.logp_old, m1.logp_old, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(m2.final_latents, m1.final_latents, rtol=1e-5, atol=1e-5)
        s1, s2 = one["stats"][step], two["stats"][step]
        for k in STAT_KEYS:
            assert s2[k] == pytest.approx(s1[k], rel=1e-5, abs=1e-5), (step, k)
    # the run moved: rewards change over the steps and the loss is not zero
    rewards = [s["reward_mean"] for s in one["stats"]]
    assert len(set(rewards)) == STEPS and any(abs(s["loss"]) > 0 for s in one["stats"])


def test_sp2_replays_the_stored_log_probs_exactly(runs):
    # fp32: the learner's velocity at the stored x_k is the sampler's bit for bit at both degrees
    assert [s["logratio_first_absmax"] for s in runs[2]["stats"]] == [0.0] * STEPS
    assert [s["logratio_first_absmax"] for s in runs[1]["stats"]] == [0.0] * STEPS


def test_a_checkpoint_at_sp2_resumes(runs):
    after, again, files = runs[2]["resume"]
    assert again == pytest.approx(after, rel=1e-6)
    assert files == ["extra.json", "meta.json", "rank00000.pt", "rank00001.pt"]  # one shard per process
    assert runs[1]["resume"][0] == pytest.approx(after, rel=1e-5, abs=1e-5)


def test_nft_at_sp2_gives_sp1_final_latents_and_losses(ray_session, tmp_path):
    """The NFT branch of the trainer at sp 2: its loss scaled like GRPO's (each row counted once)."""
    path = tmp_path / "ckpt"
    _checkpoint(path)
    one, two = (_run(ray_session, path, sp, NFT, resume=False) for sp in (1, 2))
    for step in range(STEPS):
        for g1, g2 in zip(one["groups"][step], two["groups"][step], strict=True):
            torch.testing.assert_close(g2.composite, g1.composite, rtol=0, atol=1e-5)
            for m1, m2 in zip(g1.members, g2.members, strict=True):
                assert m1.step_indices == m2.step_indices == []  # ODE rollouts: no step recorded
                torch.testing.assert_close(m2.final_latents, m1.final_latents, rtol=1e-5, atol=1e-5)
        s1, s2 = one["stats"][step], two["stats"][step]
        for k in NFT_STAT_KEYS:
            assert s2[k] == pytest.approx(s1[k], rel=1e-5, abs=1e-5), (step, k)
    assert len({s["reward_mean"] for s in one["stats"]}) == STEPS and any(s["loss"] != 0 for s in one["stats"])
