"""The loop's math against independent references: upstream recipes re-implemented here from
their published update rules (FlowGRPO, CPS), exact advantages, per-sample step draws, the
exact D_step and both J_align forms."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers_tiny import TinyVideoModel

from common.config import ConfigError, RunConfig, load_config
from common.sde import CPS, Flow, Schedule, gaussian_kl, make_scheme, scheme_from_config
from common.types import Condition, TrainBatch
from learner.advantages import group_advantages
from learner.losses import LossConfig, compute_loss
from learner.rows import MicroBatch, build_rows, micro_batches
from learner.trainer import Trainer
from rollout_worker.sampler import draw_trained_steps, sample_group, trainable_steps

SHAPE = (3, 2, 4, 4)


# --- 1. advantages of a group without signal ------------------------------------------


@pytest.mark.parametrize("G", range(3, 17))
def test_all_equal_rewards_give_exactly_zero_advantages(G):
    rng = np.random.default_rng(G)
    values = np.concatenate([rng.uniform(-3, 3, 300), rng.uniform(0, 1, 300), [0.7, 0.1, 1 / 3, 2.0]])
    mask = torch.ones(G, dtype=torch.bool)
    for v in values.astype(np.float32):
        r = torch.full((G,), float(v), dtype=torch.float32)
        a = group_advantages(r, mask, 5.0)
        assert torch.equal(a, torch.zeros(G)), (G, float(v), a)
        # rewards that went through fp32 arithmetic in another order differ by an ulp: still no signal
        r[0] = torch.nextafter(r[0], torch.tensor(math.inf))
        assert torch.equal(group_advantages(r, mask, 5.0), torch.zeros(G)), (G, float(v))


def test_per_head_advantages_zero_for_a_saturated_head_only():
    s = torch.tensor([[0.3, 0.0], [0.3, 1.0], [0.3, 2.0]])      # head 0 saturated, head 1 not
    a = group_advantages(s.sum(1), torch.ones(3, dtype=torch.bool), 5.0, s, torch.ones(2), "per_head")
    want = (s[:, 1] - 1.0) / s[:, 1].std(unbiased=False)
    assert torch.allclose(a, want, atol=1e-6)


# --- 2. FlowGRPO's step, as upstream writes it ------------------------------------------


def _upstream_flow_step(x, v, sigmas, k, eta, clamp=None):
    """FlowGRPO's SDE step re-implemented from its update rule: std_dev_t = η·√(σ / (1 - σ')),
    σ' = σ_max (= σ_1) where σ = 1; x' mean = x·(1 + std_dev_t²·dt/(2σ)) + v·(1 + std_dev_t²(1-σ)/(2σ))·dt."""
    s, s_prev = float(sigmas[k]), float(sigmas[k + 1])
    dt = s_prev - s
    denom = 1 - (float(sigmas[1]) if s == 1 else s)
    if clamp is not None:
        denom = max(1 - s, clamp)
    std_dev_t = math.sqrt(s / denom) * eta
    mean = x * (1 + std_dev_t**2 / (2 * s) * dt) + v * (1 + std_dev_t**2 * (1 - s) / (2 * s)) * dt
    return mean, std_dev_t * math.sqrt(-dt)


@pytest.mark.parametrize("shift", [1.0, 3.0, 5.0])
def test_flow_first_step_and_every_step_match_upstream(shift):
    sched = Schedule.linear(16, shift)
    flow = Flow(0.7, sigma1=sched.sigmas[1])
    clamped = Flow(0.7, first_step="clamp", clamp_c=3e-3)
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(2, 8, generator=g), torch.randn(2, 8, generator=g)
    for k in range(sched.steps):
        mean, std = _upstream_flow_step(x, v, sched.sigmas, k, 0.7)
        assert float(flow.std(*sched.pair(k))) == pytest.approx(std, rel=1e-5), k
        assert torch.allclose(flow.mean(x, v, *sched.pair(k)), mean, atol=1e-5), k
        mean_c, std_c = _upstream_flow_step(x, v, sched.sigmas, k, 0.7, clamp=3e-3)
        assert float(clamped.std(*sched.pair(k))) == pytest.approx(std_c, rel=1e-5), k
        assert torch.allclose(clamped.mean(x, v, *sched.pair(k)), mean_c, atol=1e-4), k


def test_flow_first_step_is_not_the_sigma1_substituted_everywhere_form():
    sched = Schedule.linear(16, 1.0)
    s1 = sched.sigmas[1]
    wrong = 0.7 * math.sqrt(s1 / (1 - s1)) * math.sqrt(1 - s1)     # σ̄ in numerator too (the old bug)
    got = float(Flow(0.7, sigma1=s1).std(*sched.pair(0)))
    assert got == pytest.approx(wrong / math.sqrt(s1), rel=1e-5)   # low by √σ_1 before the fix


# --- 3. CPS log-prob, as upstream writes it ----------------------------------------------


def test_cps_log_prob_defaults_to_upstreams_negative_mean_square():
    sched = Schedule.linear(10, 3.0)
    g = torch.Generator().manual_seed(1)
    x, v = torch.randn(3, *SHAPE, generator=g), torch.randn(3, *SHAPE, generator=g)
    cps = make_scheme("cps", 0.7, sched)
    s, s1 = sched.pair(2)
    # upstream: x0 = x - σv, ε̂ = x + (1-σ)v, std = σ'·sin(ηπ/2), μ = (1-σ')x0 + √(σ'² - std²)·ε̂
    std_t = s1 * math.sin(0.7 * math.pi / 2)
    mu_ref = (1 - s1) * (x - s * v) + math.sqrt(s1**2 - std_t**2) * (x + (1 - s) * v)
    x_next = mu_ref + std_t * torch.randn(3, *SHAPE, generator=g)
    mu = cps.mean(x, v, s, s1)
    assert torch.allclose(mu, mu_ref, atol=1e-5)
    want = -((x_next - mu_ref) ** 2).flatten(1).mean(1)
    assert torch.allclose(cps.log_prob(x_next, mu, cps.std(s, s1)), want, atol=1e-6)
    gauss = CPS(0.7, log_prob_form="gaussian").log_prob(x_next, mu, cps.std(s, s1))
    ref = torch.distributions.Normal(mu_ref, std_t).log_prob(x_next).flatten(1).mean(1)
    assert torch.allclose(gauss, ref, atol=1e-5)
    cfg = RunConfig.model_validate({"sde": {"scheme": "cps", "cps_log_prob": "gaussian"}})
    assert cfg.sde.cps_log_prob == "gaussian" and RunConfig().sde.cps_log_prob == "mse"


# --- 4. baseline defaults: every step sampled, per-sample subsets, floor, shift 5 -----------


def test_defaults_follow_upstream_baselines():
    cfg = RunConfig()
    assert cfg.sampler.ode_last_steps == 0 and cfg.schedule.shift == 5.0
    assert cfg.sampler.step_draw == "per_sample"
    sched = Schedule.linear(10, 5.0)
    for name in ("dance", "flow", "sage"):  # the last step (σ' = 0) is sampled with noise and trainable
        sc = make_scheme(name, None, sched)
        assert float(sc.std(*sched.pair(9))) > 0
        assert trainable_steps(sched, sc, cfg.sampler) == list(range(10))


def test_trained_steps_are_a_floor_sized_subset_per_sample():
    sched = Schedule.linear(10, 5.0)
    flow = make_scheme("flow", None, sched)
    scfg = RunConfig().sampler.model_copy(update={"train_fraction": 0.99})
    draws = draw_trained_steps(sched, flow, scfg, seed=3, members=8)
    assert all(len(d) == int(10 * 0.99) for d in draws)           # FlowGRPO: int(T·timestep_fraction)
    assert len({tuple(d) for d in draws}) > 1                      # each sample its own subset
    scfg6 = scfg.model_copy(update={"train_fraction": 0.65})
    assert {len(d) for d in draw_trained_steps(sched, flow, scfg6, 0, 4)} == {6}   # floor(6.5), not round
    same = draw_trained_steps(sched, flow, scfg6.model_copy(update={"step_draw": "per_group"}), 0, 4)
    assert all(d == same[0] for d in same)


# --- 5-7. exact D_step, J_align forms, recorded steps, replay -----------------------------


def _cfg(**sections) -> RunConfig:
    base = {"model": {"family": "wan", "num_frames": 2, "height": 8, "width": 8},
            "schedule": {"steps": 5, "shift": 1.0},
            "sampler": {"group_size": 4, "train_fraction": 0.4},
            "optim": {"micro_batch": 64, "lr": 5e-2, "lora_rank": 4}}
    for k, v in sections.items():
        base.setdefault(k, {}).update(v)
    return RunConfig.model_validate(base)


class _Tiny(TinyVideoModel):
    def trains_sigma(self, sigma) -> bool:
        return True

    def initial_noise(self, batch, generator=None):
        return torch.randn(batch, *self.latent_shape, generator=generator)


def _group(model, cfg, cond_id: str, seed: int, version: int = 0, reward=None):
    g = sample_group(model, Condition(cond_id, f"prompt {cond_id}"), cfg, seed=seed, policy_version=version)
    g.composite = torch.stack([t.final_latents.mean() for t in g.members]) if reward is None else reward
    return g


def test_members_store_only_their_trained_steps_and_align_uses_them_where_trained():
    """Group format item 3: a member stores x_k, x_{k+1}, log π_old, μ_old at the steps it trains
    and nowhere else (alignment on or off); a row's x⁺_{k+1} is the winner's own stored step k,
    found only where the winner trained k (and likewise the loser's)."""
    model, cfg = _Tiny(), _cfg()
    g = _group(model, cfg, "c0", seed=1)
    sched = Schedule.from_config(cfg.schedule)
    draws = draw_trained_steps(sched, scheme_from_config(cfg, sched), cfg.sampler, 1, 4, model)
    for m, want in zip(g.members, draws, strict=True):
        assert m.step_indices == sorted(want) and len(want) == 2      # floor(0.4 · 5)
        assert m.x.shape[0] == m.x_next.shape[0] == m.logp_old.shape[0] == m.mu_old.shape[0] == 2
    rows = build_rows(TrainBatch([g]), cfg)
    assert rows.n == 4 * 2
    win, lose = int(g.composite.argmax()), int(g.composite.argmin())
    ks = [(i, k) for i, m in enumerate(g.members) for k in m.step_indices]
    for r, (_, k) in enumerate(ks):
        for who, col in ((win, rows.pos_row), (lose, rows.neg_row)):
            t = g.members[who]
            if k in t.step_indices:
                assert torch.equal(rows.x_next[col[r]], t.x_next[t.step_indices.index(k)])
            else:
                assert col[r] == -1
    both = sum(k in g.members[win].step_indices and k in g.members[lose].step_indices for _, k in ks)
    assert rows.stats["align/rows_used"] == both == rows.n_align and rows.stats["align/rows_wanted"] == 8
    # alignment off stores the same steps, and samples the same trained transitions
    off = _group(model, _cfg(align={"enabled": False}), "c0", seed=1)
    assert [m.step_indices for m in off.members] == [m.step_indices for m in g.members]
    assert all(torch.equal(a.x_next, b.x_next) for a, b in zip(off.members, g.members, strict=True))


def test_bank_winner_without_the_step_is_reported_not_silently_dropped():
    model, cfg = _Tiny(), _cfg()
    g = _group(model, cfg, "c0", seed=1, reward=torch.tensor([0.0, 0.1, 0.2, 0.3]))
    old_cfg = _cfg(align={"enabled": False}, kl={"d_step": "exact"}, sampler={"step_draw": "per_group"})
    old = _group(model, old_cfg, "c0", seed=9)  # records μ_old, and only its 2 trained steps
    old_t = old.members[0]
    rows = build_rows(TrainBatch([g], [[(old_t, torch.tensor([9.0]), 9.0)]]), cfg)  # the bank entry wins
    missing = len([k for k in range(cfg.schedule.steps) if k not in old_t.step_indices])
    assert missing > 0
    assert rows.stats["align/rows_used"] < rows.stats["align/rows_wanted"]


def test_exact_d_step_compares_with_the_policy_that_sampled_the_row():
    model = _Tiny()
    cfg = _cfg(kl={"d_step": "exact", "strategy": "step"}, align={"enabled": False})
    tr = Trainer(cfg, model).setup()
    stale = TrainBatch([_group(model, cfg, "c0", seed=5, version=0)])         # sampled by version 0
    tr.train_step(TrainBatch([_group(model, cfg, "c1", seed=6, version=0)]))
    v1 = tr.policy.snapshot()
    tr.train_step(TrainBatch([_group(model, cfg, "c2", seed=7, version=1)]))  # now at version 2
    rows = build_rows(stale, cfg)
    mb = next(micro_batches(rows, rows.n))
    cond = tr.conditions(rows).index(mb.cond_idx)
    with torch.no_grad():
        _, s = compute_loss(mb, cond, tr.policy.velocity, rows.scheme, tr.method.loss_cfg, 1.0, rows.n, 0)
        std = rows.scheme.std(mb.sigma, mb.sigma_next)
        mu_now = rows.scheme.mean(mb.x, tr.policy.velocity(mb.x, mb.sigma, cond), mb.sigma, mb.sigma_next)
        want = gaussian_kl(mu_now, mb.mu_old, std).mean()
        now = tr.policy.snapshot()
        for n, p in tr.policy.params.items():
            p.copy_(v1[n])
        mu_v1 = rows.scheme.mean(mb.x, tr.policy.velocity(mb.x, mb.sigma, cond), mb.sigma, mb.sigma_next)
        for n, p in tr.policy.params.items():
            p.copy_(now[n])
        before_last_step = gaussian_kl(mu_now, mu_v1, std).mean()
    assert float(s["kl/d_step"]) == pytest.approx(float(want), rel=1e-5)
    # and the policy before the last optimizer step (what `exact` used to compare with) is another one
    assert float(before_last_step) != pytest.approx(float(want), rel=1e-3)


def _align_mb(mu_old, x_pos, x_neg, a_pos=1.0, a_neg=-1.0):
    n = mu_old.shape[0]
    one = torch.ones(n)
    return MicroBatch(x=torch.zeros_like(mu_old), x_next=torch.zeros_like(mu_old), x_pos=x_pos, x_neg=x_neg,
                      logp_old=torch.zeros(n), sigma=torch.full((n,), 0.8), sigma_next=torch.full((n,), 0.6),
                      adv=torch.zeros(n), weight=one, a_pos=one * a_pos, a_neg=one * a_neg,
                      align_mask=one, mask=one, cond_idx=torch.zeros(n, dtype=torch.long), mu_old=mu_old)


def test_clipped_align_matches_loglik_gradient_on_policy_and_is_bounded_off_policy():
    scheme = make_scheme("sage", 0.7)
    g = torch.Generator().manual_seed(0)
    v0 = torch.randn(2, *SHAPE, generator=g)
    x_pos, x_neg = torch.randn(2, *SHAPE, generator=g), torch.randn(2, *SHAPE, generator=g)
    mu_old = scheme.mean(torch.zeros(2, *SHAPE), v0, torch.full((2,), 0.8), torch.full((2,), 0.6))

    def grad(form, v_start, a_pos=1.0, a_neg=-1.0):
        v = v_start.clone().requires_grad_(True)
        lc = LossConfig(1e-4, "none", 1.0, 0.0, "k1", gamma=1.0, align_form=form)
        mb = _align_mb(mu_old, x_pos, x_neg, a_pos, a_neg)
        loss, _ = compute_loss(mb, None, lambda x, s, c: v, scheme, lc, 0.0, n_rows=2, n_align=2)
        loss.backward()
        return v.grad

    # at r± = 1 the clipped surrogate's gradient is the log-likelihood form's
    assert torch.allclose(grad("clipped", v0), grad("loglik", v0), rtol=1e-4, atol=1e-7)
    # once the policy has moved toward the winner (r⁺ > 1+ε), or away from the loser (r⁻ < 1-ε),
    # the clipped form stops pushing; the log-likelihood form keeps going without bound
    for a_pos, a_neg in ((1.0, 0.0), (0.0, -1.0)):
        v_moved = v0 - 10.0 * grad("loglik", v0, a_pos, a_neg)   # a descent step on that term alone
        assert torch.equal(grad("clipped", v_moved, a_pos, a_neg), torch.zeros_like(v0))
        assert float(grad("loglik", v_moved, a_pos, a_neg).norm()) > 0


# --- 6. config rules and reconstruction notes ---------------------------------------------


def test_alignment_with_per_group_noise_is_rejected_in_one_line():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["sampler.initial_noise=group"])
    msg = str(e.value)
    assert "\n" not in msg and "align.enabled" in msg and "sampler.initial_noise" in msg
    load_config(None, ["sampler.initial_noise=group", "align.enabled=false"])  # fine without alignment


def test_config_show_says_j_align_is_a_reconstruction():
    out = subprocess.run([sys.executable, "-m", "cluster.cli", "config", "show"], capture_output=True,
                         text=True, check=True).stdout
    assert "reconstruction" in out.lower() and "w_k" in out


# --- 7. the learner replays the sampler's log-probs -----------------------------------------


@pytest.mark.parametrize("scheme", ["sage", "flow", "cps", "dance"])
def test_learner_replay_of_fresh_rows_is_on_policy(scheme):
    model = _Tiny()
    cfg = _cfg(sde={"scheme": scheme}, kl={"strategy": "none"})
    tr = Trainer(cfg, model).setup()
    st = tr.train_step(TrainBatch([_group(model, cfg, "c0", seed=2), _group(model, cfg, "c1", seed=3)]))
    # the micro-batch mixes members and steps, so the velocity GEMMs see another batch shape than
    # the sampler's: an ulp of the velocity, nothing more (σ, Σ and the mean are computed identically)
    assert st["logratio_first_absmax"] < 1e-6
