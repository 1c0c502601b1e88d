"""The health monitor's logic without Ray: each check on records and evaluations built to trip
it (and to not trip it), the levels (stop_on / off), the on-policy stats the learner reports for
the numerics check, the pre-launch warnings and `vgrpo runs`' health column."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from helpers_tiny import TinyVideoModel, sample_group

from cluster.evaluation.evaluate import EvalResult
from cluster.health.checks import HealthMonitor, slope_z
from common.config import RunConfig, load_config
from common.types import Condition, Group, Scores, TrainBatch
from learner.advantages import group_spread
from learner.trainer import Trainer


def _cfg(*overrides: str) -> RunConfig:
    return load_config(None, list(overrides))


def _record(step: int, **values) -> dict:
    return {"step": step, "reward_mean": 0.0, **values}


# --- statistics --------------------------------------------------------------------------

def test_slope_z_matches_least_squares_reference():
    rng = np.random.default_rng(0)
    y = 0.3 * np.arange(12) + rng.normal(0, 1.0, 12)
    x = np.arange(12.0)
    coef, resid, *_ = np.linalg.lstsq(np.stack([x, np.ones_like(x)], 1), y, rcond=None)
    cov = np.linalg.inv(np.stack([x, np.ones_like(x)], 1).T @ np.stack([x, np.ones_like(x)], 1))
    se = math.sqrt(cov[0, 0] * resid[0] / (len(x) - 2))
    assert slope_z(list(y)) == pytest.approx(coef[0] / se, rel=1e-9)
    assert slope_z([1.0, 2.0, 3.0]) == math.inf and slope_z([2.0, 2.0, 2.0]) == 0.0
    assert slope_z([1.0, float("nan"), 2.0]) == 0.0  # fewer than three finite points


# --- 1. numerics at the first update --------------------------------------------------------

def _batch(model, seed: int, version: int, groups: int = 1) -> TrainBatch:
    fresh = []
    for c in range(groups):
        g = sample_group(model, Condition(f"c{c}", f"prompt {c}"), group_size=3, seed=seed + c, version=version)
        g.composite = torch.stack([t.final_latents[0].mean() for t in g.members])
        fresh.append(g)
    return TrainBatch(fresh, version=version)


def _trainer_cfg() -> RunConfig:
    return RunConfig.model_validate({"optim": {"micro_batch": 4, "lr": 1e-2, "lora_rank": 4},
                                     "grpo": {"clip_eps": 1e-3}})


def test_on_policy_stats_use_only_rows_the_current_weights_sampled():
    """A stale group first (sampled before the last update): the first micro-batch's log-ratio is
    large, the on-policy one stays ≈ 0 and counts only the fresh group's rows."""
    model = TinyVideoModel()
    tr = Trainer(_trainer_cfg(), model).setup()
    stale = _batch(model, seed=1, version=0)
    tr.train_step(_batch(model, seed=5, version=0))                 # version 0 → 1
    now = _batch(model, seed=2, version=1)
    st = tr.train_step(TrainBatch(stale.fresh + now.fresh, version=1))
    rows_per_group = 3 * 3  # G=3 members, 3 trained steps each
    assert st["onpolicy_rows"] == rows_per_group
    assert st["logratio_first_absmax"] > 1e-3                       # the stale rows moved
    assert st["logratio_onpolicy_absmax"] < 1e-5 and st["clipfrac_onpolicy"] == 0.0
    only_stale = tr.train_step(TrainBatch(_batch(model, seed=3, version=0).fresh, version=2))
    assert only_stale["onpolicy_rows"] == 0 and math.isnan(only_stale["logratio_onpolicy_absmax"])


class _AutocastLearner(TinyVideoModel):
    """The learner's copy runs its velocity under CPU bf16 autocast; the sampler's does not."""

    def velocity(self, x, sigma, cond):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return super().velocity(x, sigma, cond).float()


