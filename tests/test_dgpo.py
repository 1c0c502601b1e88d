"""DGPO (grpo.loss=dgpo): its loss and gradient against the upstream formula transcribed here, its rows
(shared noise per group and timestep), micro-batches of whole groups on every rank, ODE rollouts, its
defaults and config, and a few training steps on the tiny model."""

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
from common.methods import METHODS, method_params, micro_batch_rows
from common.sde import Schedule
from common.types import Condition, TrainBatch
from learner.methods.dgpo import build_dgpo_rows, dgpo_loss, dgpo_micro_batches
from learner.trainer import Trainer
from rollout_worker.sampler import sample_group

DGPO = {"grpo": {"loss": "dgpo", "per_head_advantages": False}, "align": {"enabled": False},
        "bank": {"enabled": False}, "kl": {"strategy": "none"},
        "sampler": {"shared_noise": False, "initial_noise": "group", "group_size": 3, "post_solver": "dpm2"},
        "schedule": {"steps": 10, "shift": 3.0}}


def dgpo_cfg(**sections) -> RunConfig:
    return method_cfg(DGPO, **sections)


def _batch(rewards: list[list[float]], steps: int = 10, seed: int = 0) -> TrainBatch:
    return ode_batch(rewards, 2, steps, seed)


# --- the upstream formula, transcribed ----------------------------------------------------------
# Luo-Yihong/DGPO at 01ceb4b (scripts/train_sd3_dgpo.py):
#   lines 162-193 compute_group_dgpo_loss_allreduce: d_ref, Δ = sg(d) − d_ref, the group sums of
#     A·β_dpo·Δ/G (its all_reduce: here one process holds every group whole), w = sigmoid, mean(w·A·d);
#   lines 1096-1158 the step's body for one timestep j: x_t with the group's shared noise, target
#     ε − x_0, v_π0 (disable_adapter, no CFG), v_old (ema_ref), v_θ, A clamped to ±adv_clip_max, the
#     PPO-style cut on exp(d_old − d) (clip_dsm), the DGPO loss and β·mean((v_θ − v_π0)²).
# Its accumulation averages the per-timestep losses (one micro-batch per j, equal sizes).


def upstream_group_dgpo_loss(model_v, ref_old_v, target_v, advantages, group_idx, num_groups, beta_dpo,
                             group_size, dsm_loss):
    batch_size = model_v.shape[0]
    with torch.no_grad():
        ref_dsm_loss = (target_v - ref_old_v).square().reshape(batch_size, -1).mean(dim=1)
    delta_diff = dsm_loss.detach() - ref_dsm_loss.detach()
    per_sample_term = advantages * beta_dpo * delta_diff / group_size
    group_sums = torch.zeros(num_groups, dtype=per_sample_term.dtype)
    group_sums.scatter_add_(0, group_idx, per_sample_term)
    local_weights = torch.sigmoid(group_sums.detach())[group_idx]
    return (local_weights.detach() * advantages * dsm_loss).mean(), local_weights


