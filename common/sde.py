"""SDE schemes for flow-matching rollouts (ALGORITHM.md sections 1, 2 and 4).

Every scheme turns (x, v, σ_k, σ_{k+1}) into a Gaussian transition x' = μ + std·z. Each
scheme is a small class with one formula for `std`, one for `mean` and one for `dmu_dv`
(the equalizer's ∂μ/∂v). The shared helpers below sample a step, score a step's
log-prob (averaged over elements) and compute the Gaussian KL between two means.

Statistics are computed in fp32 whatever the input dtype. σ may be a Python float or a
tensor of shape [B]; it broadcasts over any latent shape [B, ...].
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from common.config import DEFAULT_ETA
from common.methods import method_of

LOG_2PI = math.log(2.0 * math.pi)


# --- schedule ------------------------------------------------------------------------


def _fp32(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float32))


@dataclass(frozen=True)
class Schedule:
    """σ_0 = 1 > σ_1 > … > σ_T = 0, stored explicitly so a rollout can carry it.

    Every σ is held at fp32 precision: the learner reads them as fp32 tensors, so the sampler's
    Python floats must be the same numbers for a replayed step to give log r = 0 exactly.
    """

    sigmas: tuple[float, ...]

    def __post_init__(self):
        object.__setattr__(self, "sigmas", tuple(_fp32(v) for v in self.sigmas))

    @classmethod
    def linear(cls, steps: int, shift: float = 1.0) -> Schedule:
        """Linear in [1, 0], then shifted: σ' = s·σ / (1 + (s-1)·σ)."""
        if steps < 1:
            raise ValueError(f"steps must be ≥ 1, got {steps}")
        base = [1.0 - i / steps for i in range(steps + 1)]
        return cls(tuple(shift * s / (1.0 + (shift - 1.0) * s) for s in base))

    @classmethod
    def explicit(cls, sigmas) -> Schedule:
        s = tuple(float(x) for x in sigmas)
        if len(s) < 2 or any(b >= a for a, b in zip(s, s[1:], strict=False)):
            raise ValueError("sigmas must hold at least two strictly decreasing values")
        return cls(s)

    @classmethod
    def from_config(cls, cfg) -> Schedule:
        """From a common.config.ScheduleConfig."""
        return cls.explicit(cfg.sigmas) if cfg.sigmas is not None else cls.linear(cfg.steps, cfg.shift)

    @property
    def steps(self) -> int:
        return len(self.sigmas) - 1

    def pair(self, k: int) -> tuple[float, float]:
        """(σ_k, σ_{k+1}) for step k."""
        return self.sigmas[k], self.sigmas[k + 1]

    def tensor(self) -> Tensor:
        return torch.tensor(self.sigmas, dtype=torch.float64)


# --- helpers -------------------------------------------------------------------------


def _as_batch(sigma, like: Tensor | None = None) -> Tensor:
    """σ as an fp32 tensor; a [B] σ is viewed as [B, 1, 1, ...] to broadcast against `like`."""
    t = torch.as_tensor(sigma, dtype=torch.float32, device=None if like is None else like.device)
    if like is not None and t.dim() == 1:
        t = t.view(-1, *([1] * (like.dim() - 1)))
    return t


def _f32(x: Tensor) -> Tensor:
    return x.to(torch.float32)


def _drifted_mean(x: Tensor, v: Tensor, s: Tensor, s1: Tensor, c: Tensor) -> Tensor:
    """μ = x - Δ·v - c·ε̂ with ε̂ = x + (1-σ)·v, regrouped as (1-c)·x - (Δ + c·(1-σ))·v so the
    coefficients are computed on σ's shape and only three operations touch the latents."""
    return (1 - c) * _f32(x) - ((s - s1) + c * (1 - s)) * _f32(v)


# --- schemes -------------------------------------------------------------------------

Param = float | str | None  # the type of one constructor argument


@dataclass(frozen=True)
class SchemeSpec:
    """How a rollout's transitions were sampled, complete: a scheme's name, every argument of its
    constructor and the schedule σ_0 … σ_T it ran on.

    A Trajectory carries it, so the learner replays a step with exactly the sampler's scheme and
    never fills a gap from its own config (the idea of diffusers' `register_to_config`: an object
    describes itself). `Scheme.spec` writes it, `scheme_from_spec` reads it back, exactly.
    """

    name: str
    params: tuple[tuple[str, Param], ...]   # (argument, value), in the constructor's order
    sigmas: tuple[float, ...]

    def __post_init__(self):  # lists in, tuples held: a spec compares and hashes by value
        object.__setattr__(self, "params", tuple((str(a), v) for a, v in self.params))
        object.__setattr__(self, "sigmas", tuple(float(s) for s in self.sigmas))

    @property
    def kwargs(self) -> dict[str, Param]:
        return dict(self.params)

    def schedule(self) -> Schedule:
        return Schedule.explicit(self.sigmas)

    def describe(self) -> str:
        """One line for messages: `sage(eta=0.5, clamp_c=0.003) on 11 sigmas`."""
        args = ", ".join(f"{k}={v!r}" for k, v in self.params)
        return f"{self.name}({args}) on {len(self.sigmas)} sigmas"


