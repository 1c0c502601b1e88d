"""Issue 29, row 1: one group of configs/hunyuan15_t2v_sage.yaml at its real shapes goes into a
real bank with the config's own bank section, and the first push no longer raises BankTooSmall.

The shapes are the released model's, read from diffusers' own classes (the transformer's and the
VAE's constructor defaults, as `vgrpo plan` builds them on the meta device), the step draw is the
sampler's for the config, and the condition is the encoder outputs' shapes
(HunyuanVideo15Pipeline: Qwen2.5-VL padded to 1000 tokens, ByT5 to 256, 729 SigLIP tokens).
Tensors are zeros in bf16: ~430 MB of members, pushed once."""

from __future__ import annotations

import inspect
import uuid

import torch

from common.config import load_config
from common.sde import Schedule, scheme_from_config
from common.types import Cond, Condition, Group, Scores, Trajectory
from memory_bank.bank import MemoryBank
from rollout_worker.models.base import encoder_fingerprint
from rollout_worker.sampler import draw_trained_steps

CONFIG = "configs/hunyuan15_t2v_sage.yaml"


def _defaults(cls) -> dict:
    return {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items() if k != "self"}


def _real_shapes(cfg) -> tuple[tuple[int, ...], dict[str, tuple[int, ...]]]:
    """(latent [C, F, H, W], the encoded condition's tensors) of the released HunyuanVideo 1.5."""
    from diffusers import AutoencoderKLHunyuanVideo15, HunyuanVideo15Transformer3DModel

    t, v, m = _defaults(HunyuanVideo15Transformer3DModel), _defaults(AutoencoderKLHunyuanVideo15), cfg.model
    st, ss = v["temporal_compression_ratio"], v["spatial_compression_ratio"]
    latent = (v["latent_channels"], (m.num_frames - 1) // st + 1, m.height // ss, m.width // ss)
    text = {"encoder_hidden_states": (1, 1000, t["text_embed_dim"]), "encoder_attention_mask": (1, 1000),
            "encoder_hidden_states_2": (1, 256, t["text_embed_2_dim"]), "encoder_attention_mask_2": (1, 256)}
    return latent, {**text, "image_embeds": (1, 729, t["image_embed_dim"]), "cond_latents": (1, *latent),
                    "mask": (1, 1, *latent[1:])}


def _zeros(shape: tuple[int, ...], name: str) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.int64 if "attention_mask" in name else torch.bfloat16)


def test_a_hunyuan_group_of_the_shipped_config_fits_its_bank(redis_server):
    cfg = load_config(CONFIG)
    G = cfg.sampler.group_size
    latent, cond_shapes = _real_shapes(cfg)
    assert latent == (32, 21, 30, 53)
    sched = Schedule.from_config(cfg.schedule)
    trained = draw_trained_steps(sched, scheme_from_config(cfg, sched), cfg.sampler, seed=7, members=G)
    assert {len(t) for t in trained} == {12}                   # floor(0.6 x 20): not all 20
    condition = Condition("c-real", "a prompt")
    text = {n: s for n, s in cond_shapes.items() if n.startswith("encoder")}   # CFG: the negative's too
    cond = Cond({n: _zeros(s, n) for n, s in cond_shapes.items()}, {n: _zeros(s, n) for n, s in text.items()},
                encoder_fingerprint(cfg.model, None))
    spec = scheme_from_config(cfg, sched).spec(sched)
    final = torch.zeros(latent, dtype=torch.bfloat16)
    members = []
    for i, steps in enumerate(trained):
        xs = torch.zeros(len(steps), *latent, dtype=torch.bfloat16)   # one [K, C, F, H, W] per member
        members.append(Trajectory(condition=condition, group_id="g-real", member=i, seed=7, spec=spec,
                                  guidance_scale=cfg.model.guidance_scale, policy_version=0,
                                  step_indices=sorted(steps), x=xs, x_next=xs, logp_old=torch.zeros(len(steps)),
                                  final_latents=final, cond=cond))
    group = Group(condition, "g-real", 0, members, Scores(["VQ", "MQ", "TA"], torch.zeros(G, 3)), torch.zeros(G))

    bank_cfg = cfg.bank.model_copy(update={"namespace": f"real{uuid.uuid4().hex[:8]}"})
    client = redis_server.client()
    bank = MemoryBank(client, bank_cfg)
    bank.expect_step(cfg.train.groups_per_step)   # what the rollout actor does before its first push
    try:
        bank.push_group(group)                    # raised BankTooSmall: 8 x 700930998 bytes per group
        latent_bytes = 2 * torch.Size(latent).numel()
        cond_bytes = cond.nbytes()
        st = bank.stats()
        assert st["entries"] == G and st["cond_records"] == 1
        # each member: its 12 trained steps (x, x_next) and the final latents; the condition once
        tensors = G * (2 * 12 + 1) * latent_bytes + cond_bytes
        assert tensors <= bank.group_bytes <= tensors + 64 * 1024
        assert cfg.train.groups_per_step * bank.group_bytes <= bank_cfg.max_bytes
        # the format before: every member stored all 20 recorded steps (the 700930998 bytes
        # per group: these tensors plus metadata)
        before = G * (2 * 20 + 1) * latent_bytes
        assert 0 < 700_930_998 - before < 64 * 1024 and bank.group_bytes < 0.65 * before
        print(f"hunyuan group: {bank.group_bytes} bytes ({cond_bytes} of them the condition, once); "
              f"one step {cfg.train.groups_per_step * bank.group_bytes} of bank.max_bytes {bank_cfg.max_bytes}")
    finally:
        bank.clear()
        client.close()
