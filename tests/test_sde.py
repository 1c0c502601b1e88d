"""The SDE schemes against their definitions (ALGORITHM.md sections 1, 2, 4 and 7)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.sde import (
    CPS,
    ODE,
    Dance,
    Flow,
    Sage,
    Schedule,
    equalizer_weights,
    gaussian_kl,
    log_prob,
    make_scheme,
    sample_step,
)

SCHEME_NAMES = ["ode", "dance", "flow", "cps", "sage", "flash"]


def _integral(eta: float, a: float, b: float) -> float:
    """∫_a^b η²·s/(1-s) ds by composite Gauss-Legendre quadrature (≈1e-14 on smooth integrands)."""
    import numpy as np

    nodes, weights = np.polynomial.legendre.leggauss(20)
    edges = np.linspace(a, b, 64 + 1)
    total = 0.0
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        mid, half = (lo + hi) / 2, (hi - lo) / 2
        s = mid + half * nodes
        total += half * float(np.sum(weights * eta**2 * s / (1 - s)))
    return total


# --- schedule --------------------------------------------------------------------------


def test_linear_schedule_with_shift_matches_formula():
    sched = Schedule.linear(4, shift=3.0)
    base = [1.0, 0.75, 0.5, 0.25, 0.0]
    assert sched.sigmas == pytest.approx([3 * s / (1 + 2 * s) for s in base])
    assert sched.sigmas[0] == 1.0 and sched.sigmas[-1] == 0.0
    assert Schedule.linear(4, 1.0).sigmas == pytest.approx(base)


def test_explicit_schedule_rejects_non_decreasing():
    with pytest.raises(ValueError, match="strictly decreasing"):
        Schedule.explicit([1.0, 0.5, 0.6, 0.0])


# --- precise variance ------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    eta=st.floats(0.05, 1.5),
    cuts=st.lists(st.floats(0.001, 0.99), min_size=1, max_size=12, unique=True),
)
def test_sage_variance_equals_integral_of_diffusion_coefficient(eta, cuts):
    sigmas = sorted({round(c, 6) for c in cuts} | {0.0}, reverse=True)
    sigmas = [0.995] + [s for s in sigmas if s < 0.995]  # interior steps: no clamp involved
    sched = Schedule.explicit(sigmas)
    sage = Sage(eta, clamp_c=3e-3)
    for k in range(sched.steps):
        s, s1 = sched.pair(k)
        got = float(sage.variance(s, s1).double())
        want = _integral(eta, s1, s)
        assert abs(got - want) < 1e-10 + 1e-6 * abs(want), (k, s, s1, got, want)


def test_sage_variance_first_step_uses_the_clamp_inside_the_log_only():
    sched = Schedule.linear(16, 1.0)
    sage = Sage(0.7, clamp_c=3e-3)
    s, s1 = sched.pair(0)
    want = 0.7**2 * (math.log((1 - s1) / 3e-3) - (s - s1))
    assert float(sage.variance(s, s1)) == pytest.approx(want, rel=1e-6)


def test_paper_regime_b_flow_explodes_and_sage_stays_near_one():
    """ALGORITHM.md section 7: clamped FlowGRPO ≈ 3 at step 0 (2.86 at T=20, 3.19 at T=16), sage ≈ 1.2."""
    for steps in (16, 20):
        sched = Schedule.linear(steps, 1.0)
        flow = Flow(0.7, first_step="clamp", clamp_c=3e-3)
        sage = Sage(0.7)
        assert 2.8 <= float(flow.std(*sched.pair(0))) <= 3.3
        assert 1.0 <= float(sage.std(*sched.pair(0))) <= 1.35
        # after the first step, Euler's variance exceeds the precise one by ≈1.5, 1.3, 1.2 …
        ratios = [float(Flow(0.7, sigma1=sched.sigmas[1]).std(*sched.pair(k)) / sage.std(*sched.pair(k))) ** 2
                  for k in (1, 2, 3)]
        assert ratios[0] == pytest.approx(1.5, abs=0.1)
        assert ratios[0] > ratios[1] > ratios[2] > 1.0


# --- every scheme: std, log-prob, sampling -----------------------------------------------


@pytest.mark.parametrize("name", SCHEME_NAMES)
@pytest.mark.parametrize("shift", [1.0, 3.0, 5.0])
def test_std_finite_and_nonnegative_on_every_step_including_the_last(name, shift):
    sched = Schedule.linear(20, shift)
    sc = make_scheme(name, None, sched)
    for k in range(sched.steps):
        std = sc.std(*sched.pair(k))
        assert torch.isfinite(std).all() and (std >= 0).all(), (name, k, std)
        x = torch.randn(2, 3, 2, 4, 4)
        mu = sc.mean(x, torch.randn_like(x), *sched.pair(k))
        assert torch.isfinite(mu).all(), (name, k)


def test_cps_last_step_is_deterministic_and_carries_no_log_prob():
    sched = Schedule.linear(10, 3.0)
    cps = CPS(0.7)
    s, s1 = sched.pair(sched.steps - 1)
    assert float(cps.std(s, s1)) == 0.0
    x, v = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    assert torch.allclose(cps.mean(x, v, s, s1), x - s * v)  # x̂0
    assert torch.equal(log_prob(torch.randn(2, 3, 4), x, cps.std(s, s1)), torch.zeros(2))


def test_log_prob_equals_torch_normal_mean_over_elements():
    torch.manual_seed(0)
    mu = torch.randn(3, 4, 2, 5, 5)
    std = torch.tensor([0.3, 1.2, 0.05])
    x_next = mu + std.view(-1, 1, 1, 1, 1) * torch.randn_like(mu)
    want = torch.distributions.Normal(mu, std.view(-1, 1, 1, 1, 1)).log_prob(x_next).flatten(1).mean(1)
    assert torch.allclose(log_prob(x_next, mu, std), want, atol=1e-5)
    # a scalar std broadcasts too
    want1 = torch.distributions.Normal(mu, 0.4).log_prob(x_next).flatten(1).mean(1)
    assert torch.allclose(log_prob(x_next, mu, torch.tensor(0.4)), want1, atol=1e-5)


def test_statistics_are_fp32_whatever_the_input_dtype():
    sched = Schedule.linear(8, 3.0)
    sc = Sage(0.5)
    x = torch.randn(2, 4, 4, dtype=torch.bfloat16)
    mu = sc.mean(x, torch.randn_like(x), *sched.pair(2))
    assert mu.dtype == torch.float32
    assert log_prob(x, mu, sc.std(*sched.pair(2))).dtype == torch.float32


@pytest.mark.parametrize("name", ["dance", "flow", "cps", "sage"])
def test_empirical_std_of_sampled_steps_matches_scheme_std(name):
    sched = Schedule.linear(10, 3.0)
    sc = make_scheme(name, None, sched)
    g = torch.Generator().manual_seed(1)
    for k in (0, 4, 8):
        s, s1 = sched.pair(k)
        x = torch.randn(4, 50_000, generator=g)
        v = torch.randn(4, 50_000, generator=g)
        x_next, mu, std = sample_step(sc, x, v, s, s1, generator=g)
        emp = (x_next - mu).std().item()
        assert emp == pytest.approx(float(std), rel=0.02), (name, k)


def test_batched_sigmas_broadcast_over_any_latent_shape():
    sched = Schedule.linear(8, 3.0)
    sc = Sage(0.5)
    x, v = torch.randn(3, 2, 2, 4, 4), torch.randn(3, 2, 2, 4, 4)
    ks = [0, 3, 6]
    s = torch.tensor([sched.sigmas[k] for k in ks])
    s1 = torch.tensor([sched.sigmas[k + 1] for k in ks])
    batched = sc.mean(x, v, s, s1)
    for i, k in enumerate(ks):
        one = sc.mean(x[i : i + 1], v[i : i + 1], *sched.pair(k))
        assert torch.allclose(batched[i : i + 1], one, atol=1e-6)
    assert sc.std(s, s1).shape == (3,)


def test_ode_reproduces_diffusers_flow_match_euler_step():
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = Schedule.linear(12, 3.0)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0)
    scheduler.set_timesteps(sigmas=list(sched.sigmas[:-1]))
    assert torch.allclose(scheduler.sigmas.double(), torch.tensor(sched.sigmas).double(), atol=1e-6)
    ode = ODE()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 3, 8, 8, generator=g)
    ours = x.clone()
    for k, t in enumerate(scheduler.timesteps):
        v = torch.randn(x.shape, generator=g)
        x = scheduler.step(v, t, x, return_dict=False)[0]
        ours = ode.mean(ours, v, *sched.pair(k))
        assert torch.allclose(ours, x, atol=1e-5), k


def test_dance_and_flow_means_match_their_expanded_update_rules():
    """The ε̂ form of ALGORITHM.md equals the x·(1 - a) - v·Δ·(1 + b) form of the authors' code."""
    sched = Schedule.linear(10, 3.0)
    x, v = torch.randn(2, 6), torch.randn(2, 6)
    for k in (0, 3, 7):
        s, s1 = sched.pair(k)
        delta = s - s1
        flow = Flow(0.7, sigma1=sched.sigmas[1])
        g2 = float(flow.g(s)) ** 2
        want = x * (1 - g2 * delta / (2 * s)) - v * delta * (1 + g2 * (1 - s) / (2 * s))
        assert torch.allclose(flow.mean(x, v, s, s1), want, atol=1e-6)
        dance = Dance(0.3)
        want = x - delta * v - (0.09 * delta / (2 * s)) * (x + (1 - s) * v)
        assert torch.allclose(dance.mean(x, v, s, s1), want, atol=1e-6)


