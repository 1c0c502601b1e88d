"""Sizing for `vgrpo plan`: memory per rank, FLOPs and seconds per video,
and the rollout:learner GPU split, estimated from the config without loading any weights.

The transformer is built on the meta device from its diffusers class and the config of the
checkpoint `model.path` names: a local folder's own transformer/config.json, else the released
sizes its family declares (common/families.py), else the class defaults; so its parameter counts
are exact without the weights on disk. Activation memory per block is the saved-tensor count of diffusers'
blocks, counted with autograd's saved_tensors_hooks (`_ACT`); it is checked against the
measured peak of CPU train steps in tests/test_plan.py. FLOPs are 2·params per token for the
blocks' linears plus 4·S²·d per attention layer; seconds assume `MFU` of the GPU's dense bf16
peak; the trained steps per video are the sampler's own draw (cluster/plan/steps.py). Pure:
imports torch, diffusers, pydantic and the sampler's step rules (benchmarks/gpu_check.py uses it).

Sequence parallelism (`pools.<role>.parallel.sp`): a rank holds 1/sp of the video tokens, so its
block activations and its share of the attention and linear FLOPs divide by sp (HunyuanVideo
1.5's text and image tokens stay whole on every rank); the patch embedding and the output head
still see the whole sequence. Each self-attention costs two Ulysses all-to-alls (q, k, v there,
the output back), counted in bytes and in seconds at the GPU's NVLink bandwidth.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from cluster.plan.steps import has_two_experts as _has_two_experts
from cluster.plan.steps import per_token_timesteps, stored_steps_per_member
from cluster.plan.vae import latent_shape, vae_params
from common.families import FAMILIES, release_of
from common.methods import kl_of, method_of, micro_batch_rows

GB = 1024**3

# Dense bf16 peak TFLOP/s and memory (GiB) of one GPU (vendor datasheets, SXM parts).
GPUS: dict[str, tuple[float, float]] = {"H100": (989.0, 80.0), "H200": (989.0, 141.0), "A100": (312.0, 80.0)}
MFU = 0.4  # the fraction of peak a bf16 video DiT step reaches (an assumption, stated in the output)
NVLINK_GBS = {"H100": 450.0, "H200": 450.0, "A100": 300.0}  # GB/s per direction per GPU (SXM datasheets)

# Saved activations per transformer block and token, in bytes: a·d + b·ffn (d the width). Counted
# on diffusers 0.42's WanTransformerBlock with saved_tensors_hooks: fp32 ≈ 90·d + 8·ffn,
# bf16 ≈ 70·d + 4·ffn (its norms keep fp32 copies). HunyuanVideo 1.5's double-stream blocks are
# taken as Wan's with ffn = mlp_ratio·d.
_ACT = {4: (90.0, 8.0), 2: (70.0, 4.0)}
# Per-token timesteps (Wan 2.2 TI2V-5B) make each block's six modulation vectors per token, fp32:
# counted the same way, +32·d bytes per token and block, and +24·d per token outside the blocks
# (the [S, 6, d] fp32 timestep projection every block reads). A no-grad forward holds that
# projection, one block's fp32 modulations and their products: 60·d per token.
_TOKEN_T_BLOCK, _TOKEN_T_ROOT, _TOKEN_T_FORWARD = 32.0, 24.0, 60.0

# Peak live feature maps of a VAE decode: (channels at full resolution) × output frames per chunk
# (FamilySpec.vae_decode: Wan decodes causally 4 frames at a time with 96 channels; HunyuanVideo
# 1.5 all frames at once with 128). Six such maps are alive at once in a resnet block.
_LIVE_MAPS = 6


@dataclass
class Arch:
    family: str
    params: int            # one transformer
    block_params: int      # one block
    root_params: int       # outside the blocks
    layers: int
    width: int
    ffn: int
    lora_params: int
    experts: int           # transformers the rollout runs (Wan 2.2: 2)
    trained_experts: int
    tokens: int            # S: video tokens of one sample
    text_tokens: int
    largest_params: int = 0  # the largest single weight (a block's FFN matrix)
    token_timesteps: bool = False  # one timestep per video token (Wan 2.2 TI2V-5B)
    largest_lora: int = 0    # the largest single LoRA adapter matrix (rank × the wider side)

    @property
    def joint_text(self) -> bool:
        """Text (and image) tokens join the video in self-attention (else cross-attention)."""
        return FAMILIES[self.family].joint_text


@dataclass
class Plan:
    gpu: str
    arch: Arch
    learner: dict[str, float] = field(default_factory=dict)   # bytes per learner process
    learner_setup: dict[str, float] = field(default_factory=dict)  # bytes per learner process at its setup peak
    rollout: dict[str, float] = field(default_factory=dict)   # bytes per rollout process
    flops: dict[str, float] = field(default_factory=dict)     # per video, summed over an actor's sp ranks
    seconds: dict[str, float] = field(default_factory=dict)   # wall time on one actor (its sp GPUs)
    split: dict[str, float] = field(default_factory=dict)
    rollout_receive: float = 0.0                               # bytes: two receive buckets
    comm: dict[str, float] = field(default_factory=dict)      # all-to-all bytes per rank per video (sp > 1)


# --- architecture --------------------------------------------------------------------


def _transformer_class(family: str):
    import diffusers  # heavy: diffusers, only when a plan is made

    return getattr(diffusers, FAMILIES[family].transformer)


def transformer_config(cfg) -> dict:
    """The transformer's config: a local checkpoint's own, else the release model.path names
    (FamilySpec.released), else the class defaults with the family's per-task keys."""
    m = cfg.model
    if m.path is not None and (Path(m.path) / "transformer" / "config.json").is_file():
        return json.loads((Path(m.path) / "transformer" / "config.json").read_text(encoding="utf-8"))
    release = release_of(m.family, m.path)
    if release is not None:
        return dict(release.transformer)
    return dict(FAMILIES[m.family].task_transformer.get(m.task, {}))