def test_learner_only_autocast_stops_at_the_first_update_with_one_line():
    sampler = TinyVideoModel()
    learner = _AutocastLearner()
    cfg = _trainer_cfg()
    tr = Trainer(cfg, learner).setup()
    st = tr.train_step(_batch(sampler, seed=0, version=0, groups=2)).values
    mon = HealthMonitor(cfg)
    found = mon.observe({"step": 1, **st})
    assert [f.check for f in found if f.level == "stop"] == ["numerics"]
    reason = mon.stop_reason
    assert "\n" not in reason and "autocast" in reason and "clip_eps" in reason
    assert mon.numerics["logratio_onpolicy_absmax"] > 0.1 * cfg.grpo.clip_eps
    # the same weights without autocast pass
    same = Trainer(cfg, TinyVideoModel()).setup().train_step(_batch(sampler, seed=0, version=0, groups=2)).values
    ok = HealthMonitor(cfg)
    assert ok.observe({"step": 1, **same}) == [] and ok.stop_reason is None


def test_numerics_waits_for_a_step_with_on_policy_rows():
    mon = HealthMonitor(_cfg("grpo.clip_eps=0.001"))
    assert mon.observe(_record(1, onpolicy_rows=0.0, logratio_onpolicy_absmax=float("nan"))) == []
    assert mon.numerics is None
    found = mon.observe(_record(2, onpolicy_rows=8.0, logratio_onpolicy_absmax=0.01))
    assert found[0].check == "numerics" and mon.numerics["step"] == 2


# --- 2. every step ---------------------------------------------------------------------------

def _group(values: list[list[float]], heads=("VQ", "MQ")) -> Group:
    scores = Scores(list(heads), torch.tensor(values, dtype=torch.float32))
    g = Group(Condition("c", "a prompt"), "g0", 0, [], scores)
    g.composite = scores.values.sum(dim=1)  # every head weighted 1
    return g


def test_all_equal_rewards_are_reported_as_zero_spread_with_the_saturated_head():
    groups = [_group([[1.0, 0.2], [1.0, 0.2], [1.0, 0.2]]) for _ in range(4)]
    spread = group_spread(groups)
    assert spread == {"spread/zero/composite": 1.0, "spread/zero/VQ": 1.0, "spread/zero/MQ": 1.0}
    mon = HealthMonitor(_cfg())
    (f,) = mon.observe(_record(1, **spread))
    assert f.check == "zero_spread" and f.level == "warn"
    assert "100% of groups have equal rewards" in f.message and "VQ (100% of groups)" in f.message
    # one saturated head while the composite still varies: the head is named
    mixed = group_spread([_group([[1.0, 0.1], [1.0, 0.5], [1.0, 0.9]]) for _ in range(3)])
    assert mixed["spread/zero/composite"] == 0.0 and mixed["spread/zero/VQ"] == 1.0
    (g,) = HealthMonitor(_cfg()).observe(_record(1, **mixed))
    assert "saturated head(s) with zero spread: VQ" in g.message and "MQ" not in g.message
    # groups with spread: nothing
    assert HealthMonitor(_cfg()).observe(_record(1, **group_spread([_group([[0.1, 0.2], [0.3, 0.1]])]))) == []


def test_on_policy_clip_fraction_and_approx_kl_against_bounds():
    mon = HealthMonitor(_cfg("health.clipfrac_max=0.2", "health.approx_kl_max=0.001"))
    assert mon.observe(_record(1, clipfrac_onpolicy=0.1, approx_kl_onpolicy=1e-4)) == []
    found = mon.observe(_record(2, clipfrac_onpolicy=0.9, approx_kl_onpolicy=0.01))
    assert sorted(f.check for f in found) == ["approx_kl", "clip"]
    assert mon.observe(_record(3, clipfrac_onpolicy=0.9, approx_kl_onpolicy=0.01)) == []  # reported once
    assert len(mon.findings) == 4 and mon.summary()["checks"]["clip"]["fired"] == 2