@pytest.mark.parametrize("name", ["dance", "flow", "cps", "sage"])
def test_dmu_dv_matches_autograd(name):
    sched = Schedule.linear(10, 3.0)
    sc = make_scheme(name, None, sched)
    for k in range(sched.steps - 1):
        s, s1 = sched.pair(k)
        x = torch.randn(1, 5)
        v = torch.randn(1, 5, requires_grad=True)
        sc.mean(x, v, s, s1).sum().backward()
        assert torch.allclose(v.grad.abs(), sc.dmu_dv(s, s1).abs().expand(1, 5), atol=1e-5), (name, k)


def test_gaussian_kl_zero_for_equal_means_and_matches_formula():
    mu = torch.randn(2, 3, 4, 4)
    assert torch.equal(gaussian_kl(mu, mu, torch.tensor(0.5)), torch.zeros(2))
    d = torch.randn_like(mu) * 0.1
    want = (d**2).flatten(1).mean(1) / (2 * (0.25 + 1e-6))
    assert torch.allclose(gaussian_kl(mu + d, mu, torch.tensor(0.5)), want)
    # equals the KL of two Normals with the same std, averaged over elements
    p = torch.distributions.Normal(mu + d, 0.5)
    q = torch.distributions.Normal(mu, 0.5)
    exact = torch.distributions.kl_divergence(p, q).flatten(1).mean(1)
    assert torch.allclose(gaussian_kl(mu + d, mu, torch.tensor(0.5), eps=0.0), exact, atol=1e-6)


