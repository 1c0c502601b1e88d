"""GRPO-Guard (grpo.loss=grpo_guard): its loss and gradient against the upstream formula transcribed
here, its rollouts (SDE steps recorded with μ_old), its defaults and config, and a few training
steps on the tiny model."""

from __future__ import annotations

import math

import pytest
import torch
from helpers_methods import (
    SHAPE,
    assert_refused_in_one_line,
    linear_velocity,
    method_cfg,
    scored_groups,
)
from helpers_tiny import TinyVideoModel

from common.config import RunConfig
from common.methods import METHODS, method_params
from common.sde import Schedule, make_scheme
from common.types import Condition, TrainBatch
from learner.losses import policy_step
from learner.methods.grpo_guard import guard_loss
from learner.rows import MicroBatch
from learner.trainer import Trainer
from rollout_worker.sampler import sample_group

GUARD = {"grpo": {"loss": "grpo_guard", "equalizer": False}, "sde": {"scheme": "flow"},
         "align": {"enabled": False}, "kl": {"strategy": "none"}, "bank": {"enabled": False},
         "sampler": {"group_size": 3}, "schedule": {"steps": 4, "shift": 3.0}}


def guard_cfg(**sections) -> RunConfig:
    return method_cfg(GUARD, **sections)


# --- the upstream formula, transcribed ----------------------------------------------------------
# yifan123/flow_grpo's GRPO-Guard, read in its fork zhtmike/flow_grpo at 2e2f712e9feb19246fa0db9527878e2766b5353f:
#   flow_grpo/diffusers_patch/sd3_sde_with_logprob.py lines 44-68, 89, 92 (sde_type 'sde'): the step's
#     std_dev_t, prev_sample_mean, log_prob (mean over the non-batch dims) and sqrt(-dt);
#   scripts/train_sd3_GRPO_Guard.py lines 910-937: the clamp of A, RatioNorm (915-919), the clipped
#     loss over sqrt_dt.mean()**2 (923-932) and the KL to the reference (934-937);
# and verl-project/verl-omni at a1139bafffb5b9711f0a6b6edff8ecaa60bfff30,
#   verl_omni/trainer/diffusion/diffusion_algos.py lines 467-549 (GRPOGuardLoss.compute_loss), the same.
# The KL's mean(dim=(1,2,3)) is over an image's non-batch dims; here over a video's.


def upstream_sde_step(v, x, sigma, sigma_prev, sigma_max, prev_sample, noise_level):
    """sd3_sde_with_logprob.py, sde_type 'sde': (log_prob [B], prev_sample_mean, std_dev_t, sqrt_dt)."""
    shape = (-1, *([1] * (x.dim() - 1)))
    sigma, sigma_prev = sigma.view(shape), sigma_prev.view(shape)
    dt = sigma_prev - sigma
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * noise_level
    prev_sample_mean = x * (1 + std_dev_t ** 2 / (2 * sigma) * dt) + v * (1 + std_dev_t ** 2 * (1 - sigma) / (2 * sigma)) * dt
    log_prob = (-((prev_sample.detach() - prev_sample_mean) ** 2) / (2 * ((std_dev_t * torch.sqrt(-1 * dt)) ** 2))
                - torch.log(std_dev_t * torch.sqrt(-1 * dt)) - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi))))
    return log_prob.mean(dim=tuple(range(1, log_prob.ndim))), prev_sample_mean, std_dev_t, torch.sqrt(-1 * dt)


def upstream_guard_loss(adv, log_prob, old_log_prob, mean, old_mean, mean_ref, std_dev_t, sqrt_dt,
                        clip_range, beta, adv_clip_max=5.0):
    """train_sd3_GRPO_Guard.py lines 910-937 for one micro-batch at one step j (rationorm on)."""
    advantages = torch.clamp(adv, -adv_clip_max, adv_clip_max)
    sigma_t = std_dev_t.mean()
    ratio_mean_bias = (mean - old_mean).pow(2).mean(dim=tuple(range(1, mean.ndim)))
    ratio_mean_bias = ratio_mean_bias / (2 * (sqrt_dt.mean() * sigma_t) ** 2)
    ratio = torch.exp((log_prob - old_log_prob + ratio_mean_bias) * (sqrt_dt.mean() * sigma_t))
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    policy_loss = torch.mean(torch.maximum(unclipped_loss, clipped_loss))
    policy_loss = policy_loss / (sqrt_dt.mean() ** 2)
    kl_loss = ((mean - mean_ref) ** 2).mean(dim=tuple(range(1, mean.ndim)), keepdim=True) / (2 * std_dev_t ** 2)
    return policy_loss + beta * torch.mean(kl_loss), ratio