def test_head_moving_against_the_composite_is_flagged_with_its_z():
    mon = HealthMonitor(_cfg("health.window=8"))
    rng = np.random.default_rng(1)
    found = []
    for s in range(1, 9):
        comp = 0.1 * s + rng.normal(0, 0.01)
        found += mon.observe({"step": s, "reward_mean": comp, "reward/VQ": 1.0 - 0.05 * s + rng.normal(0, 0.01),
                              "reward/MQ": 0.1 * s + rng.normal(0, 0.01)})
    (f,) = found
    assert f.check == "head_against" and f.step == 8 and "VQ" in f.message and "MQ" not in f.message
    keys = mon.record_keys(found)
    assert keys["health/trend_z/VQ"] < -3 < keys["health/trend_z/composite"] and keys["health/status"] == 1


def test_kl_growth_to_the_anchor():
    mon = HealthMonitor(_cfg("health.window=6", "kl.strategy=fixed"))
    found = []
    for s in range(1, 7):
        found += mon.observe(_record(s, **{"kl/d_anchor": 1e-4 * 3 ** s, "kl/d_step": 1e-5}))
    assert [f.check for f in found] == ["kl_growth"] and "pi0 anchor" in found[0].message
    steady = HealthMonitor(_cfg("health.window=6"))
    assert not any(steady.observe(_record(s, **{"kl/d_anchor": 1e-4 * (1 + 0.01 * s)})) for s in range(1, 7))
    # from 0 (a fresh anchor) to small values, and a k1 D_step around 0: below the floor, no growth
    fresh = HealthMonitor(_cfg("health.window=6"))
    assert not any(fresh.observe(_record(s, **{"kl/d_anchor": 1e-5 * (s - 1) ** 2, "kl/d_step": (-1) ** s * 1e-6}))
                   for s in range(1, 7))
    assert fresh.values["kl_growth/anchor"] < 1
    # π_0 measured every other step (NaN between): the last `window` measurements count
    pi0 = HealthMonitor(_cfg("health.window=3", "kl.strategy=dual"))
    found = [f for s in range(1, 7) for f in pi0.observe(_record(s, **{"kl/d_anchor": 1e-4, "kl/d_pi0":
                                                                     1e-3 * 20 ** s if s % 2 else float("nan")}))]
    assert [f.step for f in found] == [5] and "KL to π_0" in found[0].message


# --- 3. held out ---------------------------------------------------------------------------

def _eval(vq: np.ndarray, mq: np.ndarray) -> EvalResult:
    return EvalResult(["VQ", "MQ"], np.stack([vq, mq], 1), vq + mq)


def test_hacking_fires_when_training_reward_rises_while_a_held_out_head_falls():
    rng = np.random.default_rng(2)
    base_vq, base_mq = rng.normal(0.5, 0.1, 16), rng.normal(0.5, 0.1, 16)
    mon = HealthMonitor(_cfg("health.window=3"))
    mon.observe_eval(0, _eval(base_vq, base_mq))
    for s in range(1, 11):
        mon.observe(_record(s, reward_mean=0.1 * s + rng.normal(0, 0.01)))
    # held out: MQ up a lot, VQ down consistently (paired), composite up
    (f,) = mon.observe_eval(10, _eval(base_vq - 0.05 + rng.normal(0, 0.005, 16), base_mq + 0.2))
    assert f.check == "hacking" and "VQ" in f.message and "MQ" not in f.message.split("while")[0]
    assert mon.values["heldout_z/VQ"] < -3
    # the same evaluation without the fall: no finding
    calm = HealthMonitor(_cfg())
    calm.observe_eval(0, _eval(base_vq, base_mq))
    for s in range(1, 11):
        calm.observe(_record(s, reward_mean=0.1 * s))
    assert calm.observe_eval(10, _eval(base_vq + rng.normal(0, 0.005, 16), base_mq + 0.2)) == []


