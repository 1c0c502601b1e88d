"""The SDE sampler: group recording, exact log-prob replay, trained-step selection."""

from __future__ import annotations

import pytest
import torch

from common.config import RunConfig
from common.sde import Schedule, make_scheme, scheme_from_config
from common.types import Condition
from rollout_worker.models.tiny import tiny_wan_components
from rollout_worker.models.wan import WanVideoModel
from rollout_worker.sampler import (
    sample_group,
    sample_videos,
    select_trained_steps,
    transition_log_prob,
)

COND = Condition(id="c0", prompt="a red cat")


def run_cfg(**sections) -> RunConfig:
    base = {"model": {"family": "wan", "num_frames": 5, "height": 16, "width": 16, "guidance_scale": 2.0,
                      "max_sequence_length": 16},
            "schedule": {"steps": 6, "shift": 3.0},
            "sde": {"scheme": "sage"},
            "sampler": {"group_size": 3, "train_steps": "all", "ode_last_steps": 1}}
    for k, v in sections.items():
        base[k] = {**base.get(k, {}), **v}
    return RunConfig.model_validate(base)


@pytest.fixture(scope="module")
def wan22():
    cfg = run_cfg()
    return WanVideoModel.from_components(tiny_wan_components("t2v_a14b"), cfg.model)


@pytest.mark.parametrize("latent_dtype", ["float32", "bfloat16"])
@torch.no_grad()
def test_group_records_trained_steps_and_replays_exactly(wan22, latent_dtype):
    cfg = run_cfg(sampler={"latent_dtype": latent_dtype})
    group = sample_group(wan22, COND, cfg, seed=3, policy_version=5)
    schedule = Schedule.from_config(cfg.schedule)
    scheme = scheme_from_config(cfg, schedule)
    store = getattr(torch, latent_dtype)
    ks = list(range(schedule.steps - 1))  # all but the last (ODE) step
    assert group.size == 3 and group.policy_version == 5 and group.group_id == "c0-s3-v5"
    cond = wan22.encode([COND.prompt])
    for m in group.members:
        assert m.step_indices == ks and m.spec == scheme.spec(schedule)
        assert m.x.shape == m.x_next.shape == (len(ks), 4, 2, 2, 2) and m.x.dtype == store
        assert m.logp_old.shape == (len(ks),) and m.logp_old.dtype == torch.float32
        assert m.final_latents.dtype == store and m.frames.shape == (5, 16, 16, 3)
        assert (m.spec.name, m.spec.kwargs["eta"], m.guidance_scale, m.policy_version, m.seed) == (
            "sage", 0.5, 2.0, 5, 3)
        assert m.spec.sigmas == schedule.sigmas
        # the chain is continuous: each stored x_{k+1} is the next stored x_k
        assert torch.equal(m.x[1:], m.x_next[:-1])
    # replaying each step's batch as sampled, with σ per sample as the learner holds it (fp32
    # tensors) and the same weights, gives log r = 0 exactly: same σ, same Σ, same operations
    for j, k in enumerate(ks):
        b_x = torch.stack([m.x[j] for m in group.members])
        b_next = torch.stack([m.x_next[j] for m in group.members])
        sig = torch.tensor([schedule.sigmas[k]] * group.size)
        sig_next = torch.tensor([schedule.sigmas[k + 1]] * group.size)
        logp, mu = transition_log_prob(wan22, scheme, b_x, b_next, sig, sig_next, cond.repeat(group.size))
        assert torch.equal(logp, torch.stack([m.logp_old[j] for m in group.members]))
    # batched across members and steps (a learner micro-batch): CPU GEMMs round differently for
    # another batch size (measured ≈3e-7 on the velocity), so exactness holds only to that level

    b_x = torch.cat([m.x for m in group.members])
    b_next = torch.cat([m.x_next for m in group.members])
    sig = torch.tensor([schedule.sigmas[k] for _ in group.members for k in ks])
    sig_next = torch.tensor([schedule.sigmas[k + 1] for _ in group.members for k in ks])
    logp, _ = transition_log_prob(wan22, scheme, b_x, b_next, sig, sig_next, cond.repeat(len(b_x)))
    old = torch.cat([m.logp_old for m in group.members])
    assert float((logp - old).abs().max()) < 1e-6


