"""HunyuanVideo 1.5's joint attention without diffusers' dense S×S mask.

diffusers 0.42's `HunyuanVideo15AttnProcessor2_0` turns the encoder tokens' validity [B, L] into a
[B, 1, S, S] boolean mask in every block (S = video + text + image tokens: about 35k at 480p, so
about 1.2 GB per row for each of the two tensors it builds), and a masked SDPA call cannot take
the flash kernels. The transformer moves every row's valid encoder tokens ahead of its padding,
and a valid query never attends to a padded key, so only the keys need the mask: this processor
passes a key mask [B, 1, 1, S] where a row has padding, and no mask at all where no row has any
(then SDPA is free to take a fused kernel). A video token's output is the same; only the padded
tokens' own states differ (diffusers zeroes their attention, here they attend to the valid keys),
and they are never read by a valid token and dropped after the last block.

Projections, norms, RoPE and the output split follow the transformer's own attention module
(`attn.to_q`, `attn.add_q_proj`, …), so LoRA adapters on those layers apply unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def key_mask(encoder_mask: Tensor | None, seq_len: int) -> Tensor | None:
    """The keys a query may attend to, [B, 1, 1, S] over S = seq_len tokens (the video tokens
    first, always valid, then the L encoder tokens), or None where no token of the batch is padding."""
    if encoder_mask is None:
        return None
    valid = encoder_mask.bool()
    if bool(valid.all()):
        return None
    valid = F.pad(valid, (seq_len - valid.shape[1], 0), value=True)
    return valid[:, None, None, :]


def _heads(attn, x: Tensor) -> Tensor:
    return x.unflatten(2, (attn.heads, -1))  # [B, N, H, D]


class KeyMaskJointAttnProcessor:
    """Joint video + encoder attention for HunyuanVideo 1.5's transformer blocks (see module doc)."""

    _attention_backend = None  # diffusers' attention-backend hooks set these, as on its processors
    _parallel_config = None

    def __call__(self, attn, hidden_states: Tensor, encoder_hidden_states: Tensor,
                 attention_mask: Tensor | None = None, image_rotary_emb=None) -> tuple[Tensor, Tensor]:
        # heavy: diffusers
        from diffusers.models.attention_dispatch import dispatch_attention_fn
        from diffusers.models.embeddings import apply_rotary_emb

        # 1. Video stream: projections, QK norms, RoPE
        q, k, v = (_heads(attn, f(hidden_states)) for f in (attn.to_q, attn.to_k, attn.to_v))
        q, k = attn.norm_q(q), attn.norm_k(k)
        if image_rotary_emb is not None:
            q = apply_rotary_emb(q, image_rotary_emb, sequence_dim=1)
            k = apply_rotary_emb(k, image_rotary_emb, sequence_dim=1)
        # 2. Encoder stream (text and image tokens), appended after the video tokens
        eq, ek, ev = (_heads(attn, f(encoder_hidden_states))
                      for f in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
        if attn.norm_added_q is not None:
            eq = attn.norm_added_q(eq)
        if attn.norm_added_k is not None:
            ek = attn.norm_added_k(ek)
        q, k, v = torch.cat([q, eq], dim=1), torch.cat([k, ek], dim=1), torch.cat([v, ev], dim=1)
        # 3. Attention: a key mask where something is padded, else none
        out = dispatch_attention_fn(q, k, v, attn_mask=key_mask(attention_mask, q.shape[1]), dropout_p=0.0,
                                    is_causal=False, backend=self._attention_backend,
                                    parallel_config=self._parallel_config)
        out = out.flatten(2, 3).to(q.dtype)
        # 4. Split the streams and project each out
        split = out.shape[1] - encoder_hidden_states.shape[1]
        video, context = out[:, :split].contiguous(), out[:, split:].contiguous()
        return attn.to_out[1](attn.to_out[0](video)), attn.to_add_out(context)


def use_key_mask_attention(transformer) -> int:
    """Swap every joint-attention processor of a HunyuanVideo15Transformer3DModel for
    `KeyMaskJointAttnProcessor`; returns how many were swapped (one per transformer block)."""
    # heavy: diffusers
    from diffusers.models.transformers.transformer_hunyuan_video15 import (
        HunyuanVideo15AttnProcessor2_0,
    )

    swapped = 0
    for module in transformer.modules():
        if isinstance(getattr(module, "processor", None), HunyuanVideo15AttnProcessor2_0):
            module.set_processor(KeyMaskJointAttnProcessor())
            swapped += 1
    return swapped