def test_hacking_counts_the_held_out_composite_rising_as_the_reward_rising():
    """A flat, noisy training curve but a held-out composite that rises while VQ falls."""
    rng = np.random.default_rng(3)
    vq, mq = rng.normal(0.5, 0.1, 16), rng.normal(0.5, 0.1, 16)
    mon = HealthMonitor(_cfg())
    mon.observe_eval(0, _eval(vq, mq))
    (f,) = mon.observe_eval(5, _eval(vq - 0.05 + rng.normal(0, 0.003, 16), mq + 0.2 + rng.normal(0, 0.003, 16)))
    assert f.check == "hacking" and "held-out composite" in f.message


def test_stagnation_and_stop_on_stop_the_run():
    rng = np.random.default_rng(4)
    vq, mq = rng.normal(0.5, 0.1, 16), rng.normal(0.5, 0.1, 16)
    mon = HealthMonitor(_cfg("health.stagnation_evals=2", "health.stop_on=[stagnation]"))
    for s in (0, 10):
        assert mon.observe_eval(s, _eval(vq, mq)) == []
    (f,) = mon.observe_eval(20, _eval(vq, mq))
    assert (f.check, f.level) == ("stagnation", "stop") and "steps 0 → 20" in f.message
    assert mon.stop_reason.startswith("health check 'stagnation' failed: held-out rewards did not move")
    assert mon.summary()["status"] == "stop"


def test_off_checks_never_fire():
    mon = HealthMonitor(_cfg("health.off=[zero_spread]"))
    assert mon.observe(_record(1, **{"spread/zero/composite": 1.0})) == []
    assert mon.summary()["checks"]["zero_spread"]["level"] == "off"
    assert HealthMonitor(_cfg("health.enabled=false")).observe(_record(1, **{"spread/zero/composite": 1.0})) == []


# --- 4. pre-launch --------------------------------------------------------------------------

def test_preflight_warns_about_small_groups_and_clip_below_measured_drift(tmp_path):
    from cluster.driver.preflight import health_warnings
    from cluster.runs.run_dir import RunDir

    cfg = _cfg("sampler.group_size=2", "train.groups_per_step=1", f"run.root={tmp_path}", "run.name=old")
    lines = health_warnings(cfg)
    assert any(x.startswith("sampler.group_size = 2") for x in lines)
    assert any(x.startswith("train.groups_per_step = 1") for x in lines)
    assert not any("clip_eps" in x for x in lines)  # no earlier run measured anything
    old = RunDir.create(cfg)
    (old.path / "health.json").write_text(json.dumps({"numerics": {"logratio_onpolicy_absmax": 3e-3}}))
    new = _cfg(f"run.root={tmp_path}", "grpo.clip_eps=0.001")
    (line,) = health_warnings(new)
    assert "grpo.clip_eps = 0.001" in line and "3.00e-03" in line and str(old.path) in line
    assert health_warnings(_cfg(f"run.root={tmp_path}", "grpo.clip_eps=0.01")) == []
    assert health_warnings(_cfg(f"run.root={tmp_path}", "grpo.clip_eps=0.001", "model.dtype=bfloat16")) == []


# --- 5. surfaces ----------------------------------------------------------------------------