def test_shared_noise_determinism_and_fresh_noise(wan22):
    cfg = run_cfg()
    a = sample_group(wan22, COND, cfg, seed=11, policy_version=0)
    b = sample_group(wan22, COND, cfg, seed=11, policy_version=0)
    c = sample_group(wan22, COND, cfg, seed=12, policy_version=0)
    assert all(torch.equal(x.x, y.x) and torch.equal(x.frames, y.frames) for x, y in zip(a.members, b.members, strict=True))
    assert not torch.equal(a.members[0].final_latents, c.members[0].final_latents)
    # shared: every member starts from the same noise, then the SDE makes them differ
    x0 = torch.stack([m.x[0] for m in a.members])
    assert torch.equal(x0[0], x0[1]) and torch.equal(x0[0], x0[2])
    assert not torch.equal(a.members[0].final_latents, a.members[1].final_latents)
    fresh = sample_group(wan22, COND, run_cfg(sampler={"shared_noise": False}, align={"enabled": False}), seed=11, policy_version=0)
    assert not torch.equal(fresh.members[0].x[0], fresh.members[1].x[0])


@torch.no_grad()
def test_untrained_steps_as_ode_and_scheme():
    model = WanVideoModel.from_components(tiny_wan_components("t2v"), run_cfg().model)
    # with only step 0 trained, `ode` untrained steps make members that share x_1 identical afterwards
    cfg = run_cfg(sampler={"train_steps": "threshold", "sigma_threshold": 0.99, "untrained_steps": "ode"},
                  schedule={"steps": 4, "shift": 1.0})
    g = sample_group(model, COND, cfg, seed=0, policy_version=0)
    assert g.members[0].step_indices == [0]
    ode = make_scheme("ode")
    m = g.members[0]
    x, cond, s = m.x_next[0:1], model.encode([COND.prompt]), Schedule.from_config(cfg.schedule)
    for k in range(1, s.steps):
        v = model.velocity(x, torch.tensor([s.sigmas[k]]), cond)
        x = ode.mean(x, v, *s.pair(k))
    assert torch.allclose(x[0], m.final_latents, atol=1e-5)
    cfg_scheme = run_cfg(sampler={"train_steps": "threshold", "sigma_threshold": 0.99},
                         schedule={"steps": 4, "shift": 1.0})
    g2 = sample_group(model, COND, cfg_scheme, seed=0, policy_version=0)
    assert not torch.allclose(g2.members[0].final_latents, m.final_latents, atol=1e-4)


def test_trained_step_selection_rules(wan22):
    s = Schedule.linear(10, 3.0)
    sage = make_scheme("sage", 0.5, s)
    base = run_cfg().sampler
    all_steps = select_trained_steps(s, sage, base.model_copy(update={"ode_last_steps": 2}), 0)
    assert all_steps == list(range(8))
    thr = select_trained_steps(s, sage, base.model_copy(update={"train_steps": "threshold",
                                                                "sigma_threshold": 0.9}), 0)
    assert thr == [k for k in range(9) if s.sigmas[k] > 0.9] and thr
    frac = base.model_copy(update={"train_steps": "fraction", "train_fraction": 0.5})
    f1, f2, f3 = (select_trained_steps(s, sage, frac, seed) for seed in (1, 1, 2))
    assert len(f1) == round(0.5 * 9) and f1 == f2 and f1 == sorted(f1) and f1 != f3
    assert max(f1) < 9
    # std 0 steps are never trained: CPS's last step, and every ODE step
    cps = make_scheme("cps", 0.7, s)
    assert 9 not in select_trained_steps(s, cps, base.model_copy(update={"ode_last_steps": 0}), 0)
    assert select_trained_steps(s, make_scheme("ode"), base, 0) == []
    # high-noise-only training never trains a step the frozen low-noise expert runs
    hi = WanVideoModel.from_components(tiny_wan_components("t2v_a14b"), run_cfg(
        model={"train_experts": "high_noise"}).model)
    ks = select_trained_steps(s, sage, base, 0, hi)
    assert ks and all(s.sigmas[k] >= 0.6 for k in ks) and len(ks) < 9


