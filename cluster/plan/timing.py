"""Seconds of the work each timeout waits for, estimated from the plan (cluster/plan/sizing.py)
and the config's `plan` section (storage and network rates). Every timeout must be at least
SAFETY times its estimate: the estimates assume a steady MFU and full bandwidth, and a real
node is slower now and then (a cold cache, a busy link, a thermally throttled GPU).
"""

from __future__ import annotations

from cluster.plan.sizing import (
    GPUS,
    MFU,
    Plan,
    anchor_copies,
    file_dtype_bytes,
    i2v_encode_frames,
    lean_setup,
)
from cluster.plan.vae import vae_flops
from common.families import FAMILIES
from common.methods import micro_batch_rows

SAFETY = 3.0
"""Each timeout must be at least this multiple of the work's estimate."""
VAE_MFU = 0.15
"""The fraction of peak a video VAE's 3-D convolutions reach (memory-bound, tiled): an
assumption, like MFU. fp32 VAEs run on TF32 tensor cores, half the bf16 peak."""
HASH_GB_S = 0.5
"""blake2b (common/weights.checksum) on one core, GB/s: 0.5-1 on current x86 cores (hashlib);
0.27 was measured on a shared build machine. The low end is assumed."""


def group_seconds(cfg, p: Plan) -> dict[str, float]:
    """One group on one rollout actor (sampler.timeout_s waits for it; with parallel.sp, the wall
    time on its sp GPUs): G videos denoised, the condition encoded once (text, and the I2V first
    frame through the VAE), G videos decoded."""
    m, G = cfg.model, cfg.sampler.group_size
    peak = GPUS[p.gpu][0] * 1e12
    vae_rate = peak * VAE_MFU * (0.5 if _vae_fp32(cfg) else 1.0)
    branches = 2 if m.guidance_scale > 1.0 else 1
    text = 2 * sum(v for k, v in FAMILIES[m.family].frozen.items() if k.startswith("text_encoder")) \
        * m.max_sequence_length * branches
    encode = text / (peak * MFU)
    if m.task == "i2v":  # Wan 2.1/2.2 A14B encode the first frame padded to the whole clip; others the frame
        encode += vae_flops(cfg, "encode", i2v_encode_frames(cfg)) / vae_rate
    return {"denoise": G * p.seconds["rollout per video"], "encode": encode,
            "decode": G * vae_flops(cfg, "decode") / vae_rate}


def _vae_fp32(cfg) -> bool:
    return FAMILIES[cfg.model.family].vae_fp32 or cfg.model.dtype == "float32"


def wire_bytes(cfg) -> int:
    """Bytes per value on the wire: a publish sends the weights in the rollout's dtype,
    model.dtype (learner.policy.wire_dtype), not the learner's fp32 masters."""
    return 4 if cfg.model.dtype == "float32" else 2


def payload_bytes(cfg, p: Plan) -> float:
    """What one publish moves: the trained weights (full) or the LoRA adapters, in model.dtype."""
    a = p.arch
    trained = a.params if cfg.optim.finetune == "full" else a.lora_params
    return float(wire_bytes(cfg) * trained * a.trained_experts)


def publish_bucket_bytes(cfg, p: Plan) -> float:
    """The most of a publish learner rank 0 holds at once: one bucket, at least the largest
    tensor (a bucket holds whole tensors), never more than the payload (learner.weight_sync
    gathers each bucket's tensors as it is sent)."""
    largest = wire_bytes(cfg) * (p.arch.largest_params if cfg.optim.finetune == "full" else 0)
    return min(max(float(cfg.weight_sync.bucket_bytes), float(largest)), payload_bytes(cfg, p))


def weight_sync_seconds(cfg, p: Plan) -> dict[str, float]:
    """One publish (weight_sync.timeout_s waits for it): the payload over the network, then the
    receiver's checksum when weight_sync.checksum is on."""
    n = payload_bytes(cfg, p)
    out = {"transfer": n / (cfg.plan.network_gb_s * 1e9)}
    if cfg.weight_sync.checksum:
        out["checksum"] = n / (HASH_GB_S * 1e9)
    return out


def load_bytes(cfg, p: Plan) -> float:
    """What one learner rank reads at start: the trained transformer(s) alone (no encoder, no
    VAE), and with more than one rank only its own rows of them (learner/shard_load.py)."""
    n = max(1, cfg.pools.learner.processes) if lean_setup(cfg) else 1  # num_actors × sp
    return file_dtype_bytes(cfg) * p.arch.params * p.arch.trained_experts / n


def checkpoint_shard_bytes(cfg, p: Plan) -> float:
    """One learner rank's checkpoint shard: fp32 masters, Adam's two moments and the anchors
    (written from where they live, the GPU or, under learner.cpu_offload, the host)."""
    a, n = p.arch, max(1, cfg.pools.learner.processes)  # FSDP2 shards over num_actors × sp
    trainable = a.trained_experts * (a.params if cfg.optim.finetune == "full" else a.lora_params)
    return (4 + 8 + 4 * anchor_copies(cfg)) * trainable / n


def micro_batch_seconds(cfg, p: Plan) -> float:
    """One micro-batch's forward and backward: the most a rank computes between two collectives
    of the learner's group (every rank runs the same micro-batches, learner/rows.py)."""
    k = max(p.flops["trained steps per video"], 1.0)
    return p.seconds["train per video"] / k * micro_batch_rows(cfg)


def estimates(cfg, p: Plan) -> dict[str, tuple[float, dict[str, float]]]:
    """Each timeout field → (seconds of the work it waits for, the parts)."""
    storage = cfg.plan.storage_gb_s * 1e9
    group, sync = group_seconds(cfg, p), weight_sync_seconds(cfg, p)
    load, shard = load_bytes(cfg, p), checkpoint_shard_bytes(cfg, p)
    return {
        "sampler.timeout_s": (sum(group.values()), group),
        "weight_sync.timeout_s": (sum(sync.values()), sync),
        "learner.collective_timeout_s": (micro_batch_seconds(cfg, p), {}),
        "learner.load_timeout_s": (load / storage, {"bytes": load}),
        "learner.checkpoint_timeout_s": (shard / storage, {"bytes": shard}),
    }