def arch(cfg, transformer=None) -> Arch:
    """Sizes of the config's transformer (built on the meta device unless given)."""
    import torch  # lazy: torch (kept out of vgrpo --help)

    # lazy: torch (kept out of vgrpo --help)
    from rollout_worker.models.lora import lora_targets

    m = cfg.model
    spec = FAMILIES[m.family]
    if not spec.planned:
        raise ValueError(f"vgrpo plan: model.family = {m.family!r} has no plan; use one of "
                         f"{', '.join(f for f, s in FAMILIES.items() if s.planned)}")
    if transformer is None:
        cls = _transformer_class(m.family)
        conf = {k: v for k, v in transformer_config(cfg).items() if not k.startswith("_")}
        with torch.device("meta"):
            transformer = cls.from_config(conf)
    c = transformer.config
    blocks = [b for name in ("blocks", "transformer_blocks") for b in getattr(transformer, name, [])]
    count = lambda mod: sum(p.numel() for p in mod.parameters())  # noqa: E731
    params, block = count(transformer), count(blocks[0])
    width = c.num_attention_heads * c.attention_head_dim
    ffn = getattr(c, "ffn_dim", None) or int(c.mlp_ratio * width)  # Wan names its FFN width; HunyuanVideo a ratio
    targets = lora_targets(m.family, cfg.optim)
    adapted = [mod for name, mod in transformer.named_modules()
               if isinstance(mod, torch.nn.Linear) and any(name == t or name.endswith("." + t) for t in targets)]
    lora = sum(cfg.optim.lora_rank * (mod.in_features + mod.out_features) for mod in adapted)
    largest_lora = max((cfg.optim.lora_rank * max(mod.in_features, mod.out_features) for mod in adapted), default=0)
    # video tokens per sample: latent frames × latent H × latent W (the VAE's), divided by the patch
    patch = c.patch_size
    pt, ph, pw = tuple(patch) if isinstance(patch, (list, tuple)) else (c.patch_size_t, patch, patch)
    _, lf, lh, lw = latent_shape(cfg)
    tokens = (lf // pt) * (lh // ph) * (lw // pw)
    # conditioning tokens: the prompt's, plus (HunyuanVideo 1.5) its fixed-length glyph and image states
    text = sum(m.max_sequence_length if n is None else n for n, _ in spec.text)
    text += spec.image_states[0] if spec.image_states is not None else 0
    two = _has_two_experts(cfg)
    return Arch(m.family, params, block, params - len(blocks) * block, len(blocks), width, ffn, lora,
                experts=2 if two else 1, trained_experts=1 if (not two or m.train_experts == "high_noise") else 2,
                tokens=tokens, text_tokens=text, largest_params=max(p.numel() for p in transformer.parameters()),
                token_timesteps=per_token_timesteps(cfg), largest_lora=largest_lora)


# --- memory --------------------------------------------------------------------------


def _seq(a: Arch, sp: int = 1) -> tuple[float, float]:
    """(tokens a block of one SP rank sees, tokens of the whole sequence): video / sp, plus
    HunyuanVideo 1.5's joint text and image tokens, which every rank keeps whole."""
    text = a.text_tokens if a.joint_text else 0
    return a.tokens / sp + text, a.tokens + text


def activation_bytes(a: Arch, rows: int, dtype_bytes: int, checkpointing: bool, sp: int = 1) -> float:
    """Activations of one micro-batch's forward kept for backward (rows = micro_batch × CFG passes)."""
    ad, af = _ACT[dtype_bytes]
    local, seq = _seq(a, sp)
    if a.token_timesteps:
        ad += _TOKEN_T_BLOCK
    per_layer = rows * local * (ad * a.width + af * a.ffn)
    head = rows * seq * a.width * 4 * 4  # patch embedding, time/text embeddings, output head (fp32): whole
    head += rows * seq * a.width * _TOKEN_T_ROOT if a.token_timesteps else 0
    if checkpointing:  # each block keeps only its input; one block at a time is recomputed
        return a.layers * rows * local * a.width * dtype_bytes + per_layer + head
    return a.layers * per_layer + head


def vae_decode_bytes(cfg) -> float:
    m = cfg.model
    ch, chunk, tile = FAMILIES[m.family].vae_decode
    frames = chunk or m.num_frames
    area = min(m.height, tile) * min(m.width, tile) if m.vae_tiling else m.height * m.width
    return _LIVE_MAPS * ch * frames * area * 4 + m.num_frames * 3 * m.height * m.width * 4


def _safetensors_params(folder: Path) -> int:
    """Parameters stored in a folder's *.safetensors files, read from their headers (no weights)."""
    total = 0
    for f in folder.glob("*.safetensors"):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        for k, v in header.items():
            if k != "__metadata__":
                n = 1
                for d in v["shape"]:
                    n *= d
                total += n
    return total


def file_dtype_bytes(cfg) -> int:
    """Bytes per value of the transformer's safetensors: a local checkpoint's own (its first
    tensor's dtype, from the header), else model.dtype's (released checkpoints hold bf16)."""
    folder = Path(cfg.model.path or "") / "transformer"
    for f in sorted(folder.glob("*.safetensors")) if folder.is_dir() else []:
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        dtypes = [v["dtype"] for k, v in header.items() if k != "__metadata__"]
        if dtypes:
            return {"F32": 4, "BF16": 2, "F16": 2}.get(dtypes[0], 4)
    return 4 if cfg.model.dtype == "float32" else 2


def frozen_params(cfg) -> dict[str, float]:
    """Frozen encoders and VAE in parameters: a local checkpoint's own files, else published sizes."""
    m = cfg.model
    root = Path(m.path) if m.path is not None else None
    if root is None or not (root / "model_index.json").is_file():
        out = dict(FAMILIES[m.family].frozen)
        release = release_of(m.family, m.path)
        if release is not None and release.vae:  # a release with its own VAE (Wan 2.2's): counted on meta
            key = "vae (fp32)" if FAMILIES[m.family].vae_fp32 else "vae"
            out[key] = vae_params(cfg)
        return out
    out = {}
    for sub in ("text_encoder", "text_encoder_2", "image_encoder", "vae"):
        if (root / sub).is_dir():
            out["vae (fp32)" if sub == "vae" and FAMILIES[m.family].vae_fp32 else sub] = \
                float(_safetensors_params(root / sub))
    return out


def anchor_copies(cfg) -> int:
    """fp32 copies of the trained weights a learner rank keeps besides the masters: LoRA's π_0 and
    moving anchors, a full fine-tune's KL anchor, the exact D_step's, and the EMA (optim.ema_decay)."""
    o, kl = cfg.optim, kl_of(cfg)
    n = 2 if o.finetune == "lora" else int(kl.anchor is not None)
    return n + int(kl.step and cfg.kl.d_step == "exact") + int(o.ema_decay > 0)


def learner_memory(cfg, a: Arch, frozen: dict[str, float] | None = None) -> dict[str, float]:
    """GPU bytes one learner process holds during a train step (FSDP2 over all num_actors × sp
    processes; activations divide by sp).

    The learner builds the trained transformer(s) alone (no encoder, no VAE, not Wan 2.2's frozen
    expert under train_experts=high_noise): `frozen` counts frozen modules in parameters when a
    measured run does hold some (benchmarks/gpu_check.py). learner.cpu_offload moves the fp32
    master shard, its gradients, AdamW's moments and the anchors to host memory
    (`learner_offloaded`); the GPU keeps the gathered blocks and the activations."""
    m, o = cfg.model, cfg.optim
    c = 4 if m.dtype == "float32" else 2
    sp = cfg.pools.learner.parallel.sp
    n = max(1, cfg.pools.learner.num_actors) * sp
    p_train = a.params * a.trained_experts
    gathered = c * (2 * a.block_params + a.root_params) if n > 1 else 0  # one block and its prefetch
    if o.finetune == "full":
        trainable = p_train
        if n > 1:  # sharded fp32 masters; one block (and its prefetched successor) gathered in dtype
            weights, grads = 4 * p_train / n, 4 * p_train / n
        else:      # compute weights in dtype plus fp32 masters when dtype is lower
            weights = c * p_train + (4 * p_train if c < 4 else 0)
            grads = c * p_train + (4 * p_train if c < 4 else 0)
        block_grad = c * a.block_params if n > 1 else 0
    else:
        trainable = a.lora_params * a.trained_experts
        weights, grads, block_grad = c * p_train / n + 4 * trainable / n, 4 * trainable / n, 0
    optimizer, anchors = 8 * trainable / n, anchor_copies(cfg) * (4 * trainable / n)
    if cfg.learner.cpu_offload:  # all of it in host memory (learner_offloaded), none on the GPU
        weights = c * p_train / n if o.finetune == "lora" else 0.0
        grads, optimizer, anchors = 0.0, 0.0, 0.0
    rows = micro_batch_rows(cfg) * (2 if m.guidance_scale > 1.0 else 1)  # the method's batching (whole groups)
    frozen_b = sum((4 if "fp32" in k else c) * v for k, v in (frozen or {}).items())
    return {"weights": weights + gathered, "grads": grads + block_grad, "optimizer": optimizer,
            "anchors": anchors, "frozen modules": frozen_b,
            "activations (checkpointing)": activation_bytes(a, rows, c, True, sp),
            "activations (no checkpointing)": activation_bytes(a, rows, c, False, sp)}


def learner_offloaded(cfg, a: Arch) -> float:
    """Host bytes of one learner rank under learner.cpu_offload: its fp32 master shard (and a LoRA
    run's adapters), their gradients, AdamW's two moments and the anchors, resident all run long."""
    if not cfg.learner.cpu_offload:
        return 0.0
    n = max(1, cfg.pools.learner.processes)  # FSDP2 shards over every process (num_actors × sp)
    trainable = a.params * a.trained_experts if cfg.optim.finetune == "full" else a.lora_params * a.trained_experts
    return (4 + 4 + 8 + 4 * anchor_copies(cfg)) * trainable / n


def lean_setup(cfg) -> bool:
    """Whether learner ranks take the lean sharded setup (learner/actor.lean_setup): more than one
    process (num_actors × parallel.sp)."""
    return cfg.pools.learner.processes > 1


def learner_setup(cfg, a: Arch) -> dict[str, float]:
    """Bytes one learner rank holds at its setup peak, before the first step (on the GPU, or the
    host under learner.cpu_offload).

    Sharded (learner/shard_load.py): the module is built on meta, sharded, and each rank's rows
    are read one weight at a time (the rows as the file holds them and rounded to model.dtype,
    the file taken to hold model.dtype) into the fp32 master shard; the anchors and the EMA are
    then copied per shard. One rank (the reference path): the whole trained module in
    model.dtype, its fp32 masters and the anchors, unsharded."""
    c = 4 if cfg.model.dtype == "float32" else 2
    n = max(1, cfg.pools.learner.processes)  # FSDP2 shards over every process (num_actors × sp)
    p_train = a.params * a.trained_experts
    full = cfg.optim.finetune == "full"
    trainable = p_train if full else a.lora_params * a.trained_experts
    if lean_setup(cfg):
        weights = 4 * p_train / n if full else c * p_train / n + 4 * trainable / n
        f = file_dtype_bytes(cfg)
        read = (f + (c if c != f else 0)) * a.largest_params / n
    else:
        weights = c * p_train + (4 * p_train if full and c < 4 else 0) + (4 * trainable if not full else 0)
        read = 0.0
    return {"weights": weights, "anchors": anchor_copies(cfg) * 4 * trainable / n, "weight being read": read}


def learner_peak(mem: dict[str, float], checkpointing: bool) -> float:
    act = mem["activations (checkpointing)" if checkpointing else "activations (no checkpointing)"]
    return sum(v for k, v in mem.items() if not k.startswith("activations")) + act


def rollout_rows(cfg) -> int:
    """Transformer rows in one rollout forward: the group's G samples (x2 where CFG's cond and
    uncond share a forward: Wan; HunyuanVideo 1.5 runs them apart), or as many as
    sampler.forward_batch_size lets through, by the sampler's own rule."""
    # lazy: torch, PIL (kept out of vgrpo --help)
    from rollout_worker.sampler import samples_per_forward

    per = 2 if cfg.model.guidance_scale > 1.0 and FAMILIES[cfg.model.family].cfg_in_one_forward else 1
    return per * samples_per_forward(cfg.sampler.group_size, per, cfg.sampler.forward_batch_size)


def rollout_memory(cfg, a: Arch) -> dict[str, float]:
    """GPU bytes of one rollout rank, by part. With model.text_encoder_offload the text encoders
    are on the GPU only while a condition is encoded (rollout_peaks: the encoding phase)."""
    m = cfg.model
    c = 4 if m.dtype == "float32" else 2
    rows = rollout_rows(cfg)  # activations scale with the rows of one forward, not with G
    seq, _ = _seq(a, cfg.pools.rollout.parallel.sp)
    per_token = (8 * a.width + 2 * a.ffn) * c + (_TOKEN_T_FORWARD * a.width if a.token_timesteps else 0)
    frozen = {k: (4 if "fp32" in k else c) * v for k, v in frozen_params(cfg).items()}
    text = sum(v for k, v in frozen.items() if k.startswith("text_encoder"))
    out = {"weights": c * a.params * a.experts + (4 * a.lora_params if cfg.optim.finetune == "lora" else 0),
           "frozen modules": sum(frozen.values()) - (text if m.text_encoder_offload else 0.0),
           # no-grad forward: a few layer-sized tensors live at once (ffn hidden dominates)
           "activations": rows * seq * per_token,
           "vae decode": vae_decode_bytes(cfg)}
    if m.text_encoder_offload:
        out["text encoders (while encoding)"] = text
    if m.task == "i2v":
        out["i2v encode"] = vae_encode_bytes(cfg, i2v_encode_frames(cfg))
    return out


def i2v_encode_frames(cfg) -> int:
    """Frames the VAE encodes for an I2V condition: Wan 2.1/2.2 A14B pad the first frame to the
    whole clip (FamilySpec.i2v_encodes_clip); per-token-timestep models and HunyuanVideo 1.5
    encode the frame alone."""
    m = cfg.model
    release = release_of(m.family, m.path)
    clip = FAMILIES[m.family].i2v_encodes_clip and not (release is not None and release.expand_timesteps)
    return m.num_frames if clip else 1


def vae_encode_bytes(cfg, frames: int) -> float:
    """An encode's working set: the fp32 input clip and the encoder's full-resolution feature
    maps over one causal chunk (or all frames), tiled as the decode is."""
    m = cfg.model
    ch, chunk, tile = FAMILIES[m.family].vae_decode
    area = min(m.height, tile) * min(m.width, tile) if m.vae_tiling else m.height * m.width
    return _LIVE_MAPS * ch * min(chunk or frames, frames) * area * 4 + frames * 3 * m.height * m.width * 4


def rollout_receive_bytes(cfg, a: Arch) -> float:
    """What a rollout rank holds on top of its weights while it loads a publish: two receive
    buckets (rollout_worker/weight_receiver.py), each weight_sync.bucket_mb or the largest
    tensor when one is bigger (it travels alone), and never more than the payload itself."""
    c = 4 if cfg.model.dtype == "float32" else 2
    if cfg.optim.finetune == "lora":
        payload, largest = 4 * a.lora_params * a.trained_experts, 0
    else:  # the wire carries model.dtype; the largest tensor is a block's FFN matrix
        payload, largest = c * a.params * a.trained_experts, c * a.width * a.ffn
    return min(payload, 2 * max(cfg.weight_sync.bucket_bytes, largest))


def rollout_peaks(cfg, p: Plan) -> dict[str, float]:
    """The rollout rank's peak in each of its phases (it is in one at a time): encoding a
    condition (the text encoders on the GPU, and the I2V first frame through the VAE), generating
    (the transformer's activations, then the VAE decode), receiving weights (two buckets)."""
    r = p.rollout
    resident = r["weights"] + r["frozen modules"]
    return {"encoding": resident + r.get("text encoders (while encoding)", 0.0) + r.get("i2v encode", 0.0),
            "generating": resident + r["activations"] + r["vae decode"],
            "receiving weights": resident + p.rollout_receive}


# --- compute -------------------------------------------------------------------------


def forward_flops(a: Arch, rows: int, sp: int = 1) -> float:
    """One SP rank's share of one transformer forward over `rows` samples (sp 1: the whole)."""
    local, seq = _seq(a, sp)
    cross = 0 if a.joint_text else a.text_tokens
    linear = 2 * local * a.params
    # self-attention: every query over every key, for 1/sp of the heads; Wan's cross-attention: local queries
    attn = a.layers * (4 * seq * seq * a.width / sp + 4 * (a.tokens / sp) * cross * a.width)
    return rows * (linear + attn)


def trained_per_video(cfg) -> int:
    """Learner rows per video: the steps a member trains, as the sampler draws them (MixGRPO's
    window: its width; Flash-GRPO: 1), or DiffusionNFT's int(T·timestep_fraction) noised copies
    of its final latents."""
    rows = method_of(cfg).rows_per_video
    return rows(cfg) if rows is not None else stored_steps_per_member(cfg)


def all_to_all_bytes(a: Arch, rows: int, dtype_bytes: int, sp: int) -> float:
    """Bytes one SP rank sends in one forward: per self-attention, q, k, v and the output, each
    rows × N/sp × d, of which (sp - 1)/sp leave the rank (HunyuanVideo 1.5 also gathers its text
    output over heads)."""
    if sp == 1:
        return 0.0
    video = 4 * rows * (a.tokens / sp) * a.width * dtype_bytes
    text = rows * a.text_tokens * (a.width / sp) * dtype_bytes if a.joint_text else 0.0
    return a.layers * (video + text) * (sp - 1) / sp


def plan(cfg, gpu: str | None = None, transformer=None) -> Plan:
    """The sizing on `gpu` (default: the config's plan.gpu), of `transformer` when given (a
    measurement's own, benchmarks/device_check.py), else of the config's (built on meta)."""
    gpu = cfg.plan.gpu if gpu is None else gpu
    if gpu not in GPUS:
        raise ValueError(f"--gpu {gpu!r}: expected one of {', '.join(GPUS)}")
    from common.sde import Schedule  # lazy: torch, numpy (kept out of vgrpo --help)

    a = arch(cfg, transformer)
    p = Plan(gpu, a)
    p.learner, p.rollout = learner_memory(cfg, a), rollout_memory(cfg, a)
    p.learner_setup = learner_setup(cfg, a)
    p.rollout_receive = rollout_receive_bytes(cfg, a)
    pools, c = cfg.pools, 4 if cfg.model.dtype == "float32" else 2
    sp_r, sp_l = pools.rollout.parallel.sp, pools.learner.parallel.sp
    steps = Schedule.from_config(cfg.schedule).steps
    cfg_passes = 2 if cfg.model.guidance_scale > 1.0 else 1
    k = trained_per_video(cfg)  # learner rows per video
    # the method's anchors, and the exact D_step's forward of the sampling policy
    anchors_fwd = len(method_of(cfg).anchors(cfg)) + int(kl_of(cfg).step and cfg.kl.d_step == "exact")
    recompute = 1 if cfg.model.gradient_checkpointing else 0
    passes_r, passes_t = steps * cfg_passes, k * cfg_passes
    p.flops = {"rollout per video": passes_r * forward_flops(a, 1, sp_r) * sp_r,
               "train per video": passes_t * forward_flops(a, 1, sp_l) * sp_l * (3 + recompute + anchors_fwd),
               "trained steps per video": float(k)}
    # all-to-all: one per forward pass, and in backward, recomputation and anchor forwards again
    p.comm = {"rollout per video": passes_r * all_to_all_bytes(a, 1, c, sp_r),
              "train per video": passes_t * all_to_all_bytes(a, 1, c, sp_l) * (2 + recompute + anchors_fwd)}
    rate, link = GPUS[gpu][0] * 1e12 * MFU, NVLINK_GBS[gpu] * 1e9
    t_r = p.flops["rollout per video"] / sp_r / rate + p.comm["rollout per video"] / link
    t_t = p.flops["train per video"] / sp_l / rate + p.comm["train per video"] / link
    p.seconds = {"rollout per video": t_r, "train per video": t_t}
    # the split balances GPU-seconds: an actor's video occupies its sp GPUs
    g_r, g_t = t_r * sp_r, t_t * sp_l
    total = pools.rollout.processes * pools.rollout.num_gpus + pools.learner.processes * pools.learner.num_gpus
    p.split = {"rollout share": g_r / (g_r + g_t), "gpus": total,
               "rollout gpus": total * g_r / (g_r + g_t), "learner gpus": total * g_t / (g_r + g_t)}
    return p
