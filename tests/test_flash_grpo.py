"""Flash-GRPO: one timestep per group shared by its members, its SDE against its step's equations
written out here, and its rectified loss (no σ/Δ factor on the gradient) against its loss written
out here on a fixed batch."""

from __future__ import annotations

import math

import pytest
import torch
from helpers_tiny import TinyVideoModel

from common.config import RunConfig
from common.sde import Schedule, grad_scale, make_scheme
from common.types import Condition, Group, Scores, TrainBatch, Trajectory
from learner.losses import LossConfig, compute_loss
from learner.rows import build_rows, micro_batches, step_weights
from rollout_worker.sampler import draw_trained_steps, sample_group

SHAPE = (3, 2, 4, 4)
FLASH = {"sde": {"scheme": "flash"}, "align": {"enabled": False}, "bank": {"enabled": False},
         "kl": {"strategy": "none"},
         "grpo": {"equalizer": False, "rectify": True, "adv_std": "batch", "clip_eps": 1e-3},
         "sampler": {"train_steps": "one_per_group", "train_fraction": 0.51, "untrained_steps": "ode",
                     "group_size": 4},
         "schedule": {"steps": 20, "shift": 3.0}}


def flash_cfg(**sections) -> RunConfig:
    base = {k: dict(v) for k, v in FLASH.items()}
    for k, v in sections.items():
        base[k] = {**base.get(k, {}), **v}
    return RunConfig.model_validate(base)


def upstream_step(x, v, sigmas, k):
    """Flash-GRPO's sde_step_with_logprob written out: std_dev_t = σ_min + (σ_max - σ_min)·σ with
    σ_max = σ_1, σ_min = σ_T; mean = x·(1 + g²·dt/(2σ)) + v·(1 + g²·(1-σ)/(2σ))·dt, dt = σ' - σ;
    std = g·√(-dt). Also its coefficient 1/(√(-dt)/g + g·√(-dt)·(1-σ)/(2σ))."""
    s, s1 = sigmas[k], sigmas[k + 1]
    dt = s1 - s
    g = sigmas[-1] + (sigmas[1] - sigmas[-1]) * s
    mean = x * (1 + g ** 2 / (2 * s) * dt) + v * (1 + g ** 2 * (1 - s) / (2 * s)) * dt
    std = g * math.sqrt(-dt)
    coe = 1 / (math.sqrt(-dt) / g + g * math.sqrt(-dt) * (1 - s) / (2 * s))
    return mean, std, coe


def upstream_log_prob(x_next, mean, std):
    lp = -((x_next - mean) ** 2) / (2 * std ** 2) - math.log(std) - math.log(math.sqrt(2 * math.pi))
    return lp.flatten(1).mean(1)


def test_one_step_per_group_shared_by_its_members_from_the_first_half():
    cfg = flash_cfg()
    s = Schedule.from_config(cfg.schedule)
    scheme = make_scheme("flash", None, s)
    seen = set()
    for seed in range(200):
        steps = draw_trained_steps(s, scheme, cfg.sampler, seed, members=4)
        assert len(steps[0]) == 1 and all(m == steps[0] for m in steps)  # iso-temporal: one k for all
        seen.add(steps[0][0])
    assert seen == set(range(10))   # its index among the first 10 of 20 steps (timestep_fraction 0.51)


def test_the_toy_row_draws_from_the_first_half_of_its_ten_steps():
    """configs/compare_toy.yaml's Flash-GRPO row: 10 steps, the last one ODE (ode_last_steps 1, from
    the quickstart), so 9 can be trained; its step comes from the schedule's first half, 0-4
    (floor(0.51·10) = 5), as upstream's from the first 10 of 20, not floor(0.51·9) = 4 of them."""
    from pathlib import Path

    from cluster.compare.matrix import load_matrix

    cfg = load_matrix(Path(__file__).resolve().parents[1] / "configs" / "compare_toy.yaml").config("Flash-GRPO", 0)
    s = Schedule.from_config(cfg.schedule)
    assert s.steps == 10 and cfg.sampler.ode_last_steps == 1
    scheme = make_scheme("flash", None, s)
    seen = {draw_trained_steps(s, scheme, cfg.sampler, seed, members=2)[0][0] for seed in range(200)}
    assert seen == set(range(5))


