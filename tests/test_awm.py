"""Advantage Weighted Matching (grpo.loss=awm): its loss and gradient against the upstream formula
transcribed here, its rows (stratified timesteps, Â), its rollouts (stochastic only where a step ends
in σ ∈ [0.3, 0.9], nothing recorded), its defaults and config, and a few training steps on the tiny
model."""

from __future__ import annotations

import math

import pytest
import torch
from helpers_methods import (
    assert_refused_in_one_line,
    linear_velocity,
    method_cfg,
    ode_batch,
    scored_groups,
)
from helpers_tiny import TinyVideoModel

from common.config import RunConfig
from common.methods import METHODS, method_params
from common.sde import Flow, Schedule, scheme_from_config
from common.types import Condition, TrainBatch
from learner.methods.awm import awm_loss, awm_micro_batches, build_awm_rows, stratified_indices
from learner.rows import batch_std, member_advantages
from learner.trainer import Trainer
from rollout_worker.sampler import plan_steps, sample_group

AWM = {"grpo": {"loss": "awm", "per_head_advantages": False, "adv_std": "batch", "adv_norm": "flow_grpo"},
       "align": {"enabled": False}, "bank": {"enabled": False}, "kl": {"strategy": "none"},
       "sde": {"scheme": "flow", "eta": 0.57},
       "sampler": {"shared_noise": False, "initial_noise": "group", "group_size": 3, "post_solver": "dpm2"},
       "schedule": {"steps": 10, "shift": 3.0}}


def awm_cfg(**sections) -> RunConfig:
    return method_cfg(AWM, **sections)


def _batch(rewards: list[list[float]], steps: int = 10, seed: int = 0) -> TrainBatch:
    return ode_batch(rewards, 1, steps, seed)


# --- the upstream formula, transcribed ----------------------------------------------------------
# scxue/advantage_weighted_matching at be5137232e33a21b449ed65a533211d0deb97ed8,
# advantage_weighted_matching/scripts/train_sd3_awm.py:
#   lines 210-252 compute_log_prob_awm: −mean((v − (ε − x_0))²) in float64 and its 'ghuber' weighting;
#   lines 1232, 1266-1290: x_t = (1 − t)·x_0 + t·ε, v_θ, v_ref (disable_adapter), v_ema (the 'ema' adapter),
#     old log-probs = the current ones detached (on-policy, lines 1282-1284);
#   lines 1293-1354: A clamped to ±adv_clip_max, /adv_clip_max·advantage_max, exp_first ratios, the
#     clipped loss, kl_weight and kl_ema_weight 'Uniform', loss = policy + β·kl + β_ema·ema_kl.
# One micro-batch of all rows: its loss is a mean over rows (accumulation averages equal micro-batches).


def upstream_log_prob_awm(model_output, timestep, clean_latents, random_noise, ghuber_power):
    model_output = model_output.double()
    log_prob = -(model_output - (random_noise.double() - clean_latents.double())) ** 2
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    return -(torch.pow(-log_prob + 1e-10, ghuber_power)
             - torch.pow(torch.tensor(1e-10, dtype=log_prob.dtype), ghuber_power)) * timestep.view(-1) / ghuber_power


def upstream_awm_loss(adv, timesteps, clean, noise, v_theta, v_ref, v_ema, p, adv_clip_max=5.0):
    noised = (1 - timesteps.view(-1, 1, 1, 1, 1)) * clean + timesteps.view(-1, 1, 1, 1, 1) * noise
    model_output = v_theta(noised, timesteps).double()
    with torch.no_grad():
        model_output_ref, model_output_ema = v_ref(noised, timesteps).double(), v_ema(noised, timesteps).double()
    log_prob = upstream_log_prob_awm(model_output, timesteps, clean, noise, p["ghuber_power"])
    old_log_probs = log_prob.detach()
    advantages = torch.clamp(adv, -adv_clip_max, adv_clip_max)
    advantages = advantages / adv_clip_max * p["advantage_max"]
    ratio = torch.exp(log_prob - old_log_probs.detach())
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - p["clip"], 1.0 + p["clip"])
    policy_loss = torch.mean(torch.maximum(unclipped_loss, clipped_loss))
    kl_loss = ((model_output - model_output_ref) ** 2).mean(dim=tuple(range(1, model_output.ndim))).mean()
    ema_kl_loss = ((model_output - model_output_ema) ** 2).mean(dim=tuple(range(1, model_output.ndim))).mean()
    return policy_loss + p["kl"] * kl_loss + p["ema_kl"] * ema_kl_loss


