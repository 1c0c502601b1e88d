"""The SDE sampler: one group of G rollouts of one condition, read like a pipeline's __call__.

The model gives the velocity (CFG inside); the scheme from common/sde.py gives each step's
Gaussian; this module owns the loop and what it records. `transition_log_prob` is the
one place a step's log-prob is computed, here and in the learner, so a stored transition
replays exactly.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import torch
from torch import Tensor

from common.config import RunConfig, SamplerConfig, WindowConfig
from common.images import condition_image
from common.methods import method_of
from common.sde import (
    ODE,
    Schedule,
    Scheme,
    make_scheme,
    rollout_spec,
    sample_step,
    scheme_from_config,
)
from common.types import Cond, Condition, Group, Trajectory
from rollout_worker.condition_cache import ConditionCache
from rollout_worker.dpm import DPMSolver2M
from rollout_worker.models.base import VideoModel, encoder_fingerprint, negative_kwargs

_PERM_SEED_OFFSET = 0x5EED  # the step permutation's generator must not replay the noise stream

_LATENT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _velocity(model: VideoModel, x: Tensor, sigma, cond: Cond, sigma_next=None) -> Tensor:
    """v_θ(x, σ, c) for x [B, C, F, H, W] and σ a float or [B].

    No autocast: the adapter runs the transformer with its weights in model.dtype, exactly as
    the learner's Policy.velocity does, so a replayed step has log r = 0 with unchanged weights.
    """
    sig = torch.as_tensor(sigma, dtype=torch.float32).reshape(-1).expand(x.shape[0])
    kw = {}
    if model.needs_sigma_next:  # MeanFlow checkpoints also read the step's end
        kw["sigma_next"] = torch.as_tensor(sigma_next, dtype=torch.float32).reshape(-1).expand(x.shape[0]) \
            .to(model.device)
    return model.velocity(x.to(model.device, torch.float32), sig.to(model.device), cond, **kw)


def samples_per_forward(n: int, rows_per_sample: int, max_rows: int | None) -> int:
    """Samples of a batch of n in one transformer forward with sampler.forward_batch_size =
    max_rows: all n (None), else max_rows // rows_per_sample, at least one."""
    return n if max_rows is None else min(n, max(1, max_rows // rows_per_sample))


def _batched_velocity(model: VideoModel, x: Tensor, sigma, cond: Cond, sigma_next=None,
                      max_rows: int | None = None) -> Tensor:
    """`_velocity` over micro-batches of at most `max_rows` transformer rows (None: one forward).

    A sample takes `model.rows_per_sample` rows (2 where CFG's cond and uncond run in one
    forward), so a micro-batch holds max_rows // that samples, at least one. Rows never interact
    in a forward, so each sample's velocity is the one forward's where the kernels are batch-invariant.
    """
    n = x.shape[0]
    per = samples_per_forward(n, model.rows_per_sample(cond), max_rows)
    if per >= n:
        return _velocity(model, x, sigma, cond, sigma_next)
    sig = torch.as_tensor(sigma, dtype=torch.float32).reshape(-1).expand(n)
    nxt = None if sigma_next is None else torch.as_tensor(sigma_next, dtype=torch.float32).reshape(-1).expand(n)
    return torch.cat([_velocity(model, x[i:i + per], sig[i:i + per], cond.index(slice(i, i + per)),
                                None if nxt is None else nxt[i:i + per]) for i in range(0, n, per)])


def transition_log_prob(model: VideoModel, scheme: Scheme, x: Tensor, x_next: Tensor, sigma, sigma_next,
                        cond: Cond) -> tuple[Tensor, Tensor]:
    """log π(x' | x) averaged over elements, and μ: velocity → scheme.mean → log_prob. ([B], [B, ...])

    σ and σ' are floats or [B] tensors; x and x' may be stored bf16 (they are read as fp32).
    """
    v = _velocity(model, x, sigma, cond, sigma_next)
    mu = scheme.mean(x.to(v.device, torch.float32), v, sigma, sigma_next)
    return scheme.log_prob(x_next.to(mu.device), mu, scheme.std(sigma, sigma_next)), mu


def trainable_steps(schedule: Schedule, scheme: Scheme, scfg: SamplerConfig,
                    model: VideoModel | None = None) -> list[int]:
    """Every step k a draw of `sampler.train_steps` can pick.

    Never a step with std 0 (no log-prob), never one of the last `ode_last_steps` (they run
    as ODE), never one served by a frozen module (`model.trains_sigma`); with `threshold`, only
    steps with σ_k above it.
    """
    last = schedule.steps - scfg.ode_last_steps
    eligible = [k for k in range(max(last, 0))
                if _has_noise(scheme, *schedule.pair(k))
                and (model is None or model.trains_sigma(schedule.sigmas[k]))]
    if scfg.train_steps == "threshold":
        return [k for k in eligible if schedule.sigmas[k] > scfg.sigma_threshold]
    return eligible


def window_start(n: int, wcfg: WindowConfig, version: int, run_seed: int = 0) -> int:
    """MixGRPO's window position l at policy version `version` over n trainable steps (section 2b).

    progressive: l = min(start + s·floor(version / τ), n - w), the paper's Algorithm 1 (l moves by
    s every τ optimizer steps and stops at the last window); random: uniform in 0..n-w, drawn
    anew per version. A function of the version alone, so a resumed run continues the schedule.
    """
    last = max(n - wcfg.width, 0)
    if wcfg.schedule == "random":
        gen = torch.Generator().manual_seed(zlib.crc32(f"window:{run_seed}:{version}".encode()))
        return int(torch.randint(last + 1, (1,), generator=gen))
    return min(wcfg.start + wcfg.stride * (version // wcfg.shift_interval), last)


def draw_trained_steps(schedule: Schedule, scheme: Scheme, scfg: SamplerConfig, seed: int, members: int = 1,
                       model: VideoModel | None = None, version: int = 0, run_seed: int = 0) -> list[list[int]]:
    """The trained steps of each of `members` samples, per `sampler.train_steps` and `step_draw`.

    `fraction` takes floor(fraction·n) of the n trainable steps (at least one) from a random
    permutation seeded by `seed`: one per sample (`per_sample`, as upstream) or one shared by the
    group (`per_group`). `window`: the w steps of MixGRPO's window at `version`, for every member.
    `one_per_group`: Flash-GRPO's one step, drawn by `seed` from the trainable steps among the
    schedule's first floor(fraction·T) (T the schedule's steps, not the n trainable ones: its
    sampler draws an index among the first 10 of its 20 steps), for every member; the first
    trainable step where none of those is.
    """
    steps = trainable_steps(schedule, scheme, scfg, model)
    if not steps or scfg.train_steps in ("all", "threshold"):
        return [list(steps) for _ in range(members)]
    if scfg.train_steps == "window":
        l0 = window_start(len(steps), scfg.window, version, run_seed)
        return [steps[l0:l0 + scfg.window.width] for _ in range(members)]
    gen = torch.Generator().manual_seed(seed + _PERM_SEED_OFFSET)
    if scfg.train_steps == "one_per_group":
        first = math.floor(scfg.train_fraction * schedule.steps + 1e-9)
        pool = [k for k in steps if k < first] or steps[:1]
        return [[pool[int(torch.randint(len(pool), (1,), generator=gen))]]] * members
    n = max(1, math.floor(scfg.train_fraction * len(steps) + 1e-9))
    draws = 1 if scfg.step_draw == "per_group" else members
    subsets = [sorted(steps[int(i)] for i in torch.randperm(len(steps), generator=gen)[:n])
               for _ in range(draws)]
    return subsets * members if scfg.step_draw == "per_group" else subsets


def select_trained_steps(schedule: Schedule, scheme: Scheme, scfg: SamplerConfig, seed: int,
                         model: VideoModel | None = None, version: int = 0) -> list[int]:
    """The first sample's trained steps (the group's, with step_draw=per_group)."""
    return draw_trained_steps(schedule, scheme, scfg, seed, 1, model, version)[0]


def recorded_steps(trained: list[list[int]], schedule: Schedule, scheme: Scheme, cfg: RunConfig,
                   model: VideoModel | None = None) -> list[int]:
    """Steps a group runs with the scheme (even with sampler.untrained_steps = ode): every member's
    trained steps and, with alignment on, every step any member may train (alignment compares
    members' next latents there). Which steps each member stores is its own trained steps alone
    (`sample_group`). None with grpo.loss=nft: its loss reads only the clean final latents."""
    if not method_of(cfg).records_steps:
        return []
    steps = set().union(*map(set, trained)) if trained else set()
    if cfg.align.enabled:
        steps |= set(trainable_steps(schedule, scheme, cfg.sampler, model))
    return sorted(steps)


def condition_seed(condition_id: str, run_seed: int) -> int:
    """A stable seed per condition (and run), for sampler.initial_noise = condition."""
    return zlib.crc32(f"{run_seed}:{condition_id}".encode())


@dataclass(frozen=True)
class PlannedStep:
    """One step a rollout takes: from σ to σ_next with `rule` (a scheme, or the 2M solver)."""

    k: int | None        # the schedule's step index; None on a compressed tail's own σ
    sigma: float
    sigma_next: float
    rule: Scheme | str   # a Scheme, or "dpm2"


def plan_steps(schedule: Schedule, scheme: Scheme, recorded: list[int], cfg: RunConfig) -> list[PlannedStep]:
    """The steps a group runs (section 2b): a recorded step with the scheme; an untrained one with
    the scheme or as ODE (`untrained_steps`, `ode_last_steps`); after the last recorded step (every
    step with grpo.loss=nft) the post-window rule: `post_solver` on the configured σ, or on a
    compressed tail (`post_compress`). A method that records no step but declares a stochastic band
    (MethodSpec.sde_band, AWM's) takes the scheme's step, unrecorded, where the step ends in the band."""
    scfg, rec = cfg.sampler, set(recorded)
    ode_from = schedule.steps - scfg.ode_last_steps
    spec = method_of(cfg)
    records = spec.records_steps
    post = not records or scfg.post_solver != "euler" or scfg.post_compress < 1.0
    a = max(recorded) + 1 if post and recorded else (0 if post else schedule.steps)
    out = []
    for k in range(a):
        keep = k in rec or (k < ode_from and scfg.untrained_steps == "scheme" and records)
        out.append(PlannedStep(k, *schedule.pair(k), scheme if keep else ODE()))
    if a == schedule.steps:
        return out
    rule = "dpm2" if scfg.post_solver == "dpm2" else ODE()
    tail = tail_sigmas(schedule, a, scfg.post_compress, cfg.schedule.shift)
    same = len(tail) == schedule.steps - a + 1
    band = spec.sde_band if not records else None  # a method's stochastic band: the scheme there, unrecorded
    return out + [PlannedStep(a + j if same else None, tail[j], tail[j + 1],
                              scheme if band and band[0] <= tail[j + 1] <= band[1] else rule)
                  for j in range(len(tail) - 1)]


def tail_sigmas(schedule: Schedule, a: int, ratio: float, shift: float) -> list[float]:
    """σ_a … 0 for the steps from a on: the schedule's own (ratio 1), or MixGRPO-Flash's rebuilt
    tail, int(ratio·(T - a + 1)) - 1 steps (at least one) linear in the unshifted time from
    1 - a/T to 0, then shifted by `shift` (its dpm_post_compress_ratio)."""
    own = list(schedule.sigmas[a:])
    if ratio >= 1.0:
        return own
    T = schedule.steps
    m = max(int(ratio * (T - a + 1)) - 1, 1)
    t0 = 1.0 - a / T
    ts = [t0 * (1.0 - j / m) for j in range(m + 1)]
    tail = list(Schedule(tuple(shift * t / (1.0 + (shift - 1.0) * t) for t in ts)).sigmas)
    return [own[0], *tail[1:-1], 0.0]


@torch.no_grad()
def sample_group(model: VideoModel, condition: Condition, cfg: RunConfig, *, seed: int, policy_version: int,
                 group_id: str | None = None, decode: bool = True, cache: ConditionCache | None = None) -> Group:
    """Generate G = sampler.group_size rollouts of `condition` and record their trained transitions.

    `decode=False` leaves the members without frames (an SP follower: only the leader decodes);
    `cache` (the actor's) gives a condition encoded before without encoding it again."""
    G = cfg.sampler.group_size
    group_id = group_id or f"{condition.id}-s{seed}-v{policy_version}"

    # 1. Schedule, scheme, each member's trained steps, the steps run with the scheme, the plan
    schedule = Schedule.from_config(cfg.schedule)
    scheme = scheme_from_config(cfg, schedule)
    trained = draw_trained_steps(schedule, scheme, cfg.sampler, seed, G, model, policy_version, cfg.train.seed)
    noisy = recorded_steps(trained, schedule, scheme, cfg, model)
    plan = plan_steps(schedule, scheme, noisy, cfg)
    stored = [sorted(t) for t in trained] if noisy else [[] for _ in range(G)]  # NFT: none

    # 2. Encode the condition once (or take it from the cache); every member shares it, and it
    # travels with the group
    if cache is None:
        cond = _encode(model, condition, cfg)
    else:
        key = cache.key(condition, encoder_fingerprint(cfg.model, condition.negative_prompt))
        cond = cache.encoded(key, lambda: _encode(model, condition, cfg))

    # 3. Initial noise, 4. the planned steps, 5. decode
    gen = torch.Generator().manual_seed(seed)  # step noise (and the initial noise for "group")
    x = _initial_noise(model, condition, cfg, gen)
    x, steps = _denoise(model, x, cond.to(model.device).repeat(G), plan, set().union(*map(set, stored)),
                        cfg, gen)
    frames = model.decode(x) if decode else None  # uint8 [G, F, H, W, 3]

    # 6. One Trajectory per member with the steps it trains alone (each stacks its own K steps:
    # one copy), stamped with the full spec of the scheme its steps ran with, on the configured
    # schedule (a compressed tail is never recorded), so the learner replays it exactly, and with
    # the encoded condition (one object for the group); NFT's rollouts are ODE throughout
    spec, store = rollout_spec(cfg, schedule, scheme), _LATENT_DTYPES[cfg.sampler.latent_dtype]
    members = [
        Trajectory(condition=condition, group_id=group_id, member=i, seed=seed, spec=spec,
                   guidance_scale=cfg.model.guidance_scale, policy_version=policy_version,
                   step_indices=stored[i], **steps.member(i, stored[i]),
                   final_latents=x[i].to(store).cpu().clone(),
                   frames=None if frames is None else frames[i].cpu(), cond=cond)
        for i in range(G)
    ]
    return Group(condition=condition, group_id=group_id, policy_version=policy_version, members=members)


def _encode(model: VideoModel, condition: Condition, cfg: RunConfig) -> Cond:
    """The condition encoded once (one row, on the CPU), named by what encoded it."""
    image = condition_image(condition, cfg.model.height, cfg.model.width)  # I2V: read from image_path here
    c = model.encode([condition.prompt], None if image is None else image.unsqueeze(0),
                     **negative_kwargs([condition])).to("cpu")
    return Cond(c.tensors, c.uncond, encoder_fingerprint(cfg.model, condition.negative_prompt))


def _initial_noise(model: VideoModel, condition: Condition, cfg: RunConfig, gen: torch.Generator) -> Tensor:
    """Shared by the group (default) or fresh per member; drawn from the step-noise generator
    `gen` with initial_noise=group, else from the condition's own seed. [G, C, F, H, W] fp32"""
    scfg = cfg.sampler
    G = scfg.group_size
    init_gen = gen if scfg.initial_noise == "group" else \
        torch.Generator().manual_seed(condition_seed(condition.id, cfg.train.seed))
    x = model.initial_noise(1 if scfg.shared_noise else G, init_gen).float()
    return _round(x.expand(G, *x.shape[1:]).clone(), _LATENT_DTYPES[scfg.latent_dtype])


@dataclass
class _Recorded:
    """The transitions of the steps some member trains, one [G, ...] tensor per step, in step order."""

    steps: list[int] = field(default_factory=list)
    x: list[Tensor] = field(default_factory=list)
    x_next: list[Tensor] = field(default_factory=list)
    logp: list[Tensor] = field(default_factory=list)
    mu: list[Tensor] | None = None       # None: μ_old not kept

    def member(self, i: int, trained: list[int]) -> dict[str, Tensor | None]:
        """Member i's Trajectory tensors at its trained steps alone: x, x_next [K, C, F, H, W],
        logp_old [K], mu_old or None; all None when it trains none (a stepless Trajectory: its
        final latents only)."""
        mine = set(trained)
        own = [j for j, k in enumerate(self.steps) if k in mine]
        if not own:
            return {"x": None, "x_next": None, "logp_old": None, "mu_old": None}

        def stack(ts: list[Tensor]) -> Tensor:
            return torch.stack([ts[j][i] for j in own])

        return {"x": stack(self.x), "x_next": stack(self.x_next), "logp_old": stack(self.logp).float(),
                "mu_old": stack(self.mu) if self.mu else None}


def _denoise(model: VideoModel, x: Tensor, cond: Cond, plan: list[PlannedStep], recorded: set[int],
             cfg: RunConfig, gen: torch.Generator) -> tuple[Tensor, _Recorded]:
    """Run the plan from x [G, C, F, H, W]; returns the final latents and the `recorded` steps
    (those some member trains).

    The state keeps the stored dtype's values, so a stored step replays exactly. A dpm2 step
    (after the last recorded one) takes DPM-Solver++(2M), which every other step feeds its x̂_0.
    """
    store = _LATENT_DTYPES[cfg.sampler.latent_dtype]
    out = _Recorded(mu=[] if cfg.records_mu_old else None)
    dpm = DPMSolver2M() if any(p.rule == "dpm2" for p in plan) else None
    for p in plan:
        # [G, C, F, H, W], CFG inside, in micro-batches of sampler.forward_batch_size rows
        v = _batched_velocity(model, x, p.sigma, cond, p.sigma_next, cfg.sampler.forward_batch_size)
        if p.rule == "dpm2":
            x = _round(dpm.step(x, v, p.sigma, p.sigma_next), store)
            continue
        if dpm is not None:
            dpm.observe(x, v, p.sigma)
        std = p.rule.std(p.sigma, p.sigma_next)
        if float(std) > 0:
            x_next, mu, std = sample_step(p.rule, x, v, p.sigma, p.sigma_next, generator=gen, std=std)
        else:
            x_next = mu = p.rule.mean(x, v, p.sigma, p.sigma_next)
        x_next = _round(x_next, store)
        if p.k in recorded:
            out.steps.append(p.k)
            out.logp.append(p.rule.log_prob(x_next, mu, std).cpu())  # [G], from exactly the stored tensors
            out.x.append(x.to(store).cpu())
            out.x_next.append(x_next.to(store).cpu())
            if out.mu is not None:
                out.mu.append(mu.float().cpu())
        x = x_next
    return x, out


@torch.no_grad()
def sample_videos(model: VideoModel, prompts: list[str], seeds: list[int], schedule: Schedule,
                  scheme_name: str = "ode", eta: float | None = None, images: Tensor | None = None,
                  forward_batch_size: int | None = None, decode: bool = True) -> Tensor:
    """Evaluation videos, one per (prompt, seed), independent of batch composition; at most
    `forward_batch_size` transformer rows per forward (sampler.forward_batch_size). uint8 [B, F, H, W, 3]
    (`decode=False`: the final latents [B, C, F, H, W])."""
    if len(prompts) != len(seeds):
        raise ValueError(f"sample_videos: {len(prompts)} prompts but {len(seeds)} seeds")
    scheme = make_scheme(scheme_name, eta, schedule)
    # 1. Encode, and one generator per sample for its initial noise and step noise
    cond = model.encode(list(prompts), images)
    gens = [torch.Generator().manual_seed(int(s)) for s in seeds]
    x = torch.cat([model.initial_noise(1, g).float() for g in gens])  # [B, C, F, H, W]
    # 2. Denoising loop
    for k in range(schedule.steps):
        sigma, sigma_next = schedule.pair(k)
        v = _batched_velocity(model, x, sigma, cond, sigma_next, forward_batch_size)
        if _has_noise(scheme, sigma, sigma_next):
            x = torch.cat([sample_step(scheme, x[i:i + 1], v[i:i + 1], sigma, sigma_next, generator=g)[0]
                           for i, g in enumerate(gens)])
        else:
            x = scheme.mean(x, v, sigma, sigma_next)
    # 3. Decode
    return model.decode(x) if decode else x


def _has_noise(scheme: Scheme, sigma: float, sigma_next: float) -> bool:
    return float(scheme.std(sigma, sigma_next).reshape(-1)[0]) > 0


def _round(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x with the values `dtype` can hold, kept in fp32."""
    return x if dtype == torch.float32 else x.to(dtype).float()
