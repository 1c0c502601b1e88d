"""Tiny, randomly initialised components of the real model classes, built in code.

Tests and benchmarks use these in place of checkpoints (nothing is downloaded), as
diffusers' own fast tests do. The tokenizers are character-level `tokenizers` models
wrapped in `PreTrainedTokenizerFast`, so they save and load like real ones.
"""

from __future__ import annotations

from typing import Literal

import torch

from common.config import ModelConfig
from rollout_worker.models.wan import WanVideoModel

_SPECIALS = ["<pad>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOKENIZER_VOCAB = len(_SPECIALS) + 95  # specials + printable ASCII


def char_tokenizer(chat: bool = False):
    """A character-level tokenizer (printable ASCII) that appends </s>; `chat` adds a chat template."""
    # heavy: transformers, tokenizers
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(_SPECIALS)}
    for c in range(32, 127):
        vocab.setdefault(chr(c), len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    if not chat:
        tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                   unk_token="<unk>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    if chat:
        fast.chat_template = _CHAT_TEMPLATE
    return fast


# --- Wan 2.x ---------------------------------------------------------------------------


def tiny_wan_transformer(in_channels: int = 4, out_channels: int = 4, image_dim: int | None = None,
                         seed: int = 0, layers: int = 1):
    from diffusers import WanTransformer3DModel  # heavy: diffusers

    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=in_channels,
        out_channels=out_channels, text_dim=16, freq_dim=16, ffn_dim=16, num_layers=layers,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", image_dim=image_dim,
        added_kv_proj_dim=16 if image_dim is not None else None, rope_max_seq_len=32,
    ).eval()


WanVariant = Literal["t2v", "i2v", "t2v_a14b", "i2v_a14b", "ti2v_5b"]


def tiny_wan22_vae(z: int = 48):
    """The Wan 2.2 VAE of TI2V-5B at a tiny width: residual stages over a 2x2 patchify (12 input
    channels), `z` latent channels, 16x spatial and 4x temporal compression (its real config
    keys, common/families.py, with base_dim 4 for 160)."""
    from diffusers import AutoencoderKLWan  # heavy: diffusers

    gen = torch.Generator().manual_seed(1)
    mean = (torch.rand(z, generator=gen) - 0.5).tolist()
    std = (0.5 + torch.rand(z, generator=gen)).tolist()
    torch.manual_seed(0)
    return AutoencoderKLWan(base_dim=4, decoder_base_dim=8, z_dim=z, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                            temperal_downsample=[False, True, True], is_residual=True, in_channels=12,
                            out_channels=12, patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4,
                            latents_mean=mean, latents_std=std).eval()


def tiny_wan_components(variant: WanVariant = "t2v", layers: int = 1) -> dict:
    """Components for WanPipeline / WanImageToVideoPipeline (z_dim 4, `layers` blocks, 2 heads × 8).

    `i2v` is Wan 2.1 I2V (CLIP image encoder, mask + condition channels); `t2v_a14b` is
    Wan 2.2 with two experts and a boundary; `i2v_a14b` is Wan 2.2 I2V-A14B: two experts that
    take mask + condition channels and no CLIP image encoder (image_dim None); `ti2v_5b` is
    Wan 2.2 TI2V-5B, for either pipeline: one transformer over the Wan 2.2 VAE's 48 latent
    channels (16x spatial: heights and widths in multiples of 32) with per-token timesteps
    (expand_timesteps), no CLIP.
    """
    # heavy: diffusers, transformers
    from diffusers import AutoencoderKLWan
    from transformers import UMT5Config, UMT5EncoderModel

    z = 48 if variant == "ti2v_5b" else 4
    torch.manual_seed(0)
    vae = tiny_wan22_vae(z) if variant == "ti2v_5b" else AutoencoderKLWan(
        base_dim=4, z_dim=z, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
        latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.7, 1.2, 2.0]).eval()
    torch.manual_seed(0)
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=TOKENIZER_VOCAB, d_model=16, d_kv=8, d_ff=16, num_layers=1, num_heads=2,
        relative_attention_num_buckets=8, decoder_start_token_id=0)).eval()
    comps = {"vae": vae, "text_encoder": text_encoder, "tokenizer": char_tokenizer()}
    if variant == "i2v":
        # heavy: transformers
        from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

        torch.manual_seed(0)
        comps["image_encoder"] = CLIPVisionModel(CLIPVisionConfig(
            hidden_size=8, projection_dim=8, num_hidden_layers=2, num_attention_heads=2,
            image_size=16, intermediate_size=8, patch_size=8)).eval()
        comps["image_processor"] = CLIPImageProcessor(crop_size=16, size={"shortest_edge": 16})
        comps["transformer"] = tiny_wan_transformer(2 * z + 4, z, image_dim=8, layers=layers)
    elif variant == "i2v_a14b":
        comps["transformer"] = tiny_wan_transformer(2 * z + 4, z, layers=layers)
        comps["transformer_2"] = tiny_wan_transformer(2 * z + 4, z, seed=1, layers=layers)
        comps["image_encoder"] = comps["image_processor"] = None
        comps["boundary_ratio"] = 0.6
    elif variant == "ti2v_5b":  # the same transformer serves T2V and I2V: [x] in, 48 channels
        comps["transformer"] = tiny_wan_transformer(z, z, layers=layers)
        comps["expand_timesteps"] = True
    else:
        comps["transformer"] = tiny_wan_transformer(z, z, layers=layers)
    if variant == "t2v_a14b":
        comps["transformer_2"] = tiny_wan_transformer(z, z, seed=1, layers=layers)
        comps["boundary_ratio"] = 0.6
    return comps


