"""Bytes the memory bank holds for a config, from the real schedule and the group format agreed
for this turn: each member stores only the steps it trains (x_k, x_{k+1}, logp_old, σ_k, σ_{k+1},
plus μ_old when the config records it) and its final latents; the group's condition (text
embeddings, I2V condition latents, the first frame) is stored once. Frames are never stored
(memory_bank/codec.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.plan.steps import per_token_timesteps, stored_steps_per_member
from cluster.plan.vae import latent_shape
from common.families import FAMILIES

META_BYTES = 4096
"""A member's hash fields (ids, the prompt, the schedule and step lists as JSON): a bound."""



@dataclass
class BankSize:
    steps_per_member: int
    latent: tuple[int, int, int, int]
    member: int        # bytes one member stores
    condition: int     # bytes stored once per group
    group: int
    step: int          # train.groups_per_step groups


def condition_bytes(cfg, latent: tuple[int, int, int, int]) -> int:
    """One condition's encoded tensors, in the compute dtype (both CFG branches when CFG runs)."""
    m = cfg.model
    c = 4 if m.dtype == "float32" else 2
    branches = 2 if m.guidance_scale > 1.0 else 1
    fam = FAMILIES[m.family]  # conditioning tensors per row (common/families.py)
    text = sum((m.max_sequence_length if n is None else n) * d for n, d in fam.text) * c * branches
    ch, f, h, w = latent
    extra = 0
    if fam.image_states is not None:  # image states (zeros for T2V), condition latents and their mask
        n, d = fam.image_states
        extra = (n * d + (ch + 1) * f * h * w) * c
    elif m.task == "i2v" and per_token_timesteps(cfg):  # Wan 2.2 TI2V-5B: the first frame's latents alone
        extra = ch * h * w * c
    elif m.task == "i2v":        # Wan: the mask (4 channels) and the first frame's latents
        extra = (4 + ch) * f * h * w * c
    image = m.height * m.width * 3 if m.task == "i2v" else 0  # the first frame, uint8
    return text + extra + image


def bank_size(cfg) -> BankSize:
    latent = latent_shape(cfg)
    n = latent[0] * latent[1] * latent[2] * latent[3]
    b = 4 if cfg.sampler.latent_dtype == "float32" else 2
    k = stored_steps_per_member(cfg)
    member = (2 * k * n * b                          # x_k, x_{k+1}
              + (k * n * 4 if cfg.records_mu_old else 0)  # μ_old, fp32
              + k * 4 + 2 * k * 4                    # logp_old, σ_k and σ_{k+1}
              + n * b + META_BYTES)                  # final latents, hash fields
    cond = condition_bytes(cfg, latent)
    group = cfg.sampler.group_size * member + cond
    return BankSize(k, latent, member, cond, group, cfg.train.groups_per_step * group)
