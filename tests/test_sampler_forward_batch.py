"""sampler.forward_batch_size: a group's CFG rows and an evaluation share run in micro-batches of
at most that many transformer rows, and every row comes out as the one-forward path makes it.

Bit-identity needs batch-invariant kernels. On this CPU (MKL sgemm, one thread) an fp32 GEMM
with M ≤ 3 rows reduces in another order than the same rows inside a larger M: the timestep
embedding's linears have M = rows, so fp32 micro-batches of fewer than 4 rows differ from the
one forward by ≈5e-7 (measured on the tiny Wan's velocity and latents); bf16 (the shipped configs' dtype)
is batch-invariant at every size measured. The tests use fp32 micro-batches of 4 rows and bf16
ones of 1 or 2, and pin the fp32 2-row difference to its size.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

from common.config import ConfigError, RunConfig, validate
from common.sde import Schedule
from common.types import Condition
from rollout_worker.actor import RolloutWorker
from rollout_worker.models.tiny import tiny_wan_components
from rollout_worker.models.wan import WanVideoModel
from rollout_worker.sampler import sample_group, sample_videos

COND = Condition(id="c0", prompt="a red cat")
PROMPTS = ["a red cat", "a dog", "a blue square moving left", "rain", "a red cat"]


def wan_cfg(dtype: str = "float32", fbs: int | None = None, **sampler) -> RunConfig:
    return RunConfig.model_validate({
        "model": {"family": "wan", "num_frames": 5, "height": 16, "width": 16, "guidance_scale": 2.0,
                  "max_sequence_length": 16, "dtype": dtype},
        "schedule": {"steps": 5, "shift": 3.0}, "sde": {"scheme": "sage", "eta": 0.7},
        "sampler": {"group_size": 8, "train_steps": "all", "ode_last_steps": 1, "forward_batch_size": fbs,
                    **sampler},
        "align": {"enabled": True, "form": "clipped"}})  # clipped alignment keeps μ_old: one more tensor


def rows_per_forward(*modules) -> list[int]:
    """Records the batch size of every forward of `modules` (their first input's rows)."""
    seen: list[int] = []

    def hook(_mod, args, kwargs):
        seen.append((args[0] if args else kwargs["hidden_states"]).shape[0])

    for m in modules:
        if m is not None:
            m.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


@pytest.fixture(scope="module")
def wan22():
    """Tiny Wan 2.2 (two experts, a boundary) with CFG: each step runs one expert over 2·G rows."""
    return {dt: WanVideoModel.from_components(tiny_wan_components("t2v_a14b"), wan_cfg(dt).model)
            for dt in ("float32", "bfloat16")}


def assert_groups_equal(a, b) -> None:
    assert a.group_id == b.group_id and len(a.members) == len(b.members)
    for x, y in zip(a.members, b.members, strict=True):
        for name in ("x", "x_next", "logp_old", "mu_old", "final_latents", "frames"):
            u, v = getattr(x, name), getattr(y, name)
            assert u is not None and torch.equal(u, v), (name, x.member)
        assert x.step_indices == y.step_indices


@pytest.mark.parametrize(("dtype", "fbs", "forwards"), [("float32", 4, 4), ("float32", 7, 3), ("bfloat16", 2, 8)])
@torch.no_grad()
def test_wan_group_in_micro_batches_is_bit_identical(wan22, dtype, fbs, forwards):
    model = wan22[dtype]
    seen = rows_per_forward(model.transformer, model.transformer_2)
    whole = sample_group(model, COND, wan_cfg(dtype), seed=3, policy_version=1)
    assert set(seen) == {16}                       # G 8 with CFG: 16 rows in each step's one forward
    seen.clear()
    split = sample_group(model, COND, wan_cfg(dtype, fbs), seed=3, policy_version=1)
    steps = wan_cfg(dtype).schedule.steps
    assert max(seen) <= fbs and len(seen) == steps * forwards and sum(seen) == steps * 16
    assert_groups_equal(whole, split)


@torch.no_grad()
def test_fp32_two_row_micro_batches_differ_only_at_rounding(wan22):
    """The documented limit: fp32 2-row forwards take MKL's small-M kernel (see the module doc)."""
    model = wan22["float32"]
    whole = sample_group(model, COND, wan_cfg(), seed=3, policy_version=1)
    split = sample_group(model, COND, wan_cfg(fbs=2), seed=3, policy_version=1)
    for x, y in zip(whole.members, split.members, strict=True):
        assert float((x.x_next - y.x_next).abs().max()) < 2e-6   # measured 4.8e-7
        assert float((x.logp_old - y.logp_old).abs().max()) < 1e-6  # measured 1.2e-7


@pytest.mark.parametrize(("dtype", "fbs"), [("float32", 4), ("bfloat16", 2)])
@torch.no_grad()
def test_wan_eval_share_in_micro_batches_is_bit_identical(wan22, dtype, fbs):
    model, sched = wan22[dtype], Schedule.linear(4, 3.0)
    seeds = [5, 9, 1, 2, 7]
    seen = rows_per_forward(model.transformer, model.transformer_2)
    one = sample_videos(model, PROMPTS, seeds, sched, "sage", 0.7)
    assert set(seen) == {10}
    seen.clear()
    parts = sample_videos(model, PROMPTS, seeds, sched, "sage", 0.7, forward_batch_size=fbs)
    assert max(seen) <= fbs and sum(seen) == 4 * 10   # 5 videos in ceil(5 / (fbs // 2)) forwards a step
    assert torch.equal(one, parts)


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-wan-fbs")
    WanPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), **tiny_wan_components("t2v")).save_pretrained(path)
    return path


