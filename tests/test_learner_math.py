"""Loss math without a model: advantages, the clipped surrogate, equalizer weights, KL schedules."""

from __future__ import annotations

import math

import pytest
import torch

from common.config import KLConfig, RunConfig
from common.sde import CPS, Schedule, equalizer_weights, log_prob, make_scheme
from common.types import Condition, Group, Scores, TrainBatch, Trajectory
from learner.advantages import group_advantages, is_zero_std
from learner.kl import KLController
from learner.losses import LossConfig, compute_loss
from learner.rows import MicroBatch, build_rows, micro_batches, rank_rows

SHAPE = (3, 2, 4, 4)


# --- advantages ----------------------------------------------------------------------


def test_group_advantages_normalise_and_clip():
    r = torch.tensor([1.0, 2.0, 3.0, 4.0])
    a = group_advantages(r, torch.ones(4, dtype=torch.bool), adv_clip=5.0)
    std = math.sqrt(1.25)  # population std of 1..4
    assert torch.allclose(a, (r - 2.5) / (std + 1e-8))
    # one outlier among many identical rewards exceeds the clip
    r = torch.tensor([0.0] * 99 + [1.0])
    a = group_advantages(r, torch.ones(100, dtype=torch.bool), adv_clip=5.0)
    assert a[-1] == 5.0 and a[0] < 0


def test_zero_std_group_gives_zero_advantages():
    r = torch.full((4,), 0.7)
    mask = torch.ones(4, dtype=torch.bool)
    assert torch.equal(group_advantages(r, mask, 5.0), torch.zeros(4))
    assert is_zero_std(r, mask) and not is_zero_std(torch.tensor([0.0, 1.0]), mask[:2])


def test_per_head_advantages_sum_normalised_heads_with_weights():
    s = torch.tensor([[1.0, 0.0], [0.0, 2.0], [2.0, 4.0]])  # [N, H]
    w = torch.tensor([1.0, 0.5])
    mask = torch.ones(3, dtype=torch.bool)
    a = group_advantages(s @ w, mask, 5.0, s, w, mode="per_head")
    n0 = (s[:, 0] - 1.0) / (s[:, 0].std(unbiased=False) + 1e-8)
    n1 = (s[:, 1] - 2.0) / (s[:, 1].std(unbiased=False) + 1e-8)
    assert torch.allclose(a, n0 + 0.5 * n1)
    assert not torch.allclose(a, group_advantages(s @ w, mask, 5.0))  # differs from composite


def test_stats_mask_restricts_mean_and_std():
    r = torch.tensor([0.0, 2.0, 10.0])  # the last one only joins the loss
    a = group_advantages(r, torch.tensor([True, True, False]), adv_clip=100.0)
    assert torch.allclose(a, torch.tensor([-1.0, 1.0, 9.0]), atol=1e-6)


# --- rows from a batch ---------------------------------------------------------------


def _traj(cond, gid, member, steps, seed, sigmas, version=0):
    g = torch.Generator().manual_seed(seed)
    k = len(steps)
    return Trajectory(condition=cond, group_id=gid, member=member, seed=0,
                      spec=make_scheme("sage", 0.5).spec(Schedule.explicit(sigmas)),
                      guidance_scale=1.0, policy_version=version, step_indices=steps,
                      x=torch.randn(k, *SHAPE, generator=g), x_next=torch.randn(k, *SHAPE, generator=g),
                      logp_old=torch.randn(k, generator=g), final_latents=torch.zeros(SHAPE),
                      mu_old=torch.randn(k, *SHAPE, generator=g))


def _batch(rewards, bank_rewards=(), steps=(0, 1), sigmas=None):
    sigmas = sigmas or list(Schedule.linear(4, 3.0).sigmas)
    cond = Condition("c0", "a prompt")
    members = [_traj(cond, "g", i, list(steps), i, sigmas) for i in range(len(rewards))]
    group = Group(cond, "g", 0, members, Scores(["h"], torch.tensor(rewards).view(-1, 1)),
                  torch.tensor(rewards))
    bank = [(_traj(cond, "old", i, list(steps), 100 + i, sigmas), torch.tensor([r]), r)
            for i, r in enumerate(bank_rewards)]
    return TrainBatch([group], [bank])


def test_rows_carry_advantages_winner_loser_and_bank():
    cfg = RunConfig()
    rows = build_rows(_batch([1.0, 3.0, 2.0], bank_rewards=[5.0]), cfg)
    assert rows.n == 8  # (3 fresh + 1 bank) members × 2 steps
    # group stats: fresh only; the bank member (reward 5) is the winner, member 0 the loser
    fresh_adv = group_advantages(torch.tensor([1.0, 3.0, 2.0]), torch.ones(3, dtype=torch.bool), 5.0)
    assert torch.allclose(rows.adv[:6:2], fresh_adv)
    assert torch.allclose(rows.adv[6], torch.tensor(3.0 / math.sqrt(2 / 3)))  # (5 - mean) / std
    assert torch.equal(rows.pos_row, torch.tensor([6, 7] * 4)) and torch.equal(rows.neg_row, torch.tensor([0, 1] * 4))
    assert torch.allclose(rows.a_pos, rows.adv[6].expand(8)) and torch.allclose(rows.a_neg, rows.adv[0].expand(8))
    cfg2 = RunConfig.model_validate({"grpo": {"adv_stats": "group_and_bank"}})
    rows2 = build_rows(_batch([1.0, 3.0, 2.0], bank_rewards=[5.0]), cfg2)
    assert torch.allclose(rows2.adv[::2], group_advantages(torch.tensor([1.0, 3.0, 2.0, 5.0]),
                                                           torch.ones(4, dtype=torch.bool), 5.0))