def test_guard_loss_and_gradient_match_the_upstream_formula():
    g = torch.Generator().manual_seed(0)
    schedule = Schedule.linear(10, 3.0)
    sig = torch.tensor(schedule.sigmas, dtype=torch.float32)
    eta, clip, beta, B = 0.7, 2e-4, 0.05, 4
    scheme = make_scheme("flow", eta, schedule)
    W = (torch.eye(3) + 0.1 * torch.randn(3, 3, generator=g)).requires_grad_(True)
    b = (0.1 * torch.randn(3, generator=g)).requires_grad_(True)
    W_old, b_old = W.detach() + 0.02 * torch.randn(3, 3, generator=g), b.detach() + 0.02
    W_ref, b_ref = W.detach() - 0.05 * torch.randn(3, 3, generator=g), b.detach() - 0.02
    adv = torch.tensor([1.3, -0.7, 6.0, -2.1])                # one beyond the ±5 clamp
    steps = [0, 3, 7]                                         # σ = 1 (its σ_max trick) and two more
    data = {}
    for j in steps:                                          # the sampling policy's recorded steps
        x = torch.randn(B, *SHAPE, generator=g)
        v_old = linear_velocity(W_old, b_old)(x, sig[j])
        noise = torch.randn(B, *SHAPE, generator=g)
        _, mean_old, std_dev_t, sqrt_dt = upstream_sde_step(v_old, x, sig[j].expand(B), sig[j + 1].expand(B),
                                                            sig[1], torch.zeros_like(x), eta)
        x_next = mean_old + std_dev_t * sqrt_dt.view(-1, 1, 1, 1, 1) * noise
        logp_old, *_ = upstream_sde_step(v_old, x, sig[j].expand(B), sig[j + 1].expand(B), sig[1], x_next, eta)
        data[j] = (x, x_next, logp_old, mean_old)

    # upstream: one micro-batch per step j; the accumulated gradient is the mean of the steps' losses
    ref, ratios = 0.0, []
    for j in steps:
        x, x_next, logp_old, mean_old = data[j]
        sj, sj1 = sig[j].expand(B), sig[j + 1].expand(B)
        lp, mean, std_dev_t, sqrt_dt = upstream_sde_step(linear_velocity(W, b)(x, sig[j]), x, sj, sj1, sig[1], x_next, eta)
        _, mean_ref, _, _ = upstream_sde_step(linear_velocity(W_ref, b_ref)(x, sig[j]), x, sj, sj1, sig[1], x_next, eta)
        loss_j, ratio_j = upstream_guard_loss(adv, lp, logp_old, mean, mean_old, mean_ref.detach(), std_dev_t,
                                              sqrt_dt, clip, beta)
        ref, ratios = ref + loss_j / len(steps), ratios + [ratio_j]
    gW_ref, gb_ref = torch.autograd.grad(ref, [W, b])
    clipped = (torch.cat(ratios).detach() - 1).abs() > clip
    assert clipped.any() and not clipped.all()                # both branches of the max are exercised

    # vgrpo: the same 12 rows, mixed across steps, in two micro-batches (one padded row)
    ks = torch.tensor([j for j in steps for _ in range(B)])
    cat = {k: torch.cat([data[j][i] for j in steps]) for i, k in enumerate(("x", "x_next", "logp_old", "mu_old"))}
    order = torch.randperm(len(ks), generator=g)
    n = len(ks)
    got = 0.0
    for part in (order[:7], torch.cat([order[7:], order[:1]])):
        mask = torch.ones(len(part))
        if len(part) == 6:
            mask[-1] = 0.0
        mb = MicroBatch(x=cat["x"][part], x_next=cat["x_next"][part], x_pos=cat["x_next"][part],
                        x_neg=cat["x_next"][part], logp_old=cat["logp_old"][part], sigma=sig[ks[part]],
                        sigma_next=sig[ks[part] + 1], adv=adv.clamp(-5, 5).repeat(len(steps))[part],
                        weight=torch.ones(len(part)), a_pos=torch.zeros(len(part)), a_neg=torch.zeros(len(part)),
                        align_mask=torch.zeros(len(part)), mask=mask, cond_idx=torch.zeros(len(part), dtype=torch.long),
                        mu_old=cat["mu_old"][part])
        step = policy_step(mb, None, linear_velocity(W, b), scheme)
        ref_mu = scheme.mean(mb.x, linear_velocity(W_ref, b_ref)(mb.x, mb.sigma), mb.sigma, mb.sigma_next)
        loss, _ = guard_loss(mb, step, clip, beta, n, ref_mu)
        got = got + loss
    gW, gb = torch.autograd.grad(got, [W, b])
    assert float(got.detach()) == pytest.approx(float(ref.detach()), rel=1e-6, abs=1e-6)
    assert torch.allclose(gW, gW_ref, rtol=1e-5, atol=1e-6) and torch.allclose(gb, gb_ref, rtol=1e-5, atol=1e-6)
    assert gW.abs().max() > 1e-3  # a real gradient


