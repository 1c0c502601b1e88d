"""GPU memory per device: the reward rank's, and the roles that share one GPU.

A pool's `num_gpus` below 1 asks Ray for a share of a GPU, so processes of several roles can sit
on one device (configs/wan21_t2v_1p3b_1gpu.yaml: rollout, reward and learner on one H100). Their
peaks then add up: each process keeps what its caching allocator reserved, whichever role is
busy. The shares are packed as Ray packs fractional GPUs on a node, first fit in the order of
the pools (rollout, reward, learner); a process with num_gpus of 1 or more has its own GPU(s).
Each process on a device also holds what the arithmetic leaves out, `plan.gpu_reserved_gib` (its
CUDA context, NCCL's buffers, fragmentation), and `plan.min_free` of the GPU must stay free: the
same figures `cluster/plan/checks.gpu_checks` holds each process to.

The reward rank runs no grad: its weights in its dtype (the released size, or a local
checkpoint's files) and one scoring batch's activations, counted like the rollout's no-grad
forward (8·d + 2·ffn bytes per token in its dtype) over the language model's tokens (the
sampled frames' merged visual tokens and `TEXT_TOKENS` of template and prompt per row) and the
vision tower's patches (4 per merged token), with the sizes its declaration gives
(common/scorers.ScorerGPU).
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.plan.host import reward_bytes
from cluster.plan.sizing import GB, Plan, learner_peak, rollout_peaks
from common.scorers import scorer_spec

TEXT_TOKENS = 512
"""The reward template and prompt per scored row, in tokens (a bound)."""


def sampled_frames(num_frames: int, video_fps: float, fps: float) -> int:
    """Frames a scorer samples at `fps` (the Qwen-VL recipe: an even count, at least 4, at most
    the video's own; reward_worker/vision.sample_indices)."""
    hi = num_frames // 2 * 2
    return max(4, min(hi, round(num_frames / video_fps * fps / 2) * 2))


def reward_memory(cfg) -> dict[str, float]:
    """GPU bytes of one reward process: the largest of the configured models (each runs in its
    own actor), its weights and one batch's activations; zeros when none runs on a GPU."""
    best = {"weights": 0.0, "activations": 0.0}
    if cfg.pools.reward.num_gpus <= 0:
        return best
    m, out = cfg.model, []
    for r in cfg.rewards.models:
        g = scorer_spec(r.name).gpu
        if g is None or r.device == "cpu":
            continue
        c = 4 if r.dtype == "float32" else 2
        n = sampled_frames(m.num_frames, r.video_fps, r.sample_fps or 2.0)
        px = min(max(m.height * m.width, g.pixels[0]), g.pixels[1])
        visual = n * px / g.token_pixels / (1 if g.per_frame else 2)      # merged tokens per video
        rows = n if g.per_frame else 1
        (d, f), (dv, fv) = g.lm, g.vision
        per_video = (visual + rows * TEXT_TOKENS) * (8 * d + 2 * f) + 4 * visual * (8 * dv + 2 * fv)
        out.append({"weights": reward_bytes(r), "activations": r.batch_size * per_video * c})
    return max(out, key=lambda x: sum(x.values()), default=best)


def role_phases(cfg, p: Plan) -> dict[str, tuple[float, str]]:
    """Each role's GPU peak per process and at what: the learner's train step (with the config's
    checkpointing) or its setup when that is on the GPU; the rollout's encoding, generating or
    receiving weights; the reward's scoring batch."""
    ck = cfg.model.gradient_checkpointing
    learner = {f"train step, {'with' if ck else 'without'} gradient checkpointing": learner_peak(p.learner, ck)}
    if not cfg.learner.cpu_offload:
        learner["setup"] = sum(p.learner_setup.values())
    rollout = {f"while {k}": v for k, v in rollout_peaks(cfg, p).items()}
    out = {role: max(((b, what) for what, b in phases.items()), key=lambda bw: bw[0])
           for role, phases in (("learner", learner), ("rollout", rollout))}
    out["reward"] = (sum(reward_memory(cfg).values()), "scoring a batch")
    return out


def role_peaks(cfg, p: Plan) -> dict[str, float]:
    """Each role's GPU peak per process, in bytes (role_phases without the phase)."""
    return {role: b for role, (b, _) in role_phases(cfg, p).items()}


@dataclass
class Device:
    """One GPU and the role processes that share it: (role, share of the GPU)."""

    shares: list[tuple[str, float]]

    @property
    def roles(self) -> list[str]:
        return [r for r, _ in self.shares]


def shared_devices(cfg) -> list[Device]:
    """The GPUs that processes of fractional `num_gpus` share, packed first fit in pool order."""
    pools = cfg.pools
    # one reward actor per model per replica (cluster/driver/pools.reward_actor_count)
    counts = {"rollout": pools.rollout.processes, "learner": pools.learner.processes,
              "reward": max(1, pools.reward.num_actors) * len(cfg.rewards.models)}
    out: list[Device] = []
    for role in ("rollout", "reward", "learner"):
        share = getattr(pools, role).num_gpus
        if not 0 < share < 1:
            continue
        for _ in range(counts[role]):
            dev = next((d for d in out if sum(s for _, s in d.shares) + share <= 1 + 1e-9), None)
            if dev is None:
                dev = Device([])
                out.append(dev)
            dev.shares.append((role, share))
    return out


def device_total(peaks: dict[str, float], dev: Device, reserved: float) -> float:
    """A shared device's peak: every process's peak and what each reserves besides (`reserved`
    bytes: plan.gpu_reserved_gib)."""
    return sum(peaks[r] + reserved for r in dev.roles)


def free_fraction(need: float, cap_gib: float) -> float:
    return 1.0 - need / (cap_gib * GB)
