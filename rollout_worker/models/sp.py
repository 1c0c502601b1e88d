"""Sequence parallelism (Ulysses) for the video transformers.

`sp` processes run one transformer forward together. Each holds the whole model and the whole
input; after the patch embedding the video tokens are cut into `sp` contiguous chunks, each
self-attention swaps the cut from tokens to heads (one all-to-all for q, k, v and one back for
the output), and the output projection gathers the tokens again, so every rank returns the
full velocity.

- Wan 2.1 / 2.2: diffusers' own context parallelism, `enable_parallelism` with
  `ContextParallelConfig(ulysses_degree=sp)` and the class's `_cp_plan` (cross-attention keeps
  the whole text on every rank).
- HunyuanVideo 1.5: diffusers has no `_cp_plan` for it, so `HUNYUAN15_CP_PLAN` is this
  project's. Its blocks attend over [video; text] jointly: the text stream stays whole on every
  rank (its length, 1000 + 256 + 729 tokens at release, is odd, so it cannot be cut evenly), and
  `HunyuanSPAttnProcessor` joins each rank's head slice of the text to the all-to-all'ed video,
  then gathers the text output over heads.

Gradients: diffusers' output gather hands each rank its own chunk's gradient, so a rank's
weight gradients are its tokens' share of the full gradient and their sum over the SP ranks is
the full gradient (the learner's FSDP reduce-scatter sums them; learner/fsdp.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from diffusers.models._modeling_parallel import (
    ContextParallelConfig,
    ContextParallelInput,
    ContextParallelOutput,
)
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh

from common.errors import UserError


class SPConfigError(UserError, ValueError):
    """A model that cannot be split over `parallel.sp` ranks; the message names the field."""


@contextmanager
def _cpu_counts_as_one_device() -> Iterator[None]:
    """The one patch of this module: diffusers' `_resolve_parallel_config` computes
    `rank % torch.accelerator.device_count()`, which divides by zero on a CPU-only host (gloo
    tests, CPU runs). For its duration the CPU counts as one device; a host with an
    accelerator is left untouched."""
    real = torch.accelerator.device_count
    if real() > 0:
        yield
        return
    torch.accelerator.device_count = lambda: 1
    try:
        yield
    finally:
        torch.accelerator.device_count = real


def sp_mesh(sp: int, device_type: str = "cpu"):
    """A ("ring", "ulysses") = (1, sp) mesh over the whole default group (a rollout SP group)."""
    return init_device_mesh(device_type, (1, sp), mesh_dim_names=("ring", "ulysses"))


def video_tokens(transformer: nn.Module, latent_shape: tuple[int, int, int, int]) -> int:
    """Video tokens of one sample: latent (F, H, W) divided by the transformer's patch."""
    c = transformer.config
    if isinstance(c.patch_size, int):  # HunyuanVideo 1.5: spatial patch_size, temporal patch_size_t
        patch = (c.get("patch_size_t", 1), c.patch_size, c.patch_size)
    else:
        patch = tuple(c.patch_size)
    _, f, h, w = latent_shape
    return (f // patch[0]) * (h // patch[1]) * (w // patch[2])


def check_splittable(transformer: nn.Module, tokens: int, sp: int, field: str) -> None:
    """Heads and video tokens must divide evenly over the SP ranks (one line naming `field`)."""
    heads = transformer.config.num_attention_heads
    if heads % sp:
        raise SPConfigError(f"{field} = {sp}: the transformer's {heads} attention heads do not divide "
                            f"over {sp} ranks; use a divisor of {heads}")
    if tokens % sp:
        raise SPConfigError(f"{field} = {sp}: the {tokens} video tokens of one sample do not divide over "
                            f"{sp} ranks; change model.num_frames/height/width or {field}")


def sp_degree(transformers: list[nn.Module]) -> int:
    """The SP degree the transformers run at (1 where SP is off), read from diffusers' config."""
    degrees = {1 if getattr(t, "_parallel_config", None) is None
               else t._parallel_config.context_parallel_config.ulysses_degree for t in transformers}
    if len(degrees) != 1:
        raise RuntimeError(f"the transformers run at different SP degrees {sorted(degrees)}")
    return degrees.pop()


def _check_cp_backend(transformer: nn.Module, sp: int) -> None:
    """diffusers' context-parallel attention runs only on some backends (not flash 3 in 0.42)."""
    # heavy: diffusers
    import diffusers
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    backend = next((m.processor._attention_backend for m in transformer.modules()
                    if getattr(getattr(m, "processor", None), "_attention_backend", None) is not None), None)
    name = AttentionBackendName(backend) if backend is not None else _AttentionBackendRegistry.get_active_backend()[0]
    if not _AttentionBackendRegistry._is_context_parallel_available(name):
        raise SPConfigError(f"parallel.sp = {sp}: diffusers {diffusers.__version__} has no sequence-parallel "
                            f"attention on backend {name.value!r} (model.attention_backend); use native, flash "
                            "or sage with parallel.sp > 1")


def enable_sp(transformer: nn.Module, mesh) -> None:
    """Turn on Ulysses SP over `mesh` (dims "ring" of size 1 and "ulysses" of size sp) in place.

    Call after LoRA injection (a LoRA wrapper around a hooked module would bypass its hook) and
    with every rank of the mesh at once (it builds the mesh's flattened group)."""
    # heavy: diffusers
    from diffusers import HunyuanVideo15Transformer3DModel, WanTransformer3DModel

    sp = mesh["ulysses"].size()
    config = ContextParallelConfig(ulysses_degree=sp, mesh=mesh)
    if isinstance(transformer, WanTransformer3DModel):
        _check_cp_backend(transformer, sp)
        plan = None  # the class's own _cp_plan
    elif isinstance(transformer, HunyuanVideo15Transformer3DModel):
        plan = HUNYUAN15_CP_PLAN
        for block in transformer.transformer_blocks:
            block.attn.set_processor(HunyuanSPAttnProcessor())
    else:
        raise SPConfigError(f"parallel.sp > 1: {type(transformer).__name__} has no sequence-parallel plan "
                            "(Wan and HunyuanVideo 1.5 have one)")
    with _cpu_counts_as_one_device():
        transformer.enable_parallelism(config=config, cp_plan=plan)


# --- HunyuanVideo 1.5 ------------------------------------------------------------------------


_SPLIT_ROPE = ContextParallelInput(split_dim=0, expected_dims=2, split_output=True)
HUNYUAN15_CP_PLAN = {
    # RoPE's (cos, sin), [N, D] each: every rank keeps its tokens' rows
    "rope": {0: _SPLIT_ROPE, 1: _SPLIT_ROPE},
    # the patch-embedded video [B, N, D] is cut before the first block; the text is not
    "transformer_blocks.0": {
        "hidden_states": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)},
    # the head's output [B, N/sp, p·C] is gathered back to every rank
    "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
}


