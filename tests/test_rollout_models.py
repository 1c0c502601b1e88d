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