# --- equalizer ---------------------------------------------------------------------------


def test_equalizer_weights_paper_range_for_sage():
    """20 steps, shift 5, η 0.5: weights from about 9 at the first step to about 0.06 at the last."""
    w = equalizer_weights(Sage(0.5), Schedule.linear(20, 5.0))
    assert 6.0 < float(w[0]) < 12.0
    assert 0.03 < float(w[-1]) < 0.1
    assert torch.all(w[:-1] >= w[1:])


def test_equalizer_weight_is_one_for_degenerate_steps():
    sched = Schedule.linear(10, 3.0)
    assert torch.equal(equalizer_weights(ODE(), sched), torch.ones(10))  # std 0 → N non-finite
    w = equalizer_weights(CPS(0.7), sched)
    assert float(w[-1]) == 1.0  # last step: std 0


@pytest.mark.parametrize("name", ["dance", "flow", "sage", "cps"])
def test_equalizer_flattens_per_step_gradient_norms(name):
    """‖∂ log π / ∂v‖ by autograd spans orders of magnitude across steps; times w_k it agrees."""
    sched = Schedule.linear(16, 3.0)
    sc = make_scheme(name, None, sched)
    steps = list(range(sched.steps - 1))  # cps: the last step has no log-prob
    w = equalizer_weights(sc, sched, steps)
    g = torch.Generator().manual_seed(0)
    raw = []
    for k in steps:
        s, s1 = sched.pair(k)
        x = torch.randn(64, 32, generator=g)
        v = torch.randn(64, 32, generator=g, requires_grad=True)
        x_next, _, _ = sample_step(sc, x, v.detach(), s, s1, generator=g)
        mu = sc.mean(x, v, s, s1)
        sc.log_prob(x_next, mu, sc.std(s, s1)).sum().backward()
        raw.append(v.grad.norm().item())
    raw = torch.tensor(raw)
    eq = raw * w
    # dance's std ∝ √Δ keeps N_k nearly flat already; so does cps's upstream -mean((x'-μ)²)
    if name not in ("dance", "cps"):
        assert raw.max() / raw.min() > 10, raw  # raw norms span an order of magnitude or more
    assert eq.max() / eq.min() < 3.0, eq  # equalized: within a small factor


