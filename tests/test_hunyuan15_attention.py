"""HunyuanVideo 1.5 without diffusers' dense S×S mask: a key mask where something is padded, no
mask where nothing is, and the same output as diffusers' own processor either way.

The reference is an untouched copy of the same tiny HunyuanVideo15Transformer3DModel (diffusers'
HunyuanVideo15AttnProcessor2_0, the dense mask) called as HunyuanVideo15Pipeline calls it.
"""

from __future__ import annotations

import copy

import pytest
import torch

import rollout_worker.models.hunyuan15_attention as hattn
from common.config import ModelConfig
from rollout_worker.models.hunyuan15 import Hunyuan15VideoModel
from rollout_worker.models.tiny import tiny_hunyuan15_components

B, L, L2, IMG = 3, 6, 5, 4  # rows, Qwen tokens, ByT5 tokens, image tokens


@pytest.fixture
def masks_seen(monkeypatch) -> list:
    """Every key mask the processor passes to attention (None: no mask), one per block call."""
    seen, real = [], hattn.key_mask

    def spy(mask, seq_len):
        out = real(mask, seq_len)
        seen.append(out)
        return out

    monkeypatch.setattr(hattn, "key_mask", spy)
    return seen


def pair(task: str = "i2v"):
    """(diffusers' transformer, the same weights with the key-mask processor)."""
    ref = tiny_hunyuan15_components(task)["transformer"].float()
    ours = copy.deepcopy(ref)
    assert hattn.use_key_mask_attention(ours) == len(ours.transformer_blocks)
    return ref, ours


def inputs(qwen_valid: list[int], byt5_valid: list[int], image: bool) -> dict:
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1] * n + [0] * (L - n) for n in qwen_valid])
    mask2 = torch.tensor([[1] * n + [0] * (L2 - n) for n in byt5_valid])
    return {"hidden_states": torch.randn(B, 9, 2, 4, 4, generator=g), "timestep": torch.tensor([900.0, 500.0, 20.0]),
            "encoder_hidden_states": torch.randn(B, L, 16, generator=g), "encoder_attention_mask": mask,
            "encoder_hidden_states_2": torch.randn(B, L2, 16, generator=g), "encoder_attention_mask_2": mask2,
            "image_embeds": torch.randn(B, IMG, 12, generator=g) if image else torch.zeros(B, IMG, 12)}


@torch.no_grad()
def test_nothing_padded_runs_without_a_mask_and_matches_diffusers(masks_seen):
    ref, ours = pair("i2v")
    x = inputs([L] * B, [L2] * B, image=True)  # I2V: every image token valid, no text padding
    want = ref(**x, return_dict=False)[0]
    got = ours(**x, return_dict=False)[0]
    assert masks_seen and all(m is None for m in masks_seen)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), float((got - want).abs().max())


@pytest.mark.parametrize(("qwen", "byt5", "image"), [([L, 3, 1], [L2] * B, True), ([L] * B, [2, 0, L2], True),
                                                      ([L] * B, [L2] * B, False)])
@torch.no_grad()
def test_padded_rows_keep_a_key_mask_and_match_diffusers(masks_seen, qwen, byt5, image):
    """Padding in a row (or T2V's image tokens, always masked) keeps a mask: a key mask
    [B, 1, 1, S] with exactly the padded encoder tokens off."""
    ref, ours = pair("i2v" if image else "t2v")
    x = inputs(qwen, byt5, image)
    want = ref(**x, return_dict=False)[0]
    got = ours(**x, return_dict=False)[0]
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), float((got - want).abs().max())
    video = 2 * 4 * 4
    valid = [q + b + (IMG if image else 0) for q, b in zip(qwen, byt5, strict=True)]
    for m in masks_seen:
        assert m is not None and m.shape == (B, 1, 1, video + L + L2 + IMG)
        assert m[:, 0, 0, :video].all() and m.sum(-1).flatten().tolist() == [video + n for n in valid]


def hy_model(task: str, guidance: float) -> Hunyuan15VideoModel:
    cfg = ModelConfig(family="hunyuan15", task=task, num_frames=5, height=16, width=16, guidance_scale=guidance)
    return Hunyuan15VideoModel.from_components(tiny_hunyuan15_components(task), cfg)


def reference_velocity(model: Hunyuan15VideoModel, ref, x, sigma: float, cond) -> torch.Tensor:
    """v as HunyuanVideo15Pipeline computes it with diffusers' processor: [x, cond latents, mask],
    the untrimmed text states and masks, one forward over [cond; uncond] and the guider's mix."""
    c, u = cond.tensors, cond.uncond
    n = x.shape[0]
    x_in = torch.cat([x, c["cond_latents"], c["mask"]], dim=1)
    keys = ("encoder_hidden_states", "encoder_attention_mask", "encoder_hidden_states_2", "encoder_attention_mask_2")
    kw = {k: c[k] for k in keys}
    img, t = c["image_embeds"], torch.full((n,), sigma * 1000.0)
    if u is not None:
        kw = {k: torch.cat([v, u[k]]) for k, v in kw.items()}
        x_in, img, t = torch.cat([x_in, x_in]), torch.cat([img, img]), torch.cat([t, t])
    out = ref(hidden_states=x_in, image_embeds=img, timestep=t, return_dict=False, **kw)[0]
    if u is None:
        return out
    return out[n:] + model.guidance_scale * (out[:n] - out[n:])


