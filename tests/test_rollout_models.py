"""Wan 2.x and HunyuanVideo 1.5 adapters against diffusers' own pipelines (tiny random configs)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from diffusers import (
    FlowMatchEulerDiscreteScheduler,
    HunyuanVideo15ImageToVideoPipeline,
    HunyuanVideo15Pipeline,
    WanImageToVideoPipeline,
    WanPipeline,
)
from diffusers.guiders import ClassifierFreeGuidance
from PIL import Image

from common.config import ModelConfig, RunConfig
from common.sde import Schedule
from rollout_worker.models import ModelLoadError, build_model
from rollout_worker.models.hunyuan15 import Hunyuan15VideoModel
from rollout_worker.models.tiny import tiny_hunyuan15_components, tiny_wan_components
from rollout_worker.models.wan import WanVideoModel
from rollout_worker.sampler import sample_videos

SIGMAS = Schedule.linear(4, 3.0).sigmas  # σ = 1, .9, .75, .5, 0
SEED = 7
IMAGE = torch.from_numpy(np.random.RandomState(0).randint(0, 256, (16, 16, 3), dtype=np.uint8))


class FixedSigmas(FlowMatchEulerDiscreteScheduler):
    """Euler with our explicit σ_0 … σ_{T-1} (WanPipeline only passes a step count)."""

    def set_timesteps(self, num_inference_steps=None, device=None, sigmas=None, **kw):
        super().set_timesteps(sigmas=list(SIGMAS[:-1]), device=device)


def wan_cfg(**kw) -> ModelConfig:
    base = dict(family="wan", num_frames=5, height=16, width=16, guidance_scale=2.0, max_sequence_length=16)
    return ModelConfig(**{**base, **kw})


def final_latents(model, images=None) -> torch.Tensor:
    """The sampler's ODE final latents for one prompt (captured at decode)."""
    seen = {}
    decode = model.decode
    model.decode = lambda z: (seen.setdefault("z", z.clone()), decode(z))[1]
    video = sample_videos(model, ["a red cat"], [SEED], Schedule(SIGMAS), images=images)
    model.decode = decode
    assert video.dtype == torch.uint8 and video.shape == (1, 5, 16, 16, 3)
    return seen["z"]


@pytest.mark.parametrize("variant", ["t2v", "t2v_a14b"])
def test_wan_t2v_ode_matches_wan_pipeline(variant):
    comps = tiny_wan_components(variant)
    mc = wan_cfg(guidance_scale_2=3.0 if variant == "t2v_a14b" else None)
    model = WanVideoModel.from_components(comps, mc)
    pipe = WanPipeline(scheduler=FixedSigmas(shift=1.0), **comps)
    ref = pipe("a red cat", negative_prompt="", height=16, width=16, num_frames=5, num_inference_steps=4,
               guidance_scale=2.0, guidance_scale_2=mc.guidance_scale_2, max_sequence_length=16,
               output_type="latent", generator=torch.Generator().manual_seed(SEED)).frames
    assert torch.allclose(final_latents(model), ref, atol=1e-5, rtol=0)


def test_wan22_experts_switch_at_boundary_and_high_noise_training():
    comps = tiny_wan_components("t2v_a14b")  # boundary_ratio 0.6
    model = WanVideoModel.from_components(comps, wan_cfg(train_experts="high_noise"))
    # only the high-noise expert is trainable; the low-noise one is frozen
    assert model.trainable_module() is comps["transformer"]
    assert all(p.requires_grad for p in comps["transformer"].parameters())
    assert not any(p.requires_grad for p in comps["transformer_2"].parameters())
    assert model.trains_sigma(0.75) and not model.trains_sigma(0.5)
    # a mixed batch routes each sample to its expert, as two single-σ batches would
    cond = model.encode(["a", "b"])
    x = torch.randn(2, *model.latent_shape)
    with torch.no_grad():
        mixed = model.velocity(x, torch.tensor([0.9, 0.3]), cond)
        hi = model.velocity(x[:1], torch.tensor([0.9]), cond.index(slice(0, 1)))
        lo = model.velocity(x[1:], torch.tensor([0.3]), cond.index(slice(1, 2)))
    assert torch.allclose(mixed, torch.cat([hi, lo]), atol=1e-6)
    assert not torch.allclose(hi, model._guided(comps["transformer_2"], 2.0, x[:1], torch.tensor([900.0]),
                                                cond.index(slice(0, 1))).detach())
    both = WanVideoModel.from_components(tiny_wan_components("t2v_a14b"), wan_cfg())  # train_experts=all
    prefixes = {k.split(".")[0] for k in both.trainable_module().state_dict()}
    assert prefixes == {"transformer", "transformer_2"}


