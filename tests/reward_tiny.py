"""Tiny random Qwen2-VL / Qwen3-VL configs and a character-level tokenizer, built in code.

They are the same transformers classes as the real scorers, shrunk so a whole forward takes
milliseconds. The tokenizer knows the Qwen chat and vision tokens.
"""

from __future__ import annotations

import torch

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|image_pad|>", "<|video_pad|>"]


def char_tokenizer():
    """Printable ASCII and newline, one token per character, plus the Qwen special tokens."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = ["[UNK]", "\n"] + [chr(c) for c in range(32, 127)]
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    fast.add_tokens(QWEN_SPECIALS, special_tokens=True)
    fast.pad_token = "<|endoftext|>"
    return fast


def _ids(tok) -> dict:
    c = tok.convert_tokens_to_ids
    return dict(image_token_id=c("<|image_pad|>"), video_token_id=c("<|video_pad|>"),
                vision_start_token_id=c("<|vision_start|>"), vision_end_token_id=c("<|vision_end|>"))


def _text(tok, vocab: int, **extra) -> dict:
    return dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                pad_token_id=tok.pad_token_id, bos_token_id=tok.pad_token_id,
                eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), **extra)


def qwen2_vl_config(tok, extra_vocab: int = 0):
    from transformers import Qwen2VLConfig

    torch.manual_seed(0)
    return Qwen2VLConfig(
        text_config=_text(tok, len(tok) + extra_vocab,
                          rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=32, num_heads=4, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
        **_ids(tok))


def qwen3_vl_config(tok):
    from transformers import Qwen3VLConfig

    return Qwen3VLConfig(
        text_config=_text(tok, len(tok), head_dim=8,
                          rope_scaling={"rope_type": "default", "mrope_section": [1, 1, 2],
                                        "mrope_interleaved": True}),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=32,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                           num_position_embeddings=64, deepstack_visual_indexes=[0]),
        **_ids(tok))


def videos(b: int, f: int = 6, h: int = 20, w: int = 24, seed: int = 0) -> torch.Tensor:
    """Random uint8 videos [B, F, H, W, 3]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, f, h, w, 3), dtype=torch.uint8, generator=g)