def _seq_to_heads(x: Tensor, group, sp: int) -> Tensor:
    """[B, n, H, D] (this rank's tokens, all heads) → [B, n·sp, H/sp, D] (all tokens, its heads)."""
    B, n, H, D = x.shape
    x = x.reshape(B, n, sp, H // sp, D).permute(2, 1, 0, 3, 4).reshape(sp * n, B, H // sp, D).contiguous()
    x = funcol.wait_tensor(funcol.all_to_all_single(x, None, None, group))  # chunk i: rank i's tokens
    return x.permute(1, 0, 2, 3).contiguous()


def _heads_to_seq(x: Tensor, group, sp: int) -> Tensor:
    """The inverse of `_seq_to_heads`: [B, n·sp, H/sp, D] → [B, n, H, D]."""
    B, N, h, D = x.shape
    x = x.reshape(B, sp, N // sp, h, D).permute(1, 2, 0, 3, 4).reshape(N, B, h, D).contiguous()
    x = funcol.wait_tensor(funcol.all_to_all_single(x, None, None, group))  # chunk i: head slice i
    return x.reshape(sp, N // sp, B, h, D).permute(2, 1, 0, 3, 4).reshape(B, N // sp, sp * h, D)


class _GatherHeads(torch.autograd.Function):
    """All-gather over heads ([B, L, H/sp, D] → [B, L, H, D]) of a stream every rank continues
    with whole. Backward: each rank's gradient of the whole is its share (it computes only its
    part of what follows), so a head slice's gradient is their sum over the ranks."""

    @staticmethod
    def forward(ctx, x: Tensor, group, sp: int, rank: int) -> Tensor:
        ctx.group, ctx.sp, ctx.rank = group, sp, rank
        parts = [torch.empty_like(x) for _ in range(sp)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.sp, dim=2)[ctx.rank].contiguous(), None, None, None


class HunyuanSPAttnProcessor:
    """HunyuanVideo 1.5's joint attention over [video; text] with the video cut over SP ranks.

    Without a parallel config it is diffusers' own processor. With one: the video q/k/v go
    through the Ulysses all-to-all (all tokens, H/sp heads); the text, whole on every rank,
    contributes its rank's head slice; attention runs over [video; text] with a key mask (text
    padding masked; padded text rows are never read by a video token, so only the key side is
    masked); the video output goes back by all-to-all and the text output is gathered over heads.
    """

    _attention_backend = None
    _parallel_config = None

    def __init__(self) -> None:
        # heavy: diffusers
        from diffusers.models.transformers.transformer_hunyuan_video15 import (
            HunyuanVideo15AttnProcessor2_0,
        )

        self._base = HunyuanVideo15AttnProcessor2_0()

    def __call__(self, attn, hidden_states: Tensor, encoder_hidden_states: Tensor | None = None,
                 attention_mask: Tensor | None = None, image_rotary_emb=None):
        if self._parallel_config is None or encoder_hidden_states is None:
            self._base._attention_backend = self._attention_backend
            return self._base(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        # heavy: diffusers
        from diffusers.models.attention_dispatch import dispatch_attention_fn
        from diffusers.models.embeddings import apply_rotary_emb

        cp = self._parallel_config.context_parallel_config
        group, sp, rank = cp._ulysses_mesh.get_group(), cp.ulysses_degree, cp._ulysses_local_rank
        # 1. projections, norms, RoPE on this rank's video tokens (as diffusers' processor)
        q, k, v = (proj(hidden_states).unflatten(2, (attn.heads, -1)) for proj in (attn.to_q, attn.to_k, attn.to_v))
        q, k = attn.norm_q(q), attn.norm_k(k)
        if image_rotary_emb is not None:
            q = apply_rotary_emb(q, image_rotary_emb, sequence_dim=1)
            k = apply_rotary_emb(k, image_rotary_emb, sequence_dim=1)
        e = encoder_hidden_states
        eq, ek, ev = (proj(e).unflatten(2, (attn.heads, -1)) for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
        if attn.norm_added_q is not None:
            eq = attn.norm_added_q(eq)
        if attn.norm_added_k is not None:
            ek = attn.norm_added_k(ek)
        # 2. video: all tokens, this rank's heads; text: this rank's heads
        h = attn.heads // sp
        cut = slice(rank * h, (rank + 1) * h)
        q, k, v = (_seq_to_heads(t, group, sp) for t in (q, k, v))               # [B, N, H/sp, D]
        n_video = q.shape[1]
        q, k, v = (torch.cat([a, b[:, :, cut]], dim=1) for a, b in ((q, eq), (k, ek), (v, ev)))
        keys = torch.cat([torch.ones(q.shape[0], n_video, dtype=torch.bool, device=q.device),
                          attention_mask.bool()], dim=1)                          # [B, N + L]
        out = dispatch_attention_fn(q, k, v, attn_mask=keys[:, None, None, :], dropout_p=0.0, is_causal=False,
                                    backend=self._attention_backend)              # [B, N + L, H/sp, D]
        # 3. video back to this rank's tokens (all heads); text gathered over heads
        video = _heads_to_seq(out[:, :n_video], group, sp).flatten(2, 3).to(q.dtype)
        text = _GatherHeads.apply(out[:, n_video:].contiguous(), group, sp, rank).flatten(2, 3).to(q.dtype)
        video = attn.to_out[1](attn.to_out[0](video))
        text = attn.to_add_out(text)
        return video, text