def test_runs_shows_each_runs_health(tmp_path, capsys):
    from cluster.cli import main
    from cluster.runs.run_dir import RunDir

    for name, checks, status in (("clean", {}, "ok"), ("hacked", {"hacking": "warn"}, "warn"),
                                 ("broken", {"numerics": "stop"}, "stop")):
        rd = RunDir.create(_cfg(f"run.root={tmp_path}", f"run.name={name}"))
        rd.log({"step": 1, "time_s": 1.0, "reward_mean": 0.1})
        summary = {"status": status, "checks": {c: {"level": lvl, "fired": 1} for c, lvl in checks.items()}}
        (rd.path / "health.json").write_text(json.dumps(summary))
    RunDir.create(_cfg(f"run.root={tmp_path}", "run.name=older"))  # written before health checks existed
    capsys.readouterr()
    assert main(["runs", str(tmp_path), "--json"]) == 0
    got = {r["run"]: r["health"] for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert got == {"clean": "ok", "hacked": "warn: hacking", "broken": "stop: numerics", "older": None}
    assert main(["runs", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "health" in out and "stop: numerics" in out and "warn: hacking" in out


def test_health_table_lists_each_check():
    from rich.console import Console

    from cluster.health.checks import health_table

    mon = HealthMonitor(_cfg())
    mon.observe(_record(1, onpolicy_rows=4.0, logratio_onpolicy_absmax=1e-9, **{"spread/zero/composite": 1.0}))
    console = Console(width=200, record=True)
    console.print(health_table(mon.summary()))
    text = console.export_text()
    assert "training health: warn" in text and "zero_spread" in text and "max |log r| = 1.00e-09" in text


def test_vgrpo_train_prints_the_pre_launch_warnings_before_it_starts(tmp_path, monkeypatch, capsys):
    from cluster.cli import main
    from cluster.driver.driver import Driver

    seen = []

    def setup(self, resume=None):
        seen.append(capsys.readouterr().out)  # what was printed before any actor would start
        raise RuntimeError("stop here")

    monkeypatch.setattr(Driver, "setup", setup)
    with pytest.raises(RuntimeError, match="stop here"):
        main(["train", "-c", "configs/quickstart.yaml", f"run.root={tmp_path}", "sampler.group_size=2"])
    assert "warning: sampler.group_size = 2: advantages from fewer than 4 samples" in seen[0]


def test_a_failing_held_out_evaluation_is_skipped_not_fatal(tmp_path):
    from types import SimpleNamespace

    from cluster.health.hook import DriverHealth
    from common.metrics import Metrics

    class DeadActor:
        class evaluate_pairs:  # noqa: N801 - mimics an actor method handle
            @staticmethod
            def remote(*args):
                raise RuntimeError("actor died\nwith a long trace")

    notes: list[str] = []
    hook = DriverHealth(_cfg(), SimpleNamespace(path=tmp_path), notes.append, RuntimeError)
    metrics = Metrics(backend="memory")
    hook.heldout(0, [DeadActor()], None, metrics, start=True)
    assert notes == ["health: held-out evaluation at step 0 skipped: RuntimeError: actor died"]
    assert hook.monitor.evals == []
    # a run too short for a second held-out evaluation takes no baseline
    short = DriverHealth(_cfg("train.steps=10", "health.eval_every=20"), SimpleNamespace(path=tmp_path),
                         notes.append, RuntimeError)
    short.heldout(0, [DeadActor()], None, metrics, start=True)
    assert len(notes) == 1


def test_findings_and_health_numbers_reach_prometheus(tmp_path):
    from types import SimpleNamespace

    from cluster.health.hook import DriverHealth
    from common.metrics import Metrics

    m = Metrics(backend="memory")
    hook = DriverHealth(_cfg(), SimpleNamespace(path=tmp_path), lambda line: None, RuntimeError)
    record = _record(1, onpolicy_rows=8.0, logratio_onpolicy_absmax=2e-7, clipfrac_onpolicy=0.0,
                     **{"spread/zero/composite": 1.0, "spread/zero/VQ": 1.0, "spread/zero/MQ": 0.0, "reward/VQ": 0.5})
    hook.on_step(record, m)
    assert record["health/status"] == 1 and "zero_spread" in record["health/findings"][0]
    assert m.value("vgrpo_health_status") == 1.0
    assert m.value("vgrpo_zero_spread_ratio", head="VQ") == 1.0 and m.value("vgrpo_zero_spread_ratio", head="MQ") == 0.0
    assert m.value("vgrpo_onpolicy_logratio_absmax") == 2e-7
    assert m.value("vgrpo_health_findings", check="zero_spread", level="warn") == 1.0
    assert m.value("vgrpo_health_findings", check="numerics", level="stop") == 0.0
    # not measured yet (a window, a second held-out evaluation): neutral, so every dashboard series exists
    assert m.value("vgrpo_reward_trend_z", head="composite") == 0.0 and m.value("vgrpo_heldout_z", head="VQ") == 0.0
    assert m.value("vgrpo_kl_growth", term="pi0") == 1.0
    saved = json.loads((tmp_path / "health.json").read_text())
    assert saved["numerics"]["logratio_onpolicy_absmax"] == 2e-7 and saved["status"] == "warn"


def test_kl_to_pi0_is_measured_and_equals_the_fixed_anchors_kl():
    """With λ_KL = 0 the KL terms do not change training, so a `dual` run (moving anchor) and a
    `fixed` run (π_0 anchor) take the same steps: the dual run's measured KL to π_0 must equal the
    fixed run's D_anchor, step by step; on steps between measurements it is NaN."""
    def trainer(strategy: str) -> Trainer:
        cfg = RunConfig.model_validate({"optim": {"micro_batch": 4, "lr": 1e-2, "lora_rank": 4},
                                        "kl": {"strategy": strategy, "schedule": "constant", "lam": 0.0},
                                        "health": {"kl_pi0_every": 2}})
        return Trainer(cfg, TinyVideoModel()).setup()

    model = TinyVideoModel()
    dual, fixed = trainer("dual"), trainer("fixed")
    for step in range(4):
        batch = _batch(model, seed=10 * step, version=step)
        a, b = dual.train_step(batch).values, fixed.train_step(batch).values
        assert b["kl/d_pi0"] == b["kl/d_anchor"]
        if step % 2 == 0:
            assert a["kl/d_pi0"] == pytest.approx(b["kl/d_anchor"], rel=1e-5, abs=1e-12)
        else:
            assert "kl/d_pi0" not in a
    assert b["kl/d_anchor"] > 0  # the policy moved away from π_0


def test_vgrpo_plan_prints_the_pre_launch_warnings(tmp_path, capsys):
    from cluster.cli import main

    assert main(["plan", "-c", "configs/wan22_i2v_tagrpo.yaml", f"run.root={tmp_path}", "train.groups_per_step=1"]) == 0
    out = capsys.readouterr().out
    assert "warning: train.groups_per_step = 1: one step's gradient comes from fewer than 2 prompts" in out


def test_a_head_against_warning_the_held_out_pairs_contradict_does_not_set_the_status():
    """head_against reads the training samples; the before → after evaluation decides it: where
    the flagged head rose on the held-out pairs (paired z > health.z) the run's status is ok and the
    table says the warning was not confirmed; where it did not rise, the warning stands."""
    from cluster.health.checks import health_table

    rng = np.random.default_rng(3)
    base_vq, base_mq = rng.normal(0.8, 0.05, 64), rng.normal(0.5, 0.1, 64)

    def trained(vq_shift: float) -> HealthMonitor:
        mon = HealthMonitor(_cfg("health.window=8"))
        for s in range(1, 9):  # the training trend: composite up, VQ down
            mon.observe({"step": s, "reward_mean": 0.1 * s + rng.normal(0, 0.01),
                         "reward/VQ": 1.0 - 0.05 * s + rng.normal(0, 0.01), "reward/MQ": 0.1 * s})
        before = _eval(base_vq, base_mq)
        after = _eval(base_vq + vq_shift + rng.normal(0, 0.002, 64), base_mq + 0.05)
        mon.final(before, after, 8)
        return mon

    rose = trained(+0.016)
    assert [f.check for f in rose.findings] == ["head_against"]
    summary = rose.summary()
    assert summary["status"] == "ok"
    note = summary["checks"]["head_against"]["held_out"]
    assert note.startswith("not confirmed held out: before → after VQ +0.01") and "(z " in note
    from rich.console import Console
    console = Console(record=True, width=200)
    console.print(health_table(summary))
    text = console.export_text()
    assert "training health: ok" in text and "not confirmed held out" in text

    for shift in (0.0, -0.016):  # held out VQ flat, or falling: the warning stands
        mon = trained(shift)
        assert mon.summary()["status"] == "warn" and "held_out" not in mon.summary()["checks"]["head_against"]