def test_awm_loss_and_gradient_match_the_upstream_formula():
    cfg = awm_cfg(grpo={"params": {"kl": 0.05, "ema_kl": 0.5}})
    p = method_params(cfg)
    batch = _batch([[0.1, 0.9, 0.4], [2.0, -30.0, 1.5]])     # one advantage beyond the ±5 clamp
    rows = build_awm_rows(batch, cfg)
    std = batch_std(batch, cfg)
    raw = torch.cat([member_advantages(g, [], cfg, std)[0] for g in batch.fresh])   # A as upstream's tracker gives it
    assert torch.allclose(rows.adv, (raw.clamp(-5, 5) / 5).repeat_interleave(6))   # Â = clip(A)/5·1
    g = torch.Generator().manual_seed(1)
    W = (torch.eye(3) + 0.1 * torch.randn(3, 3, generator=g)).requires_grad_(True)
    b = (0.1 * torch.randn(3, generator=g)).requires_grad_(True)
    W_ref, b_ref = W.detach() - 0.05 * torch.randn(3, 3, generator=g), b.detach() - 0.02
    W_ema, b_ema = W.detach() + 0.03 * torch.randn(3, 3, generator=g), b.detach() + 0.01
    v_theta, v_ref, v_ema = linear_velocity(W, b), linear_velocity(W_ref, b_ref), linear_velocity(W_ema, b_ema)

    ref = upstream_awm_loss(raw.repeat_interleave(6), rows.sigma, rows.x0, rows.eps, v_theta, v_ref, v_ema, p)
    gW_ref, gb_ref = torch.autograd.grad(ref, [W, b])

    got = 0.0
    for mb in awm_micro_batches(rows, 10, 0, 1):
        loss, _ = awm_loss(mb, None, v_theta, v_ref(mb.xt, mb.sigma), v_ema(mb.xt, mb.sigma), p, rows.n)
        got = got + loss
    gW, gb = torch.autograd.grad(got, [W, b])
    assert float(got.detach()) == pytest.approx(float(ref.detach()), rel=1e-6, abs=1e-7)
    assert torch.allclose(gW, gW_ref.float(), rtol=1e-5, atol=1e-6) and torch.allclose(gb, gb_ref.float(), rtol=1e-5, atol=1e-6)
    assert gW.abs().max() > 1e-3


# --- rows ------------------------------------------------------------------------------------------


def test_awm_rows_draw_one_index_per_stratum_with_fresh_noise():
    # its discrete_wo_init at T 14, fraction 0.9, M 6: linspace(1, 12, 7) → strata 1,2,4,6,8,10,12
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        js = stratified_indices(14, 0.9, 6, 1, gen)
        assert all(lo <= j < hi for j, lo, hi in zip(js, [1, 2, 4, 6, 8, 10], [2, 4, 6, 8, 10, 12], strict=True))
    cfg = awm_cfg()
    rows = build_awm_rows(_batch([[0.1, 0.9, 0.4]]), cfg)
    assert rows.n == 3 * 6 and METHODS["awm"].rows_per_video(cfg) == 6
    s = rows.sigma.view(-1, 1, 1, 1, 1)
    assert torch.allclose(rows.xt, (1 - s) * rows.x0 + s * rows.eps)
    assert abs(float(rows.eps.std()) - 1.0) < 0.15 and not torch.allclose(rows.eps[0], rows.eps[1])


# --- rollouts: stochastic only in the band ---------------------------------------------------------