def test_sample_videos_is_deterministic_per_seed_and_batch_independent(wan22):
    s = Schedule.linear(4, 3.0)
    one = sample_videos(wan22, ["a red cat"], [5], s, "sage")
    two = sample_videos(wan22, ["a dog", "a red cat"], [9, 5], s, "sage")
    assert one.shape == (1, 5, 16, 16, 3) and one.dtype == torch.uint8
    assert torch.equal(one[0], two[1])
    with pytest.raises(ValueError, match="seeds"):
        sample_videos(wan22, ["a"], [1, 2], s)


def test_initial_noise_per_condition_is_shared_across_groups_but_step_noise_is_not(wan22):
    for mode, same_start in (("group", False), ("condition", True)):
        cfg = run_cfg(sampler={"initial_noise": mode}, align={"enabled": mode == "condition"})
        a = sample_group(wan22, COND, cfg, seed=1, policy_version=0)
        b = sample_group(wan22, COND, cfg, seed=2, policy_version=0)
        x0_a, x0_b = a.members[0].x[0], b.members[0].x[0]  # x at step 0 is the initial noise
        assert torch.equal(x0_a, x0_b) is same_start, mode
        assert not torch.equal(a.members[0].x_next[0], b.members[0].x_next[0])  # step noise differs


@torch.no_grad()
def test_ti2v_5b_i2v_group_replays_exactly_on_the_learners_build_and_ends_on_the_image():
    """Wan 2.2 TI2V-5B I2V (per-token timesteps, the held first frame): the learner's
    transformer-only build replays every stored step with log r = 0 from the group's own encoded
    condition, and each member's final latents start with the image's latents."""
    import numpy as np

    cfg = run_cfg(model={"task": "i2v", "num_frames": 9, "height": 32, "width": 64},
                  sampler={"latent_dtype": "bfloat16"})
    comps = tiny_wan_components("ti2v_5b")
    rollout = WanVideoModel.from_components(comps, cfg.model)
    learner = WanVideoModel.from_components(comps, cfg.model, parts="transformer")
    image = torch.from_numpy(np.random.RandomState(0).randint(0, 256, (32, 64, 3), dtype=np.uint8))
    group = sample_group(rollout, Condition(id="c1", prompt="a red cat", image=image), cfg, seed=3, policy_version=0)
    schedule = Schedule.from_config(cfg.schedule)
    scheme = scheme_from_config(cfg, schedule)
    cond = group.members[0].cond
    first = cond.tensors["first_frame"]  # [1, 48, 1, 2, 4] in model.dtype
    for j, k in enumerate(group.members[0].step_indices):
        b_x = torch.stack([m.x[j] for m in group.members])
        b_next = torch.stack([m.x_next[j] for m in group.members])
        sig = torch.tensor([schedule.sigmas[k]] * group.size)
        sig_next = torch.tensor([schedule.sigmas[k + 1]] * group.size)
        logp, _ = transition_log_prob(learner, scheme, b_x, b_next, sig, sig_next, cond.repeat(group.size))
        assert torch.equal(logp, torch.stack([m.logp_old[j] for m in group.members]))
    for m in group.members:
        assert torch.equal(m.final_latents[:, :1].float(), first[0].to(torch.bfloat16).float())
    assert not torch.equal(group.members[0].final_latents[:, 1:], group.members[1].final_latents[:, 1:])