# --- declaration, defaults, config -----------------------------------------------------------


def test_grpo_guard_declares_sde_rollouts_with_mu_old_and_upstreams_defaults():
    spec = METHODS["grpo_guard"]
    assert spec.records_steps and spec.records_mu_old and not spec.uses_kl_strategy
    cfg = guard_cfg()
    assert method_params(cfg) == {"clip": 2e-6, "kl": 0.0}  # flow_grpo config/grpo_guard.py
    assert cfg.records_mu_old and spec.anchors(cfg) == frozenset()
    assert spec.anchors(guard_cfg(grpo={"params": {"kl": 0.01}})) == {"pi0"}
    # its rollouts: the SDE's steps, recorded with the sampling policy's mean
    g = sample_group(TinyVideoModel(), Condition("c", "a prompt"), cfg, seed=3, policy_version=0)
    m = g.members[0]
    assert m.spec.name == "flow" and m.step_indices and m.mu_old is not None
    assert m.mu_old.shape == m.x.shape and m.logp_old.shape == (len(m.step_indices),)


@pytest.mark.parametrize("override, named", [
    ("align.enabled=true", "align.enabled=false"), ("kl.strategy=fixed", "kl.strategy=none"),
    ("grpo.equalizer=true", "grpo.equalizer=false"),
    ("grpo.params.beta_dpo=100", "grpo.params.beta_dpo"), ("grpo.params.clip=2", "grpo.params.clip"),
])
def test_grpo_guard_config_errors_are_one_line_naming_the_field(override, named):
    base = ["grpo.loss=grpo_guard", "align.enabled=false", "kl.strategy=none", "grpo.equalizer=false"]
    assert_refused_in_one_line(base, override, named)


# --- a few training steps ------------------------------------------------------------------------


def test_grpo_guard_trains_a_few_steps_on_the_tiny_model():
    model = TinyVideoModel()
    cfg = guard_cfg(optim={"micro_batch": 4, "lr": 1e-2, "lora_rank": 4}, grpo={"params": {"kl": 0.01}})
    tr = Trainer(cfg, model).setup()
    live0 = {n: p.detach().clone() for n, p in tr.policy.params.items()}
    for step in range(3):
        fresh = scored_groups(model, cfg, step, tr.version)
        st = tr.train_step(TrainBatch(fresh, version=tr.version))
        assert math.isfinite(st["loss"]) and st["grad_norm"] > 0
        assert st["onpolicy_rows"] == st["num_rows"] and st["logratio_onpolicy_absmax"] < 1e-4  # replayed exactly
        assert abs(st["ratio_mean"] - 1.0) < 1e-4 and st["loss/kl"] >= 0
    assert tr.version == 3
    assert any(not torch.equal(p.detach(), live0[n]) for n, p in tr.policy.params.items())