def test_wan_i2v_ode_matches_wan_i2v_pipeline():
    comps = tiny_wan_components("i2v")
    model = WanVideoModel.from_components(comps, wan_cfg(task="i2v"))
    pipe = WanImageToVideoPipeline(scheduler=FixedSigmas(shift=1.0), **comps)
    ref = pipe(Image.fromarray(IMAGE.numpy()), "a red cat", negative_prompt="", height=16, width=16,
               num_frames=5, num_inference_steps=4, guidance_scale=2.0, max_sequence_length=16,
               output_type="latent", generator=torch.Generator().manual_seed(SEED)).frames
    assert torch.allclose(final_latents(model, IMAGE[None]), ref, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="first frame"):
        model.encode(["a red cat"])


@pytest.mark.parametrize("task", ["t2v", "i2v"])
def test_hunyuan15_ode_matches_pipeline(task):
    comps = tiny_hunyuan15_components(task)
    model = Hunyuan15VideoModel.from_components(
        comps, ModelConfig(family="hunyuan15", task=task, num_frames=5, height=16, width=16, guidance_scale=2.0))
    guider = ClassifierFreeGuidance(guidance_scale=2.0)
    kw = dict(num_frames=5, sigmas=list(SIGMAS[:-1]), output_type="latent",
              generator=torch.Generator().manual_seed(SEED))
    if task == "t2v":
        pipe = HunyuanVideo15Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0), guider=guider, **comps)
        ref = pipe("a red cat", height=16, width=16, **kw).frames
        ours = final_latents(model)
    else:
        pipe = HunyuanVideo15ImageToVideoPipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0),
                                                  guider=guider, **comps)
        ref = pipe(Image.fromarray(IMAGE.numpy()), "a red cat", **kw).frames
        ours = final_latents(model, IMAGE[None])
    assert ours.shape == ref.shape
    assert torch.allclose(ours, ref, atol=1e-5, rtol=0)


def test_wan_decode_denormalises_with_vae_stats():
    comps = tiny_wan_components("t2v")
    model = WanVideoModel.from_components(comps, wan_cfg())
    z = torch.randn(1, *model.latent_shape)
    vae = comps["vae"]
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    with torch.no_grad():
        raw = vae.decode(z * std + mean, return_dict=False)[0]
    expect = ((raw / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 4, 1)
    assert torch.equal(model.decode(z), expect)


def test_missing_or_incomplete_paths_name_the_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ModelLoadError, match=str(missing)):
        WanVideoModel.from_pretrained(missing, wan_cfg())
    with pytest.raises(ModelLoadError, match="model_index.json"):
        Hunyuan15VideoModel.from_pretrained(tmp_path, ModelConfig(family="hunyuan15"))
    with pytest.raises(ModelLoadError, match="model.path is required"):
        build_model(RunConfig.model_validate({"model": {"family": "wan"}}), device="cpu")
    # a saved checkpoint loads; one with its transformer weights removed names what is missing
    pipe = WanPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), **tiny_wan_components("t2v"))
    pipe.save_pretrained(tmp_path / "wan")
    cfg = RunConfig.model_validate({"model": {**wan_cfg().model_dump(), "path": str(tmp_path / "wan")}})
    model = build_model(cfg, device="cpu")
    assert isinstance(model, WanVideoModel) and model.latent_shape == (4, 2, 2, 2)
    for f in (tmp_path / "wan" / "transformer").glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ModelLoadError, match=r"incomplete; transformer/ holds no weights"):
        build_model(cfg, device="cpu")
    index = json.loads((tmp_path / "wan" / "model_index.json").read_text())
    assert index["transformer"][1] == "WanTransformer3DModel"


def test_task_mismatch_is_a_clear_error():
    with pytest.raises(ModelLoadError, match="model.task"):
        WanVideoModel.from_components(tiny_wan_components("t2v"), wan_cfg(task="i2v"))


# --- issue 15: Wan 2.2 I2V A14B, the fp32 VAE, HunyuanVideo 1.5's guider and MeanFlow, VAE tiling ---


