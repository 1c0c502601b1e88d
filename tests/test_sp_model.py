"""Ulysses sequence parallelism on the tiny real transformers, two gloo ranks against one process.

Each adapter's `velocity` (CFG inside; Wan 2.2 switching experts within the batch) at sp 2
must equal sp 1, and the weight gradients of a loss on it, summed over the two ranks (each
rank holds its tokens' share), must equal the single process's. Wan goes through diffusers'
own `_cp_plan`; HunyuanVideo 1.5 through this project's plan and processor. Two blocks, so a
block's text output reaches the next block and the text gradient path is exercised.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers_sp import spawn_ranks

pytestmark = pytest.mark.timeout(900)

CASES = ["wan21_t2v", "wan21_i2v", "wan22_t2v", "wan22_i2v", "hunyuan15_t2v", "hunyuan15_i2v",
         "wan22_t2v_ckpt", "hunyuan15_i2v_ckpt"]  # _ckpt: activation checkpointing (recompute runs the collectives)
IMAGE = np.random.RandomState(0).randint(0, 256, (32, 32, 3), dtype=np.uint8)


def build(case: str):
    """The adapter of `case` (2 blocks, CFG 2) and its velocity inputs: x [2, C, F, H, W], σ [2], cond."""
    from common.config import ModelConfig
    from rollout_worker.models.hunyuan15 import Hunyuan15VideoModel
    from rollout_worker.models.tiny import tiny_hunyuan15_components, tiny_wan_components
    from rollout_worker.models.wan import WanVideoModel

    family, task, *ckpt = case.split("_")
    if family.startswith("wan"):
        variant = {"wan21": task, "wan22": f"{task}_a14b"}[family]
        mc = ModelConfig(family="wan", task=task, num_frames=5, height=32, width=32, guidance_scale=2.0,
                         max_sequence_length=8, guidance_scale_2=3.0 if family == "wan22" else None)
        model = WanVideoModel.from_components(tiny_wan_components(variant, layers=2), mc)
    else:
        mc = ModelConfig(family="hunyuan15", task=task, num_frames=3, height=16, width=16, guidance_scale=2.0)
        model = Hunyuan15VideoModel.from_components(tiny_hunyuan15_components(task, layers=2), mc)
    images = None
    if task == "i2v":
        img = torch.from_numpy(IMAGE[: mc.height, : mc.width].copy())
        images = torch.stack([img, img.flip(0)])
    cond = model.encode(["a red cat", "a blue dog runs"], images)
    if ckpt:
        for t in model.transformers():
            t.enable_gradient_checkpointing()
    g = torch.Generator().manual_seed(3)
    x = torch.randn((2, *model.latent_shape), generator=g)
    sigma = torch.tensor([0.9, 0.4])  # Wan 2.2 (boundary 0.6): one row per expert
    return model, x, sigma, cond


def velocity_and_grads(model, x, sigma, cond):
    params = {f"{i}.{n}": p for i, t in enumerate(model.transformers()) for n, p in t.named_parameters()}
    for p in params.values():
        p.requires_grad_(True)
        p.grad = None
    v = model.velocity(x, sigma, cond)
    w = torch.randn(v.shape, generator=torch.Generator().manual_seed(4)) / v.numel() ** 0.5
    (v * w).sum().backward()
    return v.detach(), {n: p.grad.clone() for n, p in params.items() if p.grad is not None}


def sp_rank(rank: int, world: int, cases: list[str]) -> dict:
    """One SP rank: every case's velocity and this rank's share of the gradients."""
    from rollout_worker.models.sp import sp_mesh

    mesh = sp_mesh(world)
    out = {}
    for case in cases:
        model, x, sigma, cond = build(case)
        model.enable_sp(mesh)
        out[case] = velocity_and_grads(model, x, sigma, cond)
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return spawn_ranks(sp_rank, 2, tmp_path_factory.mktemp("sp"), CASES)


@pytest.mark.parametrize("case", CASES)
def test_velocity_and_gradients_at_sp2_equal_sp1(case, two_ranks):
    torch.manual_seed(0)
    v1, g1 = velocity_and_grads(*build(case))
    assert v1.abs().max() > 0 and len(g1) > 10
    for v2, _ in (r[case] for r in two_ranks):
        torch.testing.assert_close(v2, v1, rtol=1e-5, atol=1e-5)
    g2 = {n: sum(r[case][1][n] for r in two_ranks) for n in g1}
    assert set(two_ranks[0][case][1]) == set(g1)
    for n in g1:
        torch.testing.assert_close(g2[n], g1[n], rtol=1e-5, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
    # each rank holds a share, not the whole: the split is real
    share = two_ranks[0][case][1]
    assert any(not torch.allclose(share[n], g1[n], rtol=1e-3, atol=1e-6) for n in g1)


def test_indivisible_heads_or_tokens_are_one_line_naming_parallel_sp():
    from rollout_worker.models.sp import SPConfigError, check_splittable

    model, *_ = build("wan21_t2v")
    t = model.transformer
    with pytest.raises(SPConfigError, match=r"parallel.sp = 3: the transformer's 2 attention heads"):
        check_splittable(t, 8, 3, "parallel.sp")
    with pytest.raises(SPConfigError, match=r"parallel.sp = 2: the 7 video tokens"):
        check_splittable(t, 7, 2, "parallel.sp")


def test_a_backend_without_context_parallel_attention_is_refused_before_any_collective():
    from diffusers.models.attention_dispatch import AttentionBackendName

    from rollout_worker.models.sp import SPConfigError, _check_cp_backend

    model, *_ = build("wan21_t2v")
    _check_cp_backend(model.transformer, 2)  # native: diffusers' Ulysses runs on it
    for m in model.transformer.modules():  # as set_attention_backend("_flash_3") leaves it
        if hasattr(getattr(m, "processor", None), "_attention_backend"):
            m.processor._attention_backend = AttentionBackendName("_flash_3")
    with pytest.raises(SPConfigError, match=r"no sequence-parallel attention on backend '_flash_3'") as e:
        _check_cp_backend(model.transformer, 2)
    assert "\n" not in str(e.value) and "model.attention_backend" in str(e.value)


def mesh_rank(rank: int, world: int, port: int) -> dict:
    """The learner's (dp, sp) = (2, 2) layout on four processes, and what each of its groups sums."""
    import torch.distributed as dist

    from learner import fsdp

    m = fsdp.init_distributed(rank, world, "127.0.0.1", port, "cpu", 60.0, sp=2)
    one = torch.tensor([float(rank)])
    dp_sum = one.clone()
    dist.all_reduce(dp_sum, group=m.dp_group)
    sp_sum = one.clone()
    dist.all_reduce(sp_sum, group=m.sp["ulysses"].get_group())
    return {"dp": (m.dp_rank, m.dp_size), "fsdp": m.fsdp.size(), "dp_sum": float(dp_sum), "sp_sum": float(sp_sum)}


def test_the_learner_mesh_is_dp_by_sp(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = spawn_ranks(mesh_rank, 4, tmp_path, port, init=False)
    # rank = dp_rank·sp + sp_rank: {0, 1} and {2, 3} are SP groups, {0, 2} and {1, 3} dp groups
    assert [o["dp"] for o in out] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert [o["sp_sum"] for o in out] == [1.0, 1.0, 5.0, 5.0]
    assert [o["dp_sum"] for o in out] == [2.0, 4.0, 2.0, 4.0]
    assert all(o["fsdp"] == 4 for o in out)  # the weights shard over every process