@pytest.mark.parametrize(("task", "guidance", "prompts"), [
    ("t2v", 1.0, ["a red cat"] * 2), ("i2v", 1.0, ["a red cat"] * 2), ("t2v", 3.0, ["a red cat"] * 2),
    ("i2v", 3.0, ["a red cat"] * 2), ("t2v", 3.0, ["a red cat", "a dog running on the beach"])])
@torch.no_grad()
def test_adapter_drops_padding_and_matches_diffusers(masks_seen, task, guidance, prompts):
    """The adapter runs one forward per set of rows with the same text masks (a group's cond rows,
    the uncond rows, each prompt of an evaluation share), without the text padding and T2V's
    image tokens: nothing is padded, so no block gets a mask. The result equals diffusers'
    dense-mask forward over all rows with their padding."""
    from diffusers.models.transformers.transformer_hunyuan_video15 import (
        HunyuanVideo15AttnProcessor2_0,
    )

    model = hy_model(task, guidance)
    ref = copy.deepcopy(model.transformer)  # the same weights, back on diffusers' own processor
    for mod in ref.modules():
        if isinstance(getattr(mod, "processor", None), hattn.KeyMaskJointAttnProcessor):
            mod.set_processor(HunyuanVideo15AttnProcessor2_0())
    images = torch.randint(0, 256, (2, 16, 16, 3), dtype=torch.uint8) if task == "i2v" else None
    cond = model.encode(prompts, images, negative_prompts=["blurry, low quality, static"] * 2)
    assert cond.tensors["encoder_attention_mask"].float().mean() < 0.5  # mostly padding, as encoded
    x = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(1))
    got = model.velocity(x, torch.tensor([0.7, 0.7]), cond)
    # a forward per distinct prompt, then (CFG) one for the uncond rows (one negative prompt)
    forwards = len(set(prompts)) + (1 if guidance > 1 else 0)
    assert len(masks_seen) == forwards * len(model.transformer.transformer_blocks)
    assert all(m is None for m in masks_seen)
    masks_seen.clear()
    want = reference_velocity(model, ref, x, 0.7, cond)
    assert not masks_seen  # the reference ran diffusers' own processor
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), float((got - want).abs().max())


def test_key_mask_is_none_only_where_nothing_is_padded():
    assert hattn.key_mask(None, 10) is None
    assert hattn.key_mask(torch.ones(2, 4, dtype=torch.long), 10) is None
    m = hattn.key_mask(torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]]), 10)
    assert m.shape == (2, 1, 1, 10) and m.dtype == torch.bool
    assert m[0, 0, 0].tolist() == [True] * 8 + [False] * 2 and m[1].all()


def test_gradients_match_diffusers_on_padded_rows():
    """The learner trains through this processor: its weight gradients are diffusers' (video loss)."""
    ref, ours = pair("t2v")
    x = inputs([L, 3, 1], [2, 0, L2], image=False)
    for t in (ref, ours):
        t(**x, return_dict=False)[0].square().mean().backward()
    for (name, a), (_, b) in zip(ref.named_parameters(), ours.named_parameters(), strict=True):
        if a.grad is not None or b.grad is not None:
            assert torch.allclose(a.grad, b.grad, atol=1e-6, rtol=1e-4), name


def test_adapter_gradients_match_diffusers_on_rows_of_two_prompts():
    """A learner micro-batch mixes conditions: the adapter's per-text forwards are differentiable
    and give diffusers' weight gradients (dense-mask forward over all rows)."""
    from diffusers.models.transformers.transformer_hunyuan_video15 import (
        HunyuanVideo15AttnProcessor2_0,
    )

    model = hy_model("t2v", 3.0)
    ref = copy.deepcopy(model.transformer)
    for mod in ref.modules():
        if isinstance(getattr(mod, "processor", None), hattn.KeyMaskJointAttnProcessor):
            mod.set_processor(HunyuanVideo15AttnProcessor2_0())
    cond = model.encode(["a red cat", "a dog running on the beach"])
    x = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(2))
    model.velocity(x, torch.tensor([0.7, 0.4]), cond).square().mean().backward()
    c, u = cond.tensors, cond.uncond
    x_in = torch.cat([x, c["cond_latents"], c["mask"]], dim=1)
    keys = ("encoder_hidden_states", "encoder_attention_mask", "encoder_hidden_states_2", "encoder_attention_mask_2")
    out = ref(hidden_states=torch.cat([x_in, x_in]), image_embeds=torch.cat([c["image_embeds"]] * 2),
              timestep=torch.tensor([700.0, 400.0, 700.0, 400.0]), return_dict=False,
              **{k: torch.cat([c[k], u[k]]) for k in keys})[0]
    (out[2:] + 3.0 * (out[:2] - out[2:])).square().mean().backward()
    for (name, a), (_, b) in zip(ref.named_parameters(), model.transformer.named_parameters(), strict=True):
        if a.grad is not None or b.grad is not None:
            assert torch.allclose(a.grad, b.grad, atol=1e-6, rtol=1e-4), name