def test_wan22_i2v_a14b_ode_matches_wan_i2v_pipeline():
    """configs/wan22_i2v_tagrpo.yaml's case: two experts, the image condition, no CLIP encoder."""
    comps = tiny_wan_components("i2v_a14b")  # boundary_ratio 0.6: σ = 1, .9 high-noise; .75, .5 low
    mc = wan_cfg(task="i2v", guidance_scale_2=3.0)
    model = WanVideoModel.from_components(comps, mc)
    assert model.transformer_2 is not None and model.transformer.config.image_dim is None
    pipe = WanImageToVideoPipeline(scheduler=FixedSigmas(shift=1.0), **comps)
    ref = pipe(Image.fromarray(IMAGE.numpy()), "a red cat", negative_prompt="", height=16, width=16,
               num_frames=5, num_inference_steps=4, guidance_scale=2.0, guidance_scale_2=3.0,
               max_sequence_length=16, output_type="latent", generator=torch.Generator().manual_seed(SEED)).frames
    ours = final_latents(model, IMAGE[None])
    assert torch.allclose(ours, ref, atol=1e-5, rtol=0)
    # both experts and the image matter: a different first frame gives other latents
    other = final_latents(model, 255 - IMAGE[None])
    assert not torch.allclose(ours, other, atol=1e-3)


def test_wan_vae_loads_in_fp32_from_the_file(tmp_path):
    """model.dtype=bfloat16: the transformer computes in bf16, the VAE keeps its fp32 weights unrounded."""
    comps = tiny_wan_components("t2v")
    WanPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), **comps).save_pretrained(tmp_path / "wan")
    cfg = RunConfig.model_validate({"model": {**wan_cfg(dtype="bfloat16").model_dump(), "path": str(tmp_path / "wan")}})
    model = build_model(cfg, device="cpu")
    assert {p.dtype for p in model.transformer.parameters()} == {torch.bfloat16}
    saved = comps["vae"].state_dict()
    loaded = model.pipe.vae.state_dict()
    assert all(v.dtype == torch.float32 for v in loaded.values())
    rounded = [k for k, v in saved.items() if not torch.equal(v, v.bfloat16().float())]
    assert rounded  # a bf16 load would have changed these
    for k in rounded:
        assert torch.equal(loaded[k], saved[k]), k


def _hy_cfg(task="t2v", **kw) -> ModelConfig:
    return ModelConfig(**{"family": "hunyuan15", "task": task, "num_frames": 5, "height": 16, "width": 16, **kw})


def test_hunyuan15_distilled_guider_refuses_cfg_on_top():
    comps = tiny_hunyuan15_components("t2v")
    comps["guider"] = ClassifierFreeGuidance(guidance_scale=1.0)  # a guidance-distilled checkpoint's guider
    with pytest.raises(ValueError, match=r"model.guidance_scale = 6.0: .*guide twice; set model.guidance_scale: 1.0"):
        Hunyuan15VideoModel.from_components(comps, _hy_cfg(guidance_scale=6.0))
    model = Hunyuan15VideoModel.from_components(comps, _hy_cfg(guidance_scale=1.0))
    assert model.encode(["a"]).uncond is None  # one pass per step, as the pipeline runs it


def test_hunyuan15_guider_formulation_and_rescale_match_pipeline():
    comps = tiny_hunyuan15_components("t2v")
    guider = ClassifierFreeGuidance(guidance_scale=3.0, guidance_rescale=0.7, use_original_formulation=True)
    model = Hunyuan15VideoModel.from_components({**comps, "guider": guider}, _hy_cfg(guidance_scale=3.0))
    pipe = HunyuanVideo15Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0), guider=guider, **comps)
    ref = pipe("a red cat", height=16, width=16, num_frames=5, sigmas=list(SIGMAS[:-1]), output_type="latent",
               generator=torch.Generator().manual_seed(SEED)).frames
    assert torch.allclose(final_latents(model), ref, atol=1e-5, rtol=0)