class Scheme:
    """A Gaussian transition x' = μ(x, v) + std·z for one step σ_k → σ_{k+1}."""

    name: ClassVar[str]
    arg_names: ClassVar[tuple[str, ...]] = ("eta",)
    """Every constructor argument, each kept as the attribute of the same name (what `spec` reads)."""

    def __init__(self, eta: float = 0.0):
        self.eta = float(eta)

    def arguments(self) -> tuple[tuple[str, Param], ...]:
        """(argument, value) of every constructor argument, in the constructor's order."""
        return tuple((a, getattr(self, a)) for a in self.arg_names)

    def spec(self, schedule: Schedule) -> SchemeSpec:
        """This scheme, with every constructor argument, on `schedule`."""
        return SchemeSpec(self.name, self.arguments(), tuple(schedule.sigmas))

    def std(self, sigma, sigma_next) -> Tensor:
        raise NotImplementedError

    def mean(self, x: Tensor, v: Tensor, sigma, sigma_next) -> Tensor:
        raise NotImplementedError

    def dmu_dv(self, sigma, sigma_next) -> Tensor:
        """|∂μ/∂v| per step, for the gradient norm equalizer."""
        raise NotImplementedError

    def log_prob(self, x_next: Tensor, mu: Tensor, std) -> Tensor:
        """log π(x'|x) per sample [B]: the element-averaged Gaussian (module-level `log_prob`)."""
        return log_prob(x_next, mu, std)

    def logp_scale(self, std: Tensor) -> Tensor:
        """|∂ log π / ∂μ| per unit noise: 1/std for the Gaussian (the equalizer's N_k divides by it)."""
        return 1.0 / std

    def __repr__(self) -> str:
        return f"{type(self).__name__}(eta={self.eta})"


class ODE(Scheme):
    """Euler step, deterministic: μ = x - Δ·v, std = 0."""

    name = "ode"

    def std(self, sigma, sigma_next):
        return torch.zeros_like(_as_batch(sigma))

    def mean(self, x, v, sigma, sigma_next):
        s, s1 = _as_batch(sigma, x), _as_batch(sigma_next, x)
        return _f32(x) - (s - s1) * _f32(v)

    def dmu_dv(self, sigma, sigma_next):
        return _as_batch(sigma) - _as_batch(sigma_next)


class Dance(Scheme):
    """DanceGRPO: std = η·√Δ, μ = x - Δ·v - (η²·Δ / 2σ)·ε̂."""

    name = "dance"

    def std(self, sigma, sigma_next):
        delta = _as_batch(sigma) - _as_batch(sigma_next)
        return self.eta * delta.clamp_min(0).sqrt()

    def mean(self, x, v, sigma, sigma_next):
        s, s1 = _as_batch(sigma, x), _as_batch(sigma_next, x)
        return _drifted_mean(x, v, s, s1, self.eta**2 * (s - s1) / (2 * s))

    def dmu_dv(self, sigma, sigma_next):
        s, s1 = _as_batch(sigma), _as_batch(sigma_next)
        delta = s - s1
        return delta + self.eta**2 * delta * (1 - s) / (2 * s)


class _NoiseScaled(Scheme):
    """FlowGRPO's step for a noise scale g(σ) each subclass defines: std = g·√Δ,
    μ = x - Δ·v - (g²·Δ / 2σ)·ε̂ (Flow and Flash differ in g alone)."""

    def std(self, sigma, sigma_next):
        delta = _as_batch(sigma) - _as_batch(sigma_next)
        return self.g(sigma) * delta.clamp_min(0).sqrt()

    def mean(self, x, v, sigma, sigma_next):
        s, s1 = _as_batch(sigma, x), _as_batch(sigma_next, x)
        return _drifted_mean(x, v, s, s1, self.g(s) ** 2 * (s - s1) / (2 * s))

    def dmu_dv(self, sigma, sigma_next):
        s, s1 = _as_batch(sigma), _as_batch(sigma_next)
        delta = s - s1
        return delta + self.g(sigma) ** 2 * delta * (1 - s) / (2 * s)


