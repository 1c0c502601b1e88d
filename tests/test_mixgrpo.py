"""MixGRPO's sliding window and MixGRPO-Flash's tail: the window's position step by step against
the paper's Algorithm 1 re-implemented here, SDE only inside it, a resume that continues it, and
the compressed DPM-Solver++(2M) tail against the released script's schedule rule."""

from __future__ import annotations

import pytest
import torch
from helpers_tiny import TinyVideoModel

from common.config import ConfigError, RunConfig, load_config
from common.sde import Schedule, make_scheme, scheme_from_config
from common.types import Condition, Scores, TrainBatch
from learner.trainer import Trainer
from rollout_worker.dpm import DPMSolver2M
from rollout_worker.sampler import (
    draw_trained_steps,
    plan_steps,
    sample_group,
    tail_sigmas,
    window_start,
)

MIX = {"sde": {"scheme": "flow"}, "align": {"enabled": False}, "bank": {"enabled": False},
       "kl": {"strategy": "none"}, "grpo": {"equalizer": False},
       "sampler": {"train_steps": "window", "untrained_steps": "ode", "group_size": 3}}


def mix_cfg(**sections) -> RunConfig:
    base = {k: dict(v) for k, v in MIX.items()}
    for k, v in sections.items():
        base[k] = {**base.get(k, {}), **v}
    return RunConfig.model_validate(base)


def paper_windows(T: int, w: int, tau: int, s: int, iterations: int, start: int = 0) -> list[list[int]]:
    """MixGRPO's Algorithm 1: the left boundary l starts at 0; iteration m = 1 … M samples with the
    SDE and optimises on {l, …, l + w - 1}; after it, if m mod τ = 0, l ← min(l + s, T - w)."""
    left, out = start, []
    for m in range(1, iterations + 1):
        out.append(list(range(left, left + w)))
        if m % tau == 0:
            left = min(left + s, T - w)
    return out


@pytest.mark.parametrize("T, w, tau, s, start, iterations", [
    (25, 4, 25, 1, 0, 600),   # the paper's FLUX setting: 25 steps, w 4, τ 25, s 1 (past the last window)
    (10, 3, 2, 2, 1, 14),     # a wider stride from a later start
    (25, 4, 20, 0, 0, 60),    # MixGRPO-Flash*: a frozen window
])
def test_window_positions_follow_the_papers_schedule_step_by_step(T, w, tau, s, start, iterations):
    cfg = mix_cfg(schedule={"steps": T, "shift": 3.0},
                  sampler={"window": {"width": w, "shift_interval": tau, "stride": s, "start": start}})
    sched = Schedule.from_config(cfg.schedule)
    scheme = make_scheme("flow", 0.7, sched)
    want = paper_windows(T, w, tau, s, iterations, start)
    for version, window in enumerate(want):  # the policy version is the optimizer steps taken
        got = draw_trained_steps(sched, scheme, cfg.sampler, seed=version, members=3, version=version)
        assert got == [window] * 3, version
    if s:  # the window reached the low-noise end and stays there
        assert want[-1] == list(range(T - w, T))


def test_released_scripts_window_over_its_300_steps():
    """The released script (max_train_steps 300, iters_per_group 25, group_size 4, 25 steps): the
    window starts at step l = ⌊t/25⌋ for t = 0 … 299, so its last one is 11 … 14."""
    cfg = mix_cfg(schedule={"steps": 25, "shift": 3.0})
    for t in (0, 24, 25, 299):
        assert window_start(25, cfg.sampler.window, t) == t // 25
    assert window_start(25, cfg.sampler.window, 10_000) == 21  # held at T - w


def test_random_window_schedule_is_a_function_of_the_version():
    w = mix_cfg(sampler={"window": {"schedule": "random", "width": 3}}).sampler.window
    starts = [window_start(9, w, v, run_seed=0) for v in range(60)]
    assert all(0 <= s <= 6 for s in starts) and len(set(starts)) > 3
    assert starts == [window_start(9, w, v, run_seed=0) for v in range(60)]
    assert starts != [window_start(9, w, v, run_seed=1) for v in range(60)]


def test_sde_only_inside_the_window_and_the_window_moves_with_the_version():
    model = TinyVideoModel()
    cfg = mix_cfg(schedule={"steps": 6, "shift": 1.0},
                  sampler={"window": {"width": 2, "shift_interval": 1, "stride": 1}})
    cond = Condition("c", "a prompt")
    for version, window in ((0, [0, 1]), (2, [2, 3]), (9, [4, 5])):
        g = sample_group(model, cond, cfg, seed=5, policy_version=version)
        m = g.members
        assert m[0].step_indices == window and all(t.step_indices == window for t in m)
        # shared noise and ODE before the window: every member reaches it at the same latent
        # (up to the transformer's batch-row rounding)
        assert all(torch.allclose(t.x[0], m[0].x[0], atol=1e-5) for t in m)
        # inside it the SDE separates them
        assert not torch.allclose(m[0].x_next[-1], m[1].x_next[-1])
    # after the window the steps are ODE: replaying member 0 from its last recorded latent gives its video
    s = Schedule.from_config(cfg.schedule)
    x = m[0].x_next[-1:].clone()
    for k in range(window[-1] + 1, s.steps):
        x = make_scheme("ode").mean(x, model.velocity(x, torch.tensor([s.sigmas[k]]), model.encode([cond.prompt])),
                                    *s.pair(k))
    assert torch.allclose(x[0], m[0].final_latents, atol=1e-6)