def test_hunyuan15_meanflow_passes_timestep_r_as_the_i2v_pipeline():
    from diffusers import HunyuanVideo15Transformer3DModel

    comps = tiny_hunyuan15_components("i2v")
    torch.manual_seed(1)
    comps["transformer"] = HunyuanVideo15Transformer3DModel(
        **{**dict(comps["transformer"].config), "use_meanflow": True}).eval()
    guider = ClassifierFreeGuidance(guidance_scale=1.0)  # step-distilled checkpoints run no CFG
    model = Hunyuan15VideoModel.from_components({**comps, "guider": guider}, _hy_cfg("i2v"))
    assert model.needs_sigma_next
    pipe = HunyuanVideo15ImageToVideoPipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0),
                                              guider=guider, **comps)
    ref = pipe(Image.fromarray(IMAGE.numpy()), "a red cat", num_frames=5, sigmas=list(SIGMAS[:-1]),
               output_type="latent", generator=torch.Generator().manual_seed(SEED)).frames
    assert torch.allclose(final_latents(model, IMAGE[None]), ref, atol=1e-5, rtol=0)
    x, cond = torch.randn(1, *model.latent_shape), model.encode(["a"], IMAGE[None])
    with torch.no_grad():  # timestep_r matters, so passing none would be wrong
        a = model.velocity(x, torch.tensor([0.9]), cond, sigma_next=torch.tensor([0.75]))
        b = model.velocity(x, torch.tensor([0.9]), cond, sigma_next=torch.tensor([0.0]))
    assert not torch.allclose(a, b)
    with pytest.raises(ValueError, match="sigma_next"):
        model.velocity(x, torch.tensor([0.9]), cond)


@pytest.mark.parametrize("family", ["wan", "hunyuan15"])
def test_vae_tiling_and_slicing_decode_the_same_frames(family):
    """Tiled (small tiles, so 64x64 frames really split) and sliced decoding against the plain decode."""
    if family == "wan":
        build = lambda **kw: WanVideoModel.from_components(  # noqa: E731
            tiny_wan_components("t2v"), wan_cfg(height=64, width=64, **kw))
        tiles = dict(tile_sample_min_height=48, tile_sample_min_width=48, tile_sample_stride_height=16,
                     tile_sample_stride_width=16)
    else:
        build = lambda **kw: Hunyuan15VideoModel.from_components(  # noqa: E731
            tiny_hunyuan15_components("t2v"), _hy_cfg(height=64, width=64, **kw))
        tiles = dict(tile_sample_min_height=48, tile_sample_min_width=48, tile_latent_min_height=12,
                     tile_latent_min_width=12, tile_overlap_factor=0.5)
    plain, tiled, sliced = build(), build(vae_tiling=True), build(vae_slicing=True)
    assert tiled.pipe.vae.use_tiling and sliced.pipe.vae.use_slicing and not plain.pipe.vae.use_tiling
    tiled.pipe.vae.enable_tiling(**tiles)
    z = torch.randn(2, *plain.latent_shape, generator=torch.Generator().manual_seed(0))
    want = plain.decode(z).float()
    assert (sliced.decode(z).float() - want).abs().max() <= 1  # per-video convs round differently
    got = tiled.decode(z).float()
    assert got.shape == want.shape
    d = (got - want).abs()
    assert d.max() > 0  # the tiles did split the decode
    # random weights are the worst case for seams (no smoothness); measured 3.6 (Wan) and 3.2
    # (HunyuanVideo 1.5, whose mid-block attention sees one tile) mean levels, against ~35 std
    assert d.mean() < 4.0


# --- issue 47: Wan 2.2 TI2V-5B (per-token timesteps, the Wan 2.2 VAE, the held first frame) ---

TI2V = dict(num_frames=9, height=32, width=64)  # 3 latent frames of 2 x 4 (16x spatial), 2 tokens per frame


def ti2v_latents(model, images=None, frames=9, height=32, width=64) -> torch.Tensor:
    """The sampler's ODE final latents at TI2V's test size (captured at decode)."""
    seen = {}
    decode = model.decode
    model.decode = lambda z: (seen.setdefault("z", z.clone()), decode(z))[1]
    video = sample_videos(model, ["a red cat"], [SEED], Schedule(SIGMAS), images=images)
    model.decode = decode
    assert video.dtype == torch.uint8 and video.shape == (1, frames, height, width, 3)
    return seen["z"]