class Flow(_NoiseScaled):
    """FlowGRPO: std = g·√Δ with g = η·√(σ_k/(1-σ̄)); μ = x - Δ·v - (g²·Δ / 2σ_k)·ε̂.

    At σ_k = 1 the denominator vanishes. `first_step="sigma1"` uses σ̄ = σ_1 there, in the
    denominator only (FlowGRPO's code); `first_step="clamp"` clamps that same 1-σ at c instead
    (the SAGE paper's regime b). Elsewhere σ̄ = σ_k.
    """

    name = "flow"
    arg_names = ("eta", "first_step", "sigma1", "clamp_c")

    def __init__(self, eta: float = 0.7, first_step: str = "sigma1", sigma1: float | None = None,
                 clamp_c: float = 3e-3):
        super().__init__(eta)
        if first_step not in ("sigma1", "clamp"):
            raise ValueError(f"first_step must be 'sigma1' or 'clamp', got {first_step!r}")
        self.first_step = first_step
        self.sigma1 = None if sigma1 is None else float(sigma1)
        self.clamp_c = float(clamp_c)

    def g(self, sigma) -> Tensor:
        """g = η·√(σ_k / (1-σ̄)): σ̄ replaces σ_k in the denominator only, as upstream does."""
        s = _as_batch(sigma)
        if self.first_step == "clamp":
            return self.eta * (s / (1 - s).clamp_min(self.clamp_c)).sqrt()
        if self.sigma1 is None:
            raise ValueError("flow with first_step='sigma1' needs sigma1 (σ_1 of the schedule)")
        s_bar = torch.where(s >= 1.0, torch.full_like(s, self.sigma1), s)
        return self.eta * (s / (1 - s_bar)).sqrt()



class CPS(Scheme):
    """Coefficients-preserving: std = σ_{k+1}·sin(η·π/2), μ = (1-σ_{k+1})·x̂0 + √(σ_{k+1}² - std²)·ε̂.

    Log-prob: upstream's `-mean((x'-μ)²)` by default (`log_prob_form="mse"`, no scale or
    normaliser, so ratios and clipping match upstream); `"gaussian"` uses the full Gaussian.
    """

    name = "cps"
    arg_names = ("eta", "log_prob_form")

    def __init__(self, eta: float = 0.7, log_prob_form: str = "mse"):
        super().__init__(eta)
        if log_prob_form not in ("mse", "gaussian"):
            raise ValueError(f"log_prob_form must be 'mse' or 'gaussian', got {log_prob_form!r}")
        self.log_prob_form = log_prob_form

    def log_prob(self, x_next, mu, std):
        if self.log_prob_form == "gaussian":
            return log_prob(x_next, mu, std)
        sq = ((_f32(x_next) - _f32(mu)) ** 2).flatten(1).mean(1)   # [B]
        std = torch.as_tensor(std, dtype=torch.float32, device=sq.device)
        return torch.where(std > 0, -sq, torch.zeros_like(sq))    # a step with std 0 carries none

    def logp_scale(self, std):
        # ∂(-(x'-μ)²)/∂μ = 2·(x'-μ) ≈ 2·std·z
        return 1.0 / std if self.log_prob_form == "gaussian" else 2.0 * std

    def std(self, sigma, sigma_next):
        return _as_batch(sigma_next) * math.sin(self.eta * math.pi / 2)

    def mean(self, x, v, sigma, sigma_next):
        x, v = _f32(x), _f32(v)
        s, s1 = _as_batch(sigma, x), _as_batch(sigma_next, x)
        std = s1 * math.sin(self.eta * math.pi / 2)
        x0_hat, eps_hat = x - s * v, x + (1 - s) * v
        return (1 - s1) * x0_hat + (s1**2 - std**2).clamp_min(0).sqrt() * eps_hat

    def dmu_dv(self, sigma, sigma_next):
        s, s1 = _as_batch(sigma), _as_batch(sigma_next)
        std = self.std(sigma, sigma_next)
        return ((1 - s) * (s1**2 - std**2).clamp_min(0).sqrt() - s * (1 - s1)).abs()