def test_flash_group_runs_the_sde_at_its_step_only():
    model = TinyVideoModel()
    cfg = flash_cfg(schedule={"steps": 6, "shift": 3.0})
    g = sample_group(model, Condition("c", "a prompt"), cfg, seed=4, policy_version=0)
    k = g.members[0].step_indices
    assert len(k) == 1 and all(t.step_indices == k for t in g.members)
    assert not torch.allclose(g.members[0].final_latents, g.members[1].final_latents)
    s = Schedule.from_config(cfg.schedule)  # the spec carries the σ bounds the rollout's g used
    assert g.members[0].spec == make_scheme("flash", None, s).spec(s)
    assert g.members[0].spec.kwargs == {"eta": 1.0, "sigma_max": s.sigmas[1], "sigma_min": s.sigmas[-1]}


@pytest.mark.parametrize("k", [0, 3, 9])
def test_flash_sde_matches_its_step_equations(k):
    sched = Schedule.linear(20, 3.0)
    sig = list(sched.sigmas)
    scheme = make_scheme("flash", None, sched)
    g = torch.Generator().manual_seed(k)
    x, v = torch.randn(2, *SHAPE, generator=g), torch.randn(2, *SHAPE, generator=g)
    mean, std, coe = upstream_step(x, v, sig, k)
    mu = scheme.mean(x, v, *sched.pair(k))
    assert torch.allclose(mu, mean, atol=1e-6)
    assert float(scheme.std(*sched.pair(k))) == pytest.approx(std, rel=1e-6)
    x_next = mean + std * torch.randn(2, *SHAPE, generator=g)
    assert torch.allclose(scheme.log_prob(x_next, mu, scheme.std(*sched.pair(k))),
                          upstream_log_prob(x_next, mean, std), atol=1e-5)
    assert 1.0 / float(grad_scale(scheme, *sched.pair(k))) == pytest.approx(coe, rel=1e-5)


def _velocity(W):
    def v(x, sigma, cond=None):
        return torch.einsum("ij,bj...->bi...", W, x) * (1 + sigma.view(-1, 1, 1, 1, 1))
    return v


def _batch(sched, W_old) -> TrainBatch:
    """Three groups, each at its own single step, sampled by an 'old' velocity."""
    g = torch.Generator().manual_seed(0)
    scheme = make_scheme("flash", None, sched)
    fresh = []
    for gi, k in enumerate((0, 4, 8)):
        cond = Condition(f"c{gi}", f"p{gi}")
        x = torch.randn(1, *SHAPE, generator=g).expand(4, *SHAPE)
        s = torch.full((4,), sched.sigmas[k])
        mu = scheme.mean(x, _velocity(W_old)(x, s), *sched.pair(k))
        std = scheme.std(*sched.pair(k))
        xn = mu + std * torch.randn(4, *SHAPE, generator=g)
        lp = scheme.log_prob(xn, mu, std)
        members = [Trajectory(condition=cond, group_id=f"g{gi}", member=i, seed=0, spec=scheme.spec(sched),
                              guidance_scale=1.0, policy_version=0, step_indices=[k],
                              x=x[i:i + 1].clone(), x_next=xn[i:i + 1], logp_old=lp[i:i + 1],
                              final_latents=torch.zeros(SHAPE)) for i in range(4)]
        r = torch.randn(4, generator=g)
        fresh.append(Group(cond, f"g{gi}", 0, members, Scores(["h"], r.view(-1, 1)), r))
    return TrainBatch(fresh)