def test_wan22_ti2v_5b_t2v_ode_matches_wan_pipeline_with_per_token_timesteps():
    comps = tiny_wan_components("ti2v_5b")
    model = WanVideoModel.from_components(comps, wan_cfg(**TI2V))
    assert model.expand_timesteps and model.latent_shape == (48, 3, 2, 4)  # the Wan 2.2 VAE: 48 ch, 16x
    pipe = WanPipeline(scheduler=FixedSigmas(shift=1.0), **comps)
    assert pipe.config.expand_timesteps
    ref = pipe("a red cat", negative_prompt="", num_inference_steps=4, guidance_scale=2.0, max_sequence_length=16,
               output_type="latent", generator=torch.Generator().manual_seed(SEED), **TI2V).frames
    ours = ti2v_latents(model)
    assert ours.shape == ref.shape == (1, 48, 3, 2, 4)
    assert torch.allclose(ours, ref, atol=1e-5, rtol=0)
    # the transformer is given one timestep per token: [B, F·H/2·W/2], all t in T2V
    seen = []
    hook = model.transformer.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["timestep"]), with_kwargs=True)
    with torch.no_grad():
        model.velocity(torch.randn(2, *model.latent_shape), torch.tensor([0.9, 0.5]), model.encode(["a", "b"]))
    hook.remove()
    assert seen[0].shape == (4, 6)  # [cond; uncond] rows x 3 frames x 1 x 2 tokens
    assert torch.equal(seen[0][:2], torch.tensor([[900.0] * 6, [500.0] * 6]))


def test_wan22_ti2v_5b_i2v_ode_matches_wan_i2v_pipeline_and_holds_the_first_frame():
    comps = tiny_wan_components("ti2v_5b")
    model = WanVideoModel.from_components(comps, wan_cfg(task="i2v", **TI2V))
    pipe = WanImageToVideoPipeline(scheduler=FixedSigmas(shift=1.0), **comps)
    ref = pipe(Image.fromarray(IMAGE.numpy()), "a red cat", negative_prompt="", num_inference_steps=4,
               guidance_scale=2.0, max_sequence_length=16, output_type="latent",
               generator=torch.Generator().manual_seed(SEED), **TI2V).frames
    ours = ti2v_latents(model, IMAGE[None])
    assert torch.allclose(ours, ref, atol=1e-5, rtol=0)
    # the condition is the first frame's latents alone (no mask channels, no concatenation) and the
    # final latents' first frame is exactly them; the image matters to the frames after it
    cond = model.encode(["a red cat"], IMAGE[None])
    assert set(cond.tensors) == {"encoder_hidden_states", "first_frame"}
    assert cond.tensors["first_frame"].shape == (1, 48, 1, 2, 4)
    assert torch.allclose(ours[:, :, :1], cond.tensors["first_frame"], atol=1e-6, rtol=0)
    other = ti2v_latents(model, 255 - IMAGE[None])
    assert not torch.allclose(ours[:, :, 1:], other[:, :, 1:], atol=1e-3)
    # the held frame's tokens are at timestep 0, the rest at t; its velocity is (x - c) / σ, the
    # same whatever the weights, so its elements add nothing to log r
    seen = []
    hook = model.transformer.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["timestep"]), with_kwargs=True)
    x, sigma = torch.randn(1, *model.latent_shape), torch.tensor([0.75])
    with torch.no_grad():
        v = model.velocity(x, sigma, cond)
        for p in model.transformer.parameters():
            p.add_(0.1 * torch.randn_like(p))
        v2 = model.velocity(x, sigma, cond)
    hook.remove()
    assert torch.equal(seen[0][0], torch.tensor([0.0, 0.0, 750.0, 750.0, 750.0, 750.0]))
    assert torch.allclose(v[:, :, :1], (x[:, :, :1] - cond.tensors["first_frame"]) / 0.75, atol=1e-6)
    assert torch.equal(v[:, :, :1], v2[:, :, :1]) and not torch.allclose(v[:, :, 1:], v2[:, :, 1:])


def test_wan22_ti2v_5b_learner_build_and_shape_checks():
    """The learner's transformer-only build keeps per-token timesteps (same velocities); sizes off
    the 32-pixel grid of the 16x VAE and 2x2 patch are refused."""
    comps = tiny_wan_components("ti2v_5b")
    full = WanVideoModel.from_components(comps, wan_cfg(task="i2v", **TI2V))
    lean = WanVideoModel.from_components(comps, wan_cfg(task="i2v", **TI2V), parts="transformer")
    assert lean.expand_timesteps and lean.latent_shape == full.latent_shape
    cond = full.encode(["a"], IMAGE[None])
    x = torch.randn(2, *full.latent_shape)
    with torch.no_grad():
        assert torch.equal(full.velocity(x, torch.tensor([0.9, 0.3]), cond.repeat(2)),
                           lean.velocity(x, torch.tensor([0.9, 0.3]), cond.repeat(2)))
    with pytest.raises(ValueError, match="multiples of 32"):
        WanVideoModel.from_components(tiny_wan_components("ti2v_5b"), wan_cfg(num_frames=9, height=48, width=64))