class Sage(Scheme):
    """SAGE-GRPO's precise variance: std = √Σ_k, μ = x - Δ·v - (Σ_k / 2σ_k)·ε̂, where

    Σ_k = ∫_{σ_{k+1}}^{σ_k} η²·s/(1-s) ds = η²·[log((1-σ_{k+1}) / (1-σ̃_k)) - Δ],  σ̃_k = min(σ_k, 1-c).
    """

    name = "sage"
    arg_names = ("eta", "clamp_c")

    def __init__(self, eta: float = 0.5, clamp_c: float = 3e-3):
        super().__init__(eta)
        self.clamp_c = float(clamp_c)

    def variance(self, sigma, sigma_next) -> Tensor:
        """Σ_k in float64 (the log and -Δ nearly cancel on small steps, so fp32 would lose it)."""
        # σ is rounded to fp32 first, as the learner holds it, so both sides compute the same Σ
        s = torch.as_tensor(sigma, dtype=torch.float32).double()
        s1 = torch.as_tensor(sigma_next, dtype=torch.float32).double()
        s_tilde = s.clamp_max(1 - self.clamp_c)
        var = self.eta**2 * (torch.log1p((s_tilde - s1) / (1 - s_tilde)) - (s - s1))
        return var.clamp_min(0)

    def std(self, sigma, sigma_next):
        return self.variance(sigma, sigma_next).sqrt().float()

    def mean(self, x, v, sigma, sigma_next):
        s, s1 = _as_batch(sigma, x), _as_batch(sigma_next, x)
        return _drifted_mean(x, v, s, s1, self.variance(s, s1).float() / (2 * s))

    def dmu_dv(self, sigma, sigma_next):
        s, s1 = _as_batch(sigma), _as_batch(sigma_next)
        return (s - s1) + self.variance(s, s1).float() * (1 - s) / (2 * s)


class Flash(_NoiseScaled):
    """Flash-GRPO's SDE: FlowGRPO's step with g = η·(σ_min + (σ_max - σ_min)·σ_k), σ_max = σ_1 and
    σ_min = σ_T of the schedule (its sde_step_with_logprob, η = 1): std = g·√Δ,
    μ = x - Δ·v - (g²·Δ / 2σ_k)·ε̂. Linear in σ, so the first step (σ = 1) needs no special case."""

    name = "flash"
    arg_names = ("eta", "sigma_max", "sigma_min")

    def __init__(self, eta: float = 1.0, sigma_max: float | None = None, sigma_min: float = 0.0):
        super().__init__(eta)
        self.sigma_max = None if sigma_max is None else float(sigma_max)
        self.sigma_min = float(sigma_min)

    def g(self, sigma) -> Tensor:
        if self.sigma_max is None:
            raise ValueError("flash needs sigma_max (σ_1 of the schedule)")
        return self.eta * (self.sigma_min + (self.sigma_max - self.sigma_min) * _as_batch(sigma))



SCHEMES: dict[str, type[Scheme]] = {c.name: c for c in (ODE, Dance, Flow, CPS, Sage, Flash)}


def make_scheme(name: str, eta: float | None = None, schedule: Schedule | None = None,
                flow_first_step: str = "sigma1", clamp_c: float = 3e-3,
                cps_log_prob: str = "mse") -> Scheme:
    """Build a scheme by name. `schedule` provides σ_1 for FlowGRPO's first-step trick and
    Flash-GRPO's σ_max (σ_1) and σ_min (σ_T)."""
    if name not in SCHEMES:
        raise ValueError(f"unknown SDE scheme {name!r}; expected one of {sorted(SCHEMES)}")
    eta = DEFAULT_ETA[name] if eta is None else eta
    if name == "flow":
        sigma1 = schedule.sigmas[1] if schedule is not None else None
        return Flow(eta, first_step=flow_first_step, sigma1=sigma1, clamp_c=clamp_c)
    if name == "sage":
        return Sage(eta, clamp_c=clamp_c)
    if name == "flash":
        bounds = (schedule.sigmas[1], schedule.sigmas[-1]) if schedule is not None else (None, 0.0)
        return Flash(eta, *bounds)
    if name == "cps":
        return CPS(eta, log_prob_form=cps_log_prob)
    return SCHEMES[name](eta)


def scheme_from_config(cfg, schedule: Schedule) -> Scheme:
    """From a common.config.RunConfig."""
    return make_scheme(cfg.sde.scheme, cfg.sde.resolved_eta, schedule,
                       cfg.sde.flow_first_step, cfg.sde.clamp_c, cfg.sde.cps_log_prob)