def test_align_rows_only_where_winner_and_loser_share_the_step():
    sigmas = list(Schedule.linear(4, 3.0).sigmas)
    cond = Condition("c0", "p")
    members = [_traj(cond, "g", 0, [0, 1], 0, sigmas), _traj(cond, "g", 1, [1, 2], 1, sigmas)]
    group = Group(cond, "g", 0, members, None, torch.tensor([0.0, 1.0]))
    rows = build_rows(TrainBatch([group]), RunConfig())
    # only step 1 is trained by both
    assert rows.n_align == 2
    both = (rows.pos_row >= 0) & (rows.neg_row >= 0)
    assert both.tolist() == [False, True, True, False]


def test_equalizer_weights_picked_at_trained_steps():
    sigmas = list(Schedule.linear(6, 3.0).sigmas)
    batch = _batch([0.0, 1.0], steps=(0, 2, 4), sigmas=sigmas)
    rows = build_rows(batch, RunConfig())
    w = equalizer_weights(make_scheme("sage", 0.5), Schedule.explicit(sigmas))
    assert torch.allclose(rows.weight, w[[0, 2, 4, 0, 2, 4]])
    assert rows.weight[0] > rows.weight[1] > rows.weight[2] and rows.weight[0] > 1  # high noise up
    off = build_rows(batch, RunConfig.model_validate({"grpo": {"equalizer": False}}))
    assert torch.equal(off.weight, torch.ones(6))


def test_batch_with_two_schemes_is_rejected():
    batch = _batch([0.0, 1.0])
    sched = batch.fresh[0].members[0].spec.schedule()
    batch.fresh[0].members[1].spec = make_scheme("flow", 0.5, sched).spec(sched)
    with pytest.raises(ValueError, match=r"g/1 was sampled with flow\(eta=0.5, .*; one batch needs one scheme"):
        build_rows(batch, RunConfig())


def test_rows_take_the_scheme_from_the_trajectories_not_the_config():
    """CPS's log-prob form and η, and the schedule, come from the trajectory's spec; the learner's
    config (CPS with the Gaussian form, η 0.7, another schedule) is not read for them."""
    sched = Schedule.linear(5, 2.0)
    batch = _batch([0.0, 1.0], sigmas=list(sched.sigmas))
    spec = CPS(0.6, log_prob_form="mse").spec(sched)
    for t in batch.fresh[0].members:
        t.spec = spec
    cfg = RunConfig.model_validate({"sde": {"scheme": "cps", "cps_log_prob": "gaussian"},
                                    "schedule": {"steps": 8, "shift": 1.0}})
    rows = build_rows(batch, cfg)
    assert type(rows.scheme) is CPS and (rows.scheme.eta, rows.scheme.log_prob_form) == (0.6, "mse")
    assert rows.sigma.tolist() == [sched.sigmas[k] for k in (0, 1, 0, 1)]
    assert torch.equal(rows.weight, equalizer_weights(CPS(0.6), sched)[[0, 1, 0, 1]])


def test_rank_shares_cover_rows_once_with_equal_lengths():
    seen = []
    for r in range(3):
        idx, mask = rank_rows(10, r, 3)
        assert len(idx) == 4
        seen += idx[mask.bool()].tolist()
    assert sorted(seen) == list(range(10))
    rows = build_rows(_batch([0.0, 1.0, 2.0]), RunConfig())  # 6 rows
    counts = [[len(mb.x) for mb in micro_batches(rows, 2, r, 4)] for r in range(4)]
    assert counts == [[2]] * 4


# --- the clipped surrogate, by hand --------------------------------------------------