def worker_cfg(family: str, path, fbs: int | None) -> dict:
    model = ({"family": "toy", "guidance_scale": 3.0} if family == "toy" else
             {"family": "wan", "path": str(path), "num_frames": 5, "height": 16, "width": 16,
              "guidance_scale": 2.0, "max_sequence_length": 16})
    return {"model": model, "schedule": {"steps": 4}, "sde": {"scheme": "sage"},
            "sampler": {"group_size": 4, "train_steps": "all", "forward_batch_size": fbs},
            "align": {"enabled": True},
            "pools": {"rollout": {"num_actors": 1, "num_cpus": 0.5, "torch_threads": 1}}}


@pytest.mark.parametrize("family", ["toy", "wan"])
@torch.no_grad()
def test_rollout_actor_groups_and_eval_follow_the_config(family, wan_dir):
    """The rollout actor (its plain class) generates groups and evaluation videos with the config's
    micro-batches: the toy model (its own CFG forward) and the tiny Wan checkpoint loaded from disk."""
    whole, split = (RolloutWorker(worker_cfg(family, wan_dir, fbs)) for fbs in (None, 4))
    seen = rows_per_forward(split.model.transformer)
    assert_groups_equal(whole.generate(COND, seed=4), split.generate(COND, seed=4))
    assert set(seen) == {4}                        # G 4 with CFG: 8 rows, two forwards of 4 a step
    seen.clear()
    prompts, seeds = PROMPTS[:3], [0, 1, 2]
    assert torch.equal(whole.sample_videos(prompts, seeds), split.sample_videos(prompts, seeds))
    assert max(seen) <= 4 and len(seen) == 4 * 2    # 3 videos: 2 + 1 per step, 4 steps


def test_forward_batch_size_bounds():
    assert RunConfig().sampler.forward_batch_size is None
    with pytest.raises(ConfigError, match="sampler.forward_batch_size = 0"):
        validate({"sampler": {"forward_batch_size": 0}})
    with pytest.raises(ConfigError, match=r"sampler.forward_batch_size=1 .* 2 rows a sample takes with CFG"):
        validate({"model": {"guidance_scale": 4.0}, "sampler": {"forward_batch_size": 1}})
    assert validate({"model": {"guidance_scale": 1.0}, "sampler": {"forward_batch_size": 1}}).sampler \
        .forward_batch_size == 1


@pytest.mark.parametrize(("dtype", "fbs"), [("float32", 4), ("bfloat16", 1), ("bfloat16", 2)])
@torch.no_grad()
def test_hunyuan15_group_and_eval_in_micro_batches_are_bit_identical(dtype, fbs):
    """HunyuanVideo 1.5 runs CFG's cond and uncond rows in forwards of their own, so a sample
    takes one row: G 8 is 2 forwards of 8 rows a step, or 2·8/fbs forwards of fbs rows. Its
    processor makes the video tokens contiguous before to_out: a strided slice of B > 1 rows
    takes a batched bf16 GEMM that rounds differently from one row's (measured: 1/255 on frames)."""
    from rollout_worker.models.hunyuan15 import Hunyuan15VideoModel
    from rollout_worker.models.tiny import tiny_hunyuan15_components

    model_cfg = {"family": "hunyuan15", "num_frames": 5, "height": 16, "width": 16, "guidance_scale": 3.0,
                 "dtype": dtype}
    def cfg(f: int | None) -> RunConfig:
        data = wan_cfg(dtype).model_dump()
        data["model"], data["sampler"]["forward_batch_size"] = model_cfg, f
        return RunConfig.model_validate(data)

    model = Hunyuan15VideoModel.from_components(tiny_hunyuan15_components("t2v"), cfg(None).model)
    seen = rows_per_forward(model.transformer)
    whole = sample_group(model, COND, cfg(None), seed=3, policy_version=1)
    steps = cfg(None).schedule.steps
    assert seen == [8] * 2 * steps
    seen.clear()
    assert_groups_equal(whole, sample_group(model, COND, cfg(fbs), seed=3, policy_version=1))
    assert seen == [fbs] * (16 // fbs) * steps
    sched, seeds = Schedule.linear(3, 3.0), [5, 9, 1, 2, 7]
    one = sample_videos(model, PROMPTS, seeds, sched, "sage", 0.7)
    assert torch.equal(one, sample_videos(model, PROMPTS, seeds, sched, "sage", 0.7, forward_batch_size=fbs))