def rollout_spec(cfg, schedule: Schedule | None = None, scheme: Scheme | None = None) -> SchemeSpec:
    """The spec a run's rollouts are stamped with (rollout_worker.sampler.sample_group): its
    configured scheme on its configured schedule; DiffusionNFT's (grpo.loss=nft) are ODE throughout,
    and a method with a stochastic band (MethodSpec.sde_band) names the scheme its band ran with.
    The learner admits only trajectories of this spec (learner/admit.py). `schedule`, `scheme`:
    the config's, when the caller built them already."""
    schedule = schedule or Schedule.from_config(cfg.schedule)
    spec = method_of(cfg)
    ran = scheme or scheme_from_config(cfg, schedule) if spec.records_steps or spec.sde_band else ODE()
    return ran.spec(schedule)


def scheme_from_spec(spec: SchemeSpec) -> Scheme:
    """The scheme `spec` describes, built from its arguments only (the inverse of `Scheme.spec`).

    Raises ValueError when the name is unknown or the arguments are not exactly the
    constructor's: a missing one would silently take a default the sampler may not have used.
    """
    cls = SCHEMES.get(spec.name)
    if cls is None:
        raise ValueError(f"unknown SDE scheme {spec.name!r}; expected one of {sorted(SCHEMES)}")
    names = tuple(a for a, _ in spec.params)
    if names != cls.arg_names:
        raise ValueError(f"scheme {spec.name!r} takes the arguments {list(cls.arg_names)}, "
                         f"the spec holds {list(names)}")
    return cls(**spec.kwargs)


# --- the shared step operations ------------------------------------------------------


def _bcast(t: Tensor, like: Tensor) -> Tensor:
    return t.view(-1, *([1] * (like.dim() - 1))) if t.dim() == 1 else t


def sample_step(scheme: Scheme, x: Tensor, v: Tensor, sigma, sigma_next,
                generator: torch.Generator | None = None, std: Tensor | None = None
                ) -> tuple[Tensor, Tensor, Tensor]:
    """Draw x' = μ + std·z. Returns (x' [B, ...] fp32, μ [B, ...], std [B] or scalar).

    `std`: scheme.std(σ, σ') when the caller has it already (the sampler checks it first).
    """
    mu = scheme.mean(x, v, sigma, sigma_next)
    std = (scheme.std(sigma, sigma_next) if std is None else std).to(mu.device)
    z = torch.randn(mu.shape, generator=generator, dtype=torch.float32, device="cpu").to(mu.device)
    return mu + _bcast(std, mu) * z, mu, std


def log_prob(x_next: Tensor, mu: Tensor, std) -> Tensor:
    """Element-averaged Gaussian log-density of x' under N(μ, std²): one value per sample [B].

    A step with std = 0 (ODE, CPS's last step) carries no log-prob; it gives 0.
    """
    sq = (_f32(x_next) - _f32(mu)) ** 2
    sq = sq.flatten(1).mean(1) if sq.dim() > 1 else sq   # mean ‖x' - μ‖² per sample [B]
    std = torch.as_tensor(std, dtype=torch.float32, device=sq.device)
    safe = torch.where(std > 0, std, torch.ones_like(std))
    lp = -sq / (2 * safe**2) - torch.log(safe) - 0.5 * LOG_2PI
    return torch.where(std > 0, lp, torch.zeros_like(lp))


def gaussian_kl(mu_a: Tensor, mu_b: Tensor, std, eps: float = 1e-6) -> Tensor:
    """KL(N(μ_a, std²) ‖ N(μ_b, std²)) averaged over elements: mean(‖μ_a - μ_b‖²) / (2·(std² + eps)). [B]"""
    sq = ((_f32(mu_a) - _f32(mu_b)) ** 2).flatten(1).mean(1)
    std = torch.as_tensor(std, dtype=torch.float32, device=sq.device)
    return sq / (2 * (std**2 + eps))


# --- gradient norm equalizer ---------------------------------------------------------


def grad_scale(scheme: Scheme, sigma, sigma_next) -> Tensor:
    """N_k = |∂μ/∂v| / std_k (Gaussian log-prob), the per-step scale of ∂ log π / ∂v."""
    return scheme.dmu_dv(sigma, sigma_next).abs() * scheme.logp_scale(scheme.std(sigma, sigma_next))


def equalizer_weights(scheme: Scheme, schedule: Schedule, steps: list[int] | None = None) -> Tensor:
    """w_k = median_j(N_j) / N_k over the given steps (default: all); non-finite or non-positive N → 1."""
    ks = list(range(schedule.steps)) if steps is None else list(steps)
    n = torch.stack([grad_scale(scheme, *schedule.pair(k)).reshape(()) for k in ks]).double()
    ok = torch.isfinite(n) & (n > 0)
    w = torch.ones_like(n)
    if ok.any():
        w[ok] = n[ok].median() / n[ok]
    return w.float()