def test_clipped_surrogate_hand_case():
    sched = Schedule.linear(4, 1.0)
    scheme = make_scheme("sage", 0.5)
    x, x_next = torch.randn(2, *SHAPE), torch.randn(2, *SHAPE)
    sigma, sigma_next = torch.tensor([1.0, 0.75]), torch.tensor([0.75, 0.5])
    v_fixed = torch.randn(2, *SHAPE)
    new_logp = log_prob(x_next, scheme.mean(x, v_fixed, sigma, sigma_next), scheme.std(sigma, sigma_next))
    ratios = torch.tensor([1.5, 0.5])
    one = torch.ones(2)
    mb = MicroBatch(x=x, x_next=x_next, x_pos=x_next, x_neg=x_next, logp_old=new_logp - ratios.log(),
                    sigma=sigma, sigma_next=sigma_next, adv=torch.tensor([2.0, -1.0]),
                    weight=torch.tensor([1.0, 0.5]), a_pos=one, a_neg=-one, align_mask=one, mask=one,
                    cond_idx=torch.zeros(2, dtype=torch.long))
    lc = LossConfig(clip_eps=0.2, strategy="none", beta_anchor=1.0, beta_step=0.1, d_step="k1", gamma=0.0)
    loss, s = compute_loss(mb, None, lambda x, sg, c: v_fixed, scheme, lc, 1.0, n_rows=2, n_align=2)
    # row 0: max(-2·1.5, -2·1.2) = -2.4; row 1: max(1·0.5, 1·0.8) = 0.8, weighted by 0.5
    assert loss.item() == pytest.approx((-2.4 + 0.5 * 0.8) / 2, rel=1e-5)
    assert s["clipfrac"].item() == 1.0 and s["ratio_mean"].item() == pytest.approx(1.0, rel=1e-5)
    assert s["approx_kl"].item() == pytest.approx(((0.5 - math.log(1.5)) + (-0.5 - math.log(0.5))) / 2, rel=1e-4)
    del sched


def test_k1_step_kl_estimates_the_gaussian_kl():
    # E_{x'~old}[logp_old - logp_new] = KL(old ‖ new) = Δμ² / (2 std²) per element
    scheme = make_scheme("sage", 0.5)
    std = scheme.std(0.5, 0.25)
    mu_old, mu_new = torch.zeros(1, 20000), torch.full((1, 20000), 0.05)
    x_next = mu_old + std * torch.randn(1, 20000, generator=torch.Generator().manual_seed(0))
    k1 = log_prob(x_next, mu_old, std) - log_prob(x_next, mu_new, std)
    exact = 0.05**2 / (2 * std**2)
    assert k1.item() == pytest.approx(exact.item(), rel=0.1)


# --- λ_KL schedules ------------------------------------------------------------------


def test_kl_schedules():
    c = KLController(KLConfig(schedule="constant", lam=3e-5))
    assert c.value(0) == c.value(10_000) == 3e-5
    c = KLController(KLConfig(schedule="two_stage", switch_step=5))
    assert (c.value(4), c.value(5)) == (1e-7, 1e-5)
    c = KLController(KLConfig(schedule="milder", switch_step=5))
    assert (c.value(4), c.value(5)) == (1e-7, 1e-6)


def test_adaptive_kl_tracks_target_within_bounds():
    c = KLController(KLConfig(schedule="adaptive", lam=1e-6, target=1e-3, alpha=0.5))
    assert c.value(0) == 1e-6
    up = c.update(3e-3)                      # KL above target: λ grows by exp(α·2)
    assert up == pytest.approx(1e-6 * math.exp(1.0))
    down = c.update(0.0)                     # below: λ shrinks by exp(-α)
    assert down == pytest.approx(up * math.exp(-0.5))
    for _ in range(200):
        c.update(1.0)
    assert c.value(7) == 1e-5                # clipped at lam_high
    for _ in range(200):
        c.update(0.0)
    assert c.value(7) == 1e-7                # clipped at lam_low
    state = c.state_dict()
    c2 = KLController(KLConfig(schedule="adaptive"))
    c2.load_state_dict(state)
    assert c2.value(0) == 1e-7
    with pytest.raises(ValueError, match="kl.schedule"):
        KLController(KLConfig(schedule="constant")).load_state_dict(state)


def test_alignment_term_is_weighted_by_the_equalizer():
    scheme = make_scheme("sage", 0.5)
    x, x_pos, x_neg = torch.randn(2, *SHAPE), torch.randn(2, *SHAPE), torch.randn(2, *SHAPE)
    sigma, sigma_next = torch.tensor([1.0, 0.25]), torch.tensor([0.75, 0.0 + 0.1])
    v = torch.randn(2, *SHAPE)
    mu, std = scheme.mean(x, v, sigma, sigma_next), scheme.std(sigma, sigma_next)
    a_pos, a_neg, w = torch.tensor([1.5, 1.5]), torch.tensor([-0.5, -0.5]), torch.tensor([3.0, 0.2])
    one = torch.ones(2)
    mb = MicroBatch(x=x, x_next=x, x_pos=x_pos, x_neg=x_neg, logp_old=torch.zeros(2), sigma=sigma,
                    sigma_next=sigma_next, adv=torch.zeros(2), weight=w, a_pos=a_pos, a_neg=a_neg,
                    align_mask=one, mask=one, cond_idx=torch.zeros(2, dtype=torch.long))
    lc = LossConfig(clip_eps=0.2, strategy="none", beta_anchor=1.0, beta_step=0.0, d_step="k1", gamma=1.0,
                    align_form="loglik")
    _, s = compute_loss(mb, None, lambda x, sg, c: v, scheme, lc, 1.0, n_rows=2, n_align=2)
    j = a_pos * log_prob(x_pos, mu, std) + a_neg * log_prob(x_neg, mu, std)
    assert s["loss/align"].item() == pytest.approx(-(w * j).sum().item() / 2, rel=1e-5)