def test_window_position_survives_a_resume(tmp_path):
    """The window is a function of the policy version, which the checkpoint restores."""
    model = TinyVideoModel()
    cfg = mix_cfg(schedule={"steps": 6, "shift": 1.0}, optim={"micro_batch": 8, "lora_rank": 4},
                  sampler={"window": {"width": 2, "shift_interval": 1, "stride": 1}})
    tr = Trainer(cfg, model).setup()
    for _ in range(2):
        g = sample_group(model, Condition("c", "p"), cfg, seed=tr.version, policy_version=tr.version)
        g.composite = torch.stack([t.final_latents.mean() for t in g.members])
        g.scores = Scores(["h"], g.composite.view(-1, 1))
        tr.train_step(TrainBatch([g], version=tr.version))
    path = tr.save_checkpoint(tmp_path)
    tr2 = Trainer(cfg, TinyVideoModel()).setup()
    tr2.load_checkpoint(path)
    after = sample_group(model, Condition("c", "p"), cfg, seed=0, policy_version=tr2.version)
    assert tr2.version == 2 and after.members[0].step_indices == [2, 3]


def upstream_post_sigmas(T: int, last: int, ratio: float, shift: float) -> list[float]:
    """The released script's rebuilt tail (run_sample_step, dpm_apply_strategy=post): from the
    unshifted time at step last + 1 down to 0 in int(max((T - last)·ratio, 1)) points, shifted."""
    n = int(max((T - last) * ratio, 1))
    t0 = [1 - i / T for i in range(T + 1)][last + 1]
    ts = [t0 + (0 - t0) * j / (n - 1) for j in range(n)] if n > 1 else [t0]  # torch.linspace(t0, 0, n)
    return [shift * t / (1 + (shift - 1) * t) for t in ts]


@pytest.mark.parametrize("l0", [0, 5, 17])
def test_flash_tail_matches_the_released_post_schedule(l0):
    T, ratio, shift = 25, 0.4, 3.0
    sched = Schedule.linear(T, shift)
    last = l0 + 3
    got = tail_sigmas(sched, last + 1, ratio, shift)
    want = upstream_post_sigmas(T, last, ratio, shift)
    assert len(got) == len(want) and got[-1] == 0.0 and got[0] == sched.sigmas[last + 1]
    assert got == pytest.approx(want, abs=1e-6)
    cfg = mix_cfg(schedule={"steps": T, "shift": shift},
                  sampler={"post_solver": "dpm2", "post_compress": ratio, "window": {"start": l0}})
    plan = plan_steps(sched, make_scheme("flow", 0.7, sched), list(range(l0, l0 + 4)), cfg)
    assert len(plan) == last + 1 + len(want) - 1 < T   # fewer model calls than the T steps
    assert [p.rule for p in plan[last + 1:]] == ["dpm2"] * (len(want) - 1)


@pytest.mark.parametrize("l0", [3, 4])
def test_flash_tail_takes_one_step_where_the_released_rule_takes_none(l0):
    """A late window in the toy MixGRPO-Flash row (10 steps, ratio 0.4): the released rule's post
    schedule is one point, σ at step last + 1, so its sample stops there with no post step; vgrpo's
    departure (docs/algorithm.md section 2b) takes one step from there to σ = 0."""
    T, ratio, shift = 10, 0.4, 3.0
    sched = Schedule.linear(T, shift)
    last = l0 + 3
    want = upstream_post_sigmas(T, last, ratio, shift)
    assert len(want) == 1 and want[0] == pytest.approx(sched.sigmas[last + 1]) and want[0] > 0  # it ends noisy
    got = tail_sigmas(sched, last + 1, ratio, shift)
    assert got == [sched.sigmas[last + 1], 0.0]
    cfg = mix_cfg(schedule={"steps": T, "shift": shift},
                  sampler={"post_solver": "dpm2", "post_compress": ratio, "window": {"start": l0}})
    plan = plan_steps(sched, make_scheme("flow", 0.7, sched), list(range(l0, l0 + 4)), cfg)
    assert len(plan) == last + 2 and plan[-1].rule == "dpm2" and plan[-1].sigma_next == 0.0


def test_flash_rollout_runs_dpm_2m_on_the_compressed_tail():
    model = TinyVideoModel()
    cfg = mix_cfg(schedule={"steps": 10, "shift": 3.0},
                  sampler={"post_solver": "dpm2", "post_compress": 0.4, "window": {"width": 2}})
    cond = Condition("c", "a prompt")
    g = sample_group(model, cond, cfg, seed=2, policy_version=0)
    m, s = g.members[1], Schedule.from_config(cfg.schedule)
    assert m.step_indices == [0, 1] and m.spec.sigmas == s.sigmas   # the configured σ are kept
    assert m.spec == scheme_from_config(cfg, s).spec(s)             # and the window's scheme
    c = model.encode([cond.prompt])
    solver = DPMSolver2M()
    x_last = m.x[-1:]
    solver.observe(x_last, model.velocity(x_last, torch.tensor([s.sigmas[1]]), c), s.sigmas[1])
    x, tail = m.x_next[-1:].clone(), tail_sigmas(s, 2, 0.4, 3.0)
    for a, b in zip(tail, tail[1:], strict=False):
        x = solver.step(x, model.velocity(x, torch.tensor([a]), c), a, b)
    assert torch.allclose(x[0], m.final_latents, atol=1e-5)


def test_window_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="sampler.window.width=12"):
        load_config(None, ["sampler.train_steps=window", "schedule.steps=10", "sampler.window.width=12"])
    with pytest.raises(ConfigError, match="sampler.untrained_steps=ode"):
        load_config(None, ["sampler.post_solver=dpm2"])
    with pytest.raises(ConfigError, match="schedule.sigmas"):
        load_config(None, ["sampler.untrained_steps=ode", "sampler.post_compress=0.4",
                           "schedule.sigmas=[1.0, 0.5, 0.0]"])