def test_awm_rollouts_are_stochastic_only_where_a_step_ends_in_the_band():
    cfg = awm_cfg()
    sched = Schedule.from_config(cfg.schedule)
    scheme = scheme_from_config(cfg, sched)
    plan = plan_steps(sched, scheme, [], cfg)
    assert [p.k for p in plan] == list(range(10))
    for p in plan:
        in_band = 0.3 <= p.sigma_next <= 0.9
        assert (p.rule is scheme) == in_band and (p.rule == "dpm2") == (not in_band)
    assert 0 < sum(p.rule is scheme for p in plan) < 10
    # the data path: nothing recorded, each member its own noise; the band's steps add noise, so the
    # same seed's final latents differ from the deterministic solver's
    model = TinyVideoModel()
    grp = sample_group(model, Condition("c", "a prompt"), cfg, seed=5, policy_version=0)
    m = grp.members[0]
    assert m.step_indices == [] and m.x is None and m.logp_old is None
    assert m.spec == Flow(0.57, sigma1=sched.sigmas[1]).spec(sched)  # the scheme its band ran with
    nft = RunConfig.model_validate({**AWM, "grpo": {"loss": "nft"}})
    assert all(p.rule == "dpm2" for p in plan_steps(sched, scheme, [], nft))  # no band: unchanged
    det = sample_group(model, Condition("c", "a prompt"), nft, seed=5, policy_version=0)
    assert not torch.allclose(det.members[0].final_latents, m.final_latents)


# --- declaration, defaults, config -----------------------------------------------------------


def test_awm_declares_band_rollouts_and_upstreams_defaults():
    spec, cfg = METHODS["awm"], awm_cfg()
    assert not spec.records_steps and not spec.uses_kl_strategy and spec.sde_band == (0.3, 0.9)
    assert method_params(cfg) == {"kl": 0.003, "ema_kl": 1.0, "clip": 1.0, "timesteps": 6.0,
                                  "timestep_fraction": 0.9, "first_index": 1.0, "advantage_max": 1.0,
                                  "ghuber_power": 0.25, "ema_decay_rate": 1e-3, "ema_decay_max": 0.3}
    assert spec.anchors(cfg) == {"pi0", "old"}
    assert spec.anchors(awm_cfg(grpo={"params": {"kl": 0.0, "ema_kl": 0.0}})) == frozenset()


@pytest.mark.parametrize("override, named", [
    ("align.enabled=true", "align.enabled=false"), ("grpo.params.first_index=2", "grpo.params.first_index"),
    ("grpo.params.beta_dpo=1", "grpo.params.beta_dpo"),
])
def test_awm_config_errors_are_one_line_naming_the_field(override, named):
    base = ["grpo.loss=awm", "align.enabled=false", "bank.enabled=false", "kl.strategy=none",
            "sampler.shared_noise=false", "sampler.initial_noise=group"]
    assert_refused_in_one_line(base, override, named)


# --- a few training steps ------------------------------------------------------------------------


def test_awm_trains_a_few_steps_and_its_ema_follows():
    model = TinyVideoModel()
    cfg = awm_cfg(optim={"micro_batch": 8, "lr": 1e-2, "lora_rank": 4}, schedule={"steps": 5, "shift": 3.0},
                  grpo={"params": {"timesteps": 3, "ema_decay_rate": 0.2}})
    tr = Trainer(cfg, model).setup()
    assert {"old", "pi0"} <= set(tr.policy.anchors)
    live0 = {n: p.detach().clone() for n, p in tr.policy.params.items()}
    for step in range(3):
        fresh = scored_groups(model, cfg, step, tr.version)
        old = {n: t.clone() for n, t in tr.policy.anchors["old"].items()}
        st = tr.train_step(TrainBatch(fresh, version=tr.version))
        assert math.isfinite(st["loss"]) and st["grad_norm"] > 0 and st["num_rows"] == 2 * 3 * 3
        d = min(0.3, 0.2 * tr.version)                        # its linear kl_ema_decay after the increment
        for n, p in tr.policy.params.items():
            assert torch.allclose(tr.policy.anchors["old"][n], d * old[n] + (1 - d) * p.detach(), atol=1e-6)
    assert any(not torch.equal(p.detach(), live0[n]) for n, p in tr.policy.params.items())