def reference_flash_loss(batch, sched, W, clip, adv_clip=5.0):
    """Flash-GRPO's policy loss written out: advantages (R - group mean) / (global std + 1e-8),
    clipped; ratio from its step's log-prob; each row times its coefficient 1/N_k and w = 1/mean
    over the batch of those coefficients; mean of the clipped surrogate max(-c·A·r, -c·A·clip(r))."""
    allr = torch.cat([g.composite for g in batch.fresh]).double()
    std = allr.std(unbiased=False)
    terms, coes = [], []
    for grp in batch.fresh:
        adv = ((grp.composite.double() - grp.composite.double().mean()) / (std + 1e-8)).clamp(-adv_clip, adv_clip)
        for i, t in enumerate(grp.members):
            k = t.step_indices[0]
            sig = list(sched.sigmas)
            v = _velocity(W)(t.x.float(), torch.tensor([sig[k]]))
            mean, sd, coe = upstream_step(t.x.float(), v, sig, k)
            ratio = torch.exp(upstream_log_prob(t.x_next, mean, sd) - t.logp_old)[0]
            a = float(adv[i])
            terms.append((coe, torch.maximum(-a * ratio, -a * ratio.clamp(1 - clip, 1 + clip))))
            coes.append(coe)
    w = 1.0 / (sum(coes) / len(coes))
    return sum(w * c * term for c, term in terms) / len(terms)


def test_rectified_flash_loss_and_gradient_match_its_loss_written_out():
    cfg = flash_cfg()
    sched = Schedule.from_config(cfg.schedule)
    g = torch.Generator().manual_seed(3)
    W_old = torch.eye(3) + 0.1 * torch.randn(3, 3, generator=g)
    W = (W_old + 0.02 * torch.randn(3, 3, generator=g)).requires_grad_(True)  # off-policy: r ≠ 1, some clipped
    batch = _batch(sched, W_old)
    ref = reference_flash_loss(batch, sched, W, clip=1e-3)
    (g_ref,) = torch.autograd.grad(ref, [W])

    rows = build_rows(batch, cfg)
    lc = LossConfig.from_run(cfg)
    got = 0.0
    for mb in micro_batches(rows, 5):
        loss, sums = compute_loss(mb, None, _velocity(W), rows.scheme, lc, 0.0, rows.n, rows.n_align)
        got = got + loss
    (g_got,) = torch.autograd.grad(got, [W])
    assert abs(float(got.detach()) - float(ref.detach())) < 1e-7   # terms of both signs: an absolute bound
    assert torch.allclose(g_got, g_ref, atol=1e-6) and g_ref.abs().max() > 1e-4
    assert float(rows.weight.mean()) == pytest.approx(1.0, rel=1e-6)  # w normalises the coefficients


def test_rectified_gradient_carries_no_sigma_or_step_size_factor():
    """At θ = old with the same standardised noise z, a row's gradient with respect to v has the
    same size at every step when rectified; unrectified it scales with N_k = |∂μ/∂v| / std."""
    sched = Schedule.linear(20, 3.0)
    scheme = make_scheme("flash", None, sched)
    z = torch.randn(1, *SHAPE, generator=torch.Generator().manual_seed(0))
    x = torch.randn(1, *SHAPE, generator=torch.Generator().manual_seed(1))
    ks = (0, 5, 9)
    norms = {}
    for rectify in (True, False):
        cfg = flash_cfg(grpo={"rectify": rectify})
        w = step_weights(scheme, sched, torch.tensor(ks), cfg.grpo)
        out = []
        for j, k in enumerate(ks):
            v = torch.zeros(1, *SHAPE, requires_grad=True)
            mu = scheme.mean(x, v, *sched.pair(k))
            std = scheme.std(*sched.pair(k))
            x_next = (mu + std * z).detach()
            (gv,) = torch.autograd.grad(w[j] * scheme.log_prob(x_next, mu, std).sum(), [v])
            out.append(float(gv.norm()))
        norms[rectify] = out
    assert max(norms[True]) / min(norms[True]) == pytest.approx(1.0, rel=1e-4)
    assert max(norms[False]) / min(norms[False]) > 1.5