# --- the scheme's full spec (what a Trajectory carries) ---------------------------------

# a value unlike the default for every constructor argument of every scheme
_NON_DEFAULT = {"eta": 0.9137, "first_step": "clamp", "sigma1": 0.8125, "clamp_c": 0.0173,
                "log_prob_form": "gaussian", "sigma_max": 0.9375, "sigma_min": 0.0625}


def _ctor_args(cls) -> dict:
    """The constructor's own parameters (read from its signature, not from arg_names)."""
    import inspect

    names = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    return {n: _NON_DEFAULT[n] for n in names}


@pytest.mark.parametrize("name", SCHEME_NAMES)
def test_spec_holds_every_constructor_argument_and_round_trips(name):
    from common.sde import SCHEMES, SchemeSpec, scheme_from_spec

    cls = SCHEMES[name]
    args = _ctor_args(cls)
    sched = Schedule.linear(7, 2.5)
    scheme = cls(**args)
    spec = scheme.spec(sched)
    assert spec.name == name and spec.kwargs == args and list(spec.kwargs) == list(args)
    assert spec.sigmas == sched.sigmas and spec.schedule() == sched
    back = scheme_from_spec(spec)
    assert type(back) is cls and back.spec(sched) == spec
    assert all(getattr(back, a) == v for a, v in args.items())
    # the rebuilt scheme computes the same numbers, bit for bit
    x, v = torch.randn(2, 3, 2, 4, 4), torch.randn(2, 3, 2, 4, 4)
    for k in range(sched.steps):
        s, s1 = sched.pair(k)
        assert torch.equal(back.std(s, s1), scheme.std(s, s1))
        assert torch.equal(back.mean(x, v, s, s1), scheme.mean(x, v, s, s1))
        assert torch.equal(back.dmu_dv(s, s1), scheme.dmu_dv(s, s1))
    # a spec equals one built from lists, and hashes alike
    twin = SchemeSpec(name, [list(p) for p in spec.params], list(spec.sigmas))
    assert twin == spec and hash(twin) == hash(spec)


@pytest.mark.parametrize("name", SCHEME_NAMES)
def test_spec_of_a_configured_scheme_rebuilds_it_without_the_config(name):
    from common.config import RunConfig
    from common.sde import scheme_from_config, scheme_from_spec

    cfg = RunConfig.model_validate({"sde": {"scheme": name, "eta": 0.77, "flow_first_step": "clamp",
                                            "clamp_c": 0.02, "cps_log_prob": "gaussian"},
                                    "schedule": {"steps": 5, "shift": 2.0}})
    sched = Schedule.from_config(cfg.schedule)
    scheme = scheme_from_config(cfg, sched)
    spec = scheme.spec(sched)
    assert spec.kwargs["eta"] == 0.77
    assert scheme_from_spec(spec).arguments() == scheme.arguments()
    if name == "flow":
        assert spec.kwargs == {"eta": 0.77, "first_step": "clamp", "sigma1": sched.sigmas[1], "clamp_c": 0.02}
    if name == "flash":  # σ_max = σ_1 and σ_min = σ_T of the sampler's schedule
        assert spec.kwargs == {"eta": 0.77, "sigma_max": sched.sigmas[1], "sigma_min": sched.sigmas[-1]}


def test_spec_with_missing_or_unknown_arguments_is_refused():
    from common.sde import SchemeSpec, scheme_from_spec

    sigmas = Schedule.linear(3).sigmas
    with pytest.raises(ValueError, match=r"takes the arguments \['eta', 'clamp_c'\].*\['eta'\]"):
        scheme_from_spec(SchemeSpec("sage", (("eta", 0.5),), sigmas))   # clamp_c would default
    with pytest.raises(ValueError, match="takes the arguments"):
        scheme_from_spec(SchemeSpec("dance", (("eta", 0.5), ("clamp_c", 0.1)), sigmas))
    with pytest.raises(ValueError, match="unknown SDE scheme 'ddim'"):
        scheme_from_spec(SchemeSpec("ddim", (("eta", 0.5),), sigmas))
