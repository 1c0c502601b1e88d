"""A tiny pixel-space VideoModel around a randomly initialised diffusers WanTransformer3DModel,
plus a minimal group sampler, for fast learner tests (and anyone else who needs one).

The "text encoder" is a fixed random embedding of the prompt's bytes: deterministic, frozen.
"""

from __future__ import annotations

import hashlib

import torch
from diffusers import WanTransformer3DModel
from torch import Tensor, nn

from common.sde import Schedule, make_scheme, sample_step
from common.types import Cond, Condition, Group, Trajectory
from rollout_worker.models.base import VideoModel

TEXT_DIM, TEXT_LEN = 16, 4


def tiny_wan(seed: int = 0, channels: int = 3, layers: int = 1) -> WanTransformer3DModel:
    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=channels,
        out_channels=channels, text_dim=TEXT_DIM, freq_dim=16, ffn_dim=32, num_layers=layers,
        rope_max_seq_len=32,
    ).eval()


class TinyVideoModel(VideoModel):
    """Pixel-space 'latents' [B, 3, F, H, W]; decode maps [-1, 1] to uint8."""

    family = "wan"

    def __init__(self, seed: int = 0, frames: int = 2, size: int = 4, layers: int = 1):
        self.transformer = tiny_wan(seed, layers=layers)
        self._shape = (3, frames, size, size)
        self.device = torch.device("cpu")

    @property
    def latent_shape(self):
        return self._shape

    def encode(self, prompts: list[str], images: Tensor | None = None) -> Cond:
        embs = []
        for p in prompts:
            seed = int.from_bytes(hashlib.sha256(p.encode()).digest()[:4], "little")
            g = torch.Generator().manual_seed(seed)
            embs.append(torch.randn(TEXT_LEN, TEXT_DIM, generator=g))
        return Cond({"encoder_hidden_states": torch.stack(embs)})  # [B, L, D]

    def velocity(self, x: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        t = torch.as_tensor(sigma, dtype=torch.float32).expand(x.shape[0]) * 1000.0  # [B]
        return self.transformer(x, t, cond.tensors["encoder_hidden_states"], return_dict=False)[0]

    def decode(self, latents: Tensor) -> Tensor:
        frames = ((latents.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)  # [B, C, F, H, W]
        return frames.permute(0, 2, 3, 4, 1)                                    # [B, F, H, W, 3]

    def trainable_module(self) -> nn.Module:
        return self.transformer


@torch.no_grad()
def sample_group(model: VideoModel, condition: Condition, *, group_size: int, seed: int,
                 scheme_name: str = "sage", eta: float | None = None, steps: int = 4,
                 shift: float = 1.0, trained: list[int] | None = None, version: int = 0,
                 group_id: str | None = None) -> Group:
    """G members sharing one initial noise; every step but the last runs the SDE and is stored."""
    schedule = Schedule.linear(steps, shift)
    scheme = make_scheme(scheme_name, eta, schedule)
    ode = make_scheme("ode")
    trained = list(range(steps - 1)) if trained is None else trained
    one = model.encode([condition.prompt])   # travels with the group, as the sampler's does
    cond = one.repeat(group_size)
    x = model.initial_noise(1, torch.Generator().manual_seed(seed)).repeat(group_size, 1, 1, 1, 1)
    gen = torch.Generator().manual_seed(seed + 1)
    xs, xns, lps, mus = [], [], [], []
    for k in range(steps):
        s, s1 = schedule.pair(k)
        sig = torch.full((group_size,), s)
        v = model.velocity(x, sig, cond)
        if k == steps - 1:  # the last step is deterministic (adds no noise)
            x_next = ode.mean(x, v, s, s1)
        else:
            x_next, mu, std = sample_step(scheme, x, v, s, s1, generator=gen)
            if k in trained:
                xs.append(x.clone())
                xns.append(x_next.clone())
                lps.append(scheme.log_prob(x_next, mu, std))
                mus.append(mu.clone())
        x = x_next
    gid = group_id or f"{condition.id}-{seed}"
    members = [
        Trajectory(condition=condition, group_id=gid, member=i, seed=seed, spec=scheme.spec(schedule),
                   guidance_scale=1.0, policy_version=version, step_indices=list(trained),
                   x=torch.stack([t[i] for t in xs]), x_next=torch.stack([t[i] for t in xns]),
                   logp_old=torch.stack([t[i] for t in lps]), final_latents=x[i].clone(),
                   mu_old=torch.stack([t[i] for t in mus]), cond=one)
        for i in range(group_size)
    ]
    return Group(condition=condition, group_id=gid, policy_version=version, members=members)