def upstream_dgpo_step(x0, noise, sigma, adv, v_theta, v_old, v_ref, group_idx, num_groups, p, adv_clip_max=5.0):
    sigmas_t = sigma.reshape(x0.shape[0], 1, 1, 1, 1)
    xt = (1 - sigmas_t) * x0 + sigmas_t * noise
    target_v = noise - x0
    with torch.no_grad():
        ref_old_v, old_v = v_ref(xt, sigma), v_old(xt, sigma)
    model_v = v_theta(xt, sigma)
    advantages = torch.clamp(adv, -adv_clip_max, adv_clip_max)
    dsm_loss = (target_v - model_v).square().reshape(x0.shape[0], -1).mean(dim=1)
    old_dsm_loss = (target_v - old_v).square().reshape(x0.shape[0], -1).mean(dim=1)
    ratio = torch.exp(-dsm_loss + old_dsm_loss)
    should_clip = torch.where(advantages > 0, ratio > 1.0 + p["clip"], ratio < 1.0 - p["clip"])
    dsm_loss = torch.where(should_clip, dsm_loss.detach(), dsm_loss)
    dgpo_loss_, w = upstream_group_dgpo_loss(model_v, ref_old_v, target_v, advantages, group_idx, num_groups,
                                             p["beta_dpo"], x0.shape[0] // num_groups, dsm_loss)
    kl_loss = torch.mean((model_v - ref_old_v).square().reshape(x0.shape[0], -1).mean(dim=1))
    return dgpo_loss_ + p["kl"] * kl_loss, should_clip, w


def test_dgpo_loss_and_gradient_match_the_upstream_formula():
    cfg = dgpo_cfg(grpo={"params": {"clip": 2e-3, "beta_dpo": 300.0, "kl": 0.05}})
    p = method_params(cfg)
    rows = build_dgpo_rows(_batch([[0.1, 0.9, 0.4], [2.0, 1.0, 1.5]]), cfg)
    G, M = 3, 4
    assert rows.n == 2 * M * G
    g = torch.Generator().manual_seed(1)
    W = (torch.eye(3) + 0.1 * torch.randn(3, 3, generator=g)).requires_grad_(True)
    b = (0.1 * torch.randn(3, generator=g)).requires_grad_(True)
    W_old, b_old = W.detach() + 0.03 * torch.randn(3, 3, generator=g), b.detach() + 0.01
    W_ref, b_ref = W.detach() - 0.05 * torch.randn(3, 3, generator=g), b.detach() - 0.02
    v_theta, v_old, v_ref = linear_velocity(W, b), linear_velocity(W_old, b_old), linear_velocity(W_ref, b_ref)

    # upstream: per timestep j, one micro-batch of both groups' members; their losses averaged
    noise = (rows.xt - (1 - rows.sigma.view(-1, 1, 1, 1, 1)) * rows.x0) / rows.sigma.view(-1, 1, 1, 1, 1)
    ref, cuts, ws = 0.0, [], []
    for m in range(M):
        idx = torch.cat([torch.arange(G) + (gi * M + m) * G for gi in range(2)])  # group gi's unit at the m-th j
        loss_j, cut, w = upstream_dgpo_step(rows.x0[idx], noise[idx], rows.sigma[idx], rows.adv[idx], v_theta,
                                            v_old, v_ref, torch.tensor([0] * G + [1] * G), 2, p)
        ref, cuts, ws = ref + loss_j / M, cuts + [cut], ws + [w]
    gW_ref, gb_ref = torch.autograd.grad(ref, [W, b])
    cuts, ws = torch.cat(cuts), torch.cat(ws)
    assert cuts.any() and not cuts.all()                      # both sides of the cut are exercised
    assert float(ws.min()) < 0.45 and float(ws.max()) > 0.55  # group weights away from ½

    got = 0.0
    for mb in dgpo_micro_batches(rows, 7, 0, 1):              # two units (6 rows) a micro-batch
        old_v, ref_v = v_old(mb.xt, mb.sigma), v_ref(mb.xt, mb.sigma)
        loss, _ = dgpo_loss(mb, None, v_theta, old_v, ref_v, G, p["beta_dpo"], p["clip"], p["kl"], rows.n)
        got = got + loss
    gW, gb = torch.autograd.grad(got, [W, b])
    assert float(got.detach()) == pytest.approx(float(ref.detach()), rel=1e-6, abs=1e-7)
    assert torch.allclose(gW, gW_ref, rtol=1e-5, atol=1e-6) and torch.allclose(gb, gb_ref, rtol=1e-5, atol=1e-6)
    assert gW.abs().max() > 1e-3


# --- rows and micro-batches ----------------------------------------------------------------------


def test_dgpo_rows_share_noise_per_group_and_timestep_and_micro_batches_hold_whole_groups():
    cfg = dgpo_cfg()
    batch = _batch([[0.1, 0.9, 0.4], [2.0, 1.0, 1.5], [0.0, 0.3, 0.2]])
    rows = build_dgpo_rows(batch, cfg)
    G, M, sig = 3, 4, torch.tensor(Schedule.linear(10, 3.0).sigmas, dtype=torch.float32)
    assert rows.n == 3 * M * G and rows.unit == G
    js = sorted({int((sig == s).nonzero()) for s in rows.sigma.tolist()})
    assert len(js) == M and max(js) <= 6                       # M distinct indices of 0 … trunc_steps
    noise = rows.target + rows.x0                              # ε = target + x_0
    for u in range(rows.n // G):
        r = slice(u * G, (u + 1) * G)
        assert len(set(rows.sigma[r].tolist())) == 1 and len(set(rows.cond_idx[r].tolist())) == 1
        assert torch.allclose(noise[r], noise[u * G].expand_as(noise[r]), atol=1e-6)  # shared in the unit
        assert torch.allclose(rows.xt[r], (1 - rows.sigma[r].view(-1, 1, 1, 1, 1)) * rows.x0[r]
                              + rows.sigma[r].view(-1, 1, 1, 1, 1) * noise[r], atol=1e-6)
    assert not torch.allclose(noise[0], noise[G])              # a new noise for the next unit
    assert torch.equal(build_dgpo_rows(batch, cfg).xt, rows.xt)  # a step replays
    # micro-batches: whole units whatever optim.micro_batch is, on every rank, the same count per rank
    for size, world in ((1, 1), (7, 1), (7, 5), (100, 2)):
        seen = []
        counts = set()
        for rank in range(world):
            mbs = list(dgpo_micro_batches(rows, size, rank, world))
            counts.add(tuple(len(mb.sigma) for mb in mbs))
            for mb in mbs:
                assert len(mb.sigma) % G == 0 and len(mb.sigma) == G * max(1, size // G) or mb is mbs[-1]
                for u in range(len(mb.sigma) // G):
                    r = slice(u * G, (u + 1) * G)
                    assert len(set(mb.sigma[r].tolist())) == 1 and len(set(mb.mask[r].tolist())) == 1
                seen += [x for x, keep in zip(mb.xt[::G], mb.mask[::G], strict=True) if keep]
        assert len(counts) == 1 and len(seen) == rows.n // G
    assert micro_batch_rows(cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"micro_batch": 7})})) == 6
    assert micro_batch_rows(cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"micro_batch": 2})})) == 3