# --- HunyuanVideo 1.5 --------------------------------------------------------------------


def tiny_hunyuan15_components(task: Literal["t2v", "i2v"] = "t2v", layers: int = 1) -> dict:
    """Components for HunyuanVideo15Pipeline / …ImageToVideoPipeline (`layers` blocks, 2 heads × 8)."""
    # heavy: diffusers, transformers
    from diffusers import AutoencoderKLHunyuanVideo15, HunyuanVideo15Transformer3DModel
    from transformers import (
        ByT5Tokenizer,
        Qwen2_5_VLTextConfig,
        Qwen2_5_VLTextModel,
        T5Config,
        T5EncoderModel,
    )

    torch.manual_seed(0)
    transformer = HunyuanVideo15Transformer3DModel(
        in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=layers,
        num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1, text_embed_dim=16,
        text_embed_2_dim=16, image_embed_dim=12, rope_axes_dim=(2, 2, 4), target_size=16,
        task_type=task).eval()
    torch.manual_seed(0)
    vae = AutoencoderKLHunyuanVideo15(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8), layers_per_block=1,
        spatial_compression_ratio=4, temporal_compression_ratio=2, downsample_match_channel=False,
        upsample_match_channel=False).eval()
    torch.manual_seed(0)
    text_encoder = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
        vocab_size=TOKENIZER_VOCAB, hidden_size=16, intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2,
        rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
        rope_theta=1e6, bos_token_id=None, eos_token_id=None)).eval()
    torch.manual_seed(0)
    text_encoder_2 = T5EncoderModel(T5Config(
        vocab_size=384, d_model=16, d_kv=8, d_ff=16, num_layers=1, num_heads=2,
        relative_attention_num_buckets=8)).eval()
    comps = {"transformer": transformer, "vae": vae, "text_encoder": text_encoder,
             "tokenizer": char_tokenizer(chat=True), "text_encoder_2": text_encoder_2,
             "tokenizer_2": ByT5Tokenizer()}
    if task == "i2v":
        # heavy: transformers
        from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

        torch.manual_seed(0)
        comps["image_encoder"] = SiglipVisionModel(SiglipVisionConfig(
            hidden_size=12, intermediate_size=12, num_hidden_layers=1, num_attention_heads=2,
            image_size=16, patch_size=8)).eval()
        comps["feature_extractor"] = SiglipImageProcessor(size={"height": 16, "width": 16})
    return comps


def tiny_wan_model(model: dict, variant: WanVariant = "t2v", layers: int = 1):
    """The Wan adapter over `tiny_wan_components(variant)` with ModelConfig fields `model`
    (a plain function of plain data, so it ships to Ray actors as a model factory)."""
    return WanVideoModel.from_components(tiny_wan_components(variant, layers), ModelConfig.model_validate(model))