# --- declaration, defaults, config -----------------------------------------------------------


def test_dgpo_declares_ode_rollouts_and_upstreams_defaults():
    spec, cfg = METHODS["dgpo"], dgpo_cfg()
    assert not spec.records_steps and not spec.uses_kl_strategy and spec.sde_band is None
    assert method_params(cfg) == {"beta_dpo": 100.0, "kl": 0.02, "clip": 1e-2, "timesteps": 4.0,
                                  "trunc_steps": 6.0, "ref_decay_rate": 1e-3, "ref_decay_max": 0.3}
    assert spec.anchors(cfg) == {"old", "pi0"} and spec.rows_per_video(cfg) == 4
    g = sample_group(TinyVideoModel(), Condition("c", "a prompt"), cfg, seed=3, policy_version=0)
    m = g.members[0]
    assert m.step_indices == [] and m.x is None and m.spec.name == "ode"   # ODE rollouts, no step recorded
    assert not torch.allclose(g.members[0].final_latents, g.members[1].final_latents)


@pytest.mark.parametrize("override, named", [
    ("kl.strategy=fixed", "kl.strategy=none"), ("grpo.params.timesteps=2.5", "grpo.params.timesteps"),
    ("grpo.params.ref_decay_max=2", "grpo.params.ref_decay_max"), ("grpo.params.eta=1", "grpo.params.eta"),
])
def test_dgpo_config_errors_are_one_line_naming_the_field(override, named):
    base = ["grpo.loss=dgpo", "align.enabled=false", "bank.enabled=false", "kl.strategy=none",
            "sampler.shared_noise=false", "sampler.initial_noise=group"]
    assert_refused_in_one_line(base, override, named)


# --- a few training steps ------------------------------------------------------------------------


def test_dgpo_trains_a_few_steps_and_its_reference_follows():
    model = TinyVideoModel()
    cfg = dgpo_cfg(optim={"micro_batch": 7, "lr": 1e-2, "lora_rank": 4}, schedule={"steps": 5, "shift": 3.0},
                   grpo={"params": {"ref_decay_rate": 0.2}})
    tr = Trainer(cfg, model).setup()
    assert {"old", "pi0"} <= set(tr.policy.anchors)
    live0 = {n: p.detach().clone() for n, p in tr.policy.params.items()}
    for step in range(3):
        fresh = scored_groups(model, cfg, step, tr.version)
        old = {n: t.clone() for n, t in tr.policy.anchors["old"].items()}
        st = tr.train_step(TrainBatch(fresh, version=tr.version))
        assert math.isfinite(st["loss"]) and st["grad_norm"] > 0 and st["num_rows"] == 2 * 4 * 3
        d = min(0.3, 0.2 * (tr.version - 1))                  # its ema_ref: the decay before the increment
        for n, p in tr.policy.params.items():
            assert torch.allclose(tr.policy.anchors["old"][n], d * old[n] + (1 - d) * p.detach(), atol=1e-6)
    assert any(not torch.equal(p.detach(), live0[n]) for n, p in tr.policy.params.items())
