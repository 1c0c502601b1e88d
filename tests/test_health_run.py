"""Health checks in real `vgrpo train` runs (the quickstart config, a few tiny steps, every role a
Ray actor, the embedded Redis): a learner whose numerics differ from the sampler's stops the run
at the first update with one line; a reward bought with another head is flagged as hacking by the
held-out evaluation; the final console table, summary.json, metrics.jsonl and `vgrpo runs` carry
the health summary."""

from __future__ import annotations

import json

import health_helpers
import pytest
from ray import cloudpickle

from cluster.cli import main

cloudpickle.register_pickle_by_value(health_helpers)  # Ray workers cannot import tests/

TINY = ["train.mode=sync", "train.groups_per_step=2", "train.eval_seeds=2", "train.checkpoint_every=100",
        "sampler.group_size=4", "schedule.steps=6", "bank.capacity=4", "optim.micro_batch=16"]


@pytest.fixture
def prompts(tmp_path):
    p = tmp_path / "prompts.txt"
    p.write_text("a red square moving left\na blue square moving up\n")  # conditions repeat: the bank is used
    return p


def _train(tmp_path, prompts, name: str, *overrides: str) -> int:
    return main(["train", "-c", "configs/quickstart.yaml", *TINY, f"train.prompts={prompts}",
                 f"run.root={tmp_path / 'runs'}", f"run.name={name}", *overrides])


def _listed_health(capsys, root) -> str:
    capsys.readouterr()
    assert main(["runs", str(root), "--json"]) == 0
    return json.loads(capsys.readouterr().out)["health"]


def test_learner_only_autocast_stops_the_run_at_the_first_update(ray_session, tmp_path, prompts, monkeypatch, capsys):
    import learner.actor

    real = learner.actor.LearnerGroup

    def autocast_learner(cfg, **kw):
        return real(cfg, model_factory=health_helpers.AutocastToyLearner(cfg.model_dump(mode="python")), **kw)

    monkeypatch.setattr(learner.actor, "LearnerGroup", autocast_learner)
    assert _train(tmp_path, prompts, "mismatch", "train.steps=4", "health.eval_every=0", "--no-eval") == 1
    out = capsys.readouterr().out
    run = tmp_path / "runs" / "mismatch"
    status = json.loads((run / "status.json").read_text())
    reason = status["reason"]
    assert status["state"] == "stopped" and "\n" not in reason
    assert reason.startswith("health check 'numerics' failed: max |log r| = ")
    assert "dtype/autocast mismatch between sampler and learner" in reason
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] and rows[0]["health/status"] == 2
    assert rows[0]["logratio_onpolicy_absmax"] > 0.1 * 1e-4 and rows[0]["onpolicy_rows"] > 0
    assert "health stop at step 1: numerics" in rows[0]["health/findings"][0]
    assert any(p.name == "step_00000001" for p in (run / "checkpoints").iterdir())  # stopped with a checkpoint
    summary = json.loads((run / "summary.json").read_text())
    assert summary["health"]["status"] == "stop" and summary["health"]["numerics"]["step"] == 1
    assert "training health: stop" in out
    assert _listed_health(capsys, tmp_path / "runs") == "stop: numerics"


def test_quickstart_flags_a_reward_bought_with_another_head(ray_session, tmp_path, prompts, monkeypatch, capsys):
    """`gamed` (brightness) is the composite; `quality` falls exactly as it rises. The held-out
    evaluation every 2 steps sees quality fall while the composite rises: hacking fires, and the
    final table (after the before/after table) shows it."""
    import reward_worker.actor as ra

    def gamed_actors(cfgs, pool, factory=None, options=None):  # placed as the driver places them
        return {n: [ra.create_reward_actor(c, pool, health_helpers.GamedFactory(), options(m) if options else None)]
                for m, (n, c) in enumerate(zip(ra.actor_names(cfgs), cfgs, strict=True))}

    monkeypatch.setattr(ra, "create_reward_actors", gamed_actors)
    assert _train(tmp_path, prompts, "gamed", "train.steps=4", "health.eval_every=2",
                  "rewards.models=[{name: toy, weights: {gamed: 1.0, quality: 0.0}}]") == 0
    out = capsys.readouterr().out
    run = tmp_path / "runs" / "gamed"
    summary = json.loads((run / "summary.json").read_text())
    health = summary["health"]
    assert health["status"] == "warn" and health["held_out_evals"] == [0, 2, 4]
    hacking = health["checks"]["hacking"]
    assert hacking["fired"] >= 1 and hacking["first_step"] == 2 and "held-out quality" in hacking["last"]
    assert health["checks"]["numerics"]["fired"] == 0 and health["numerics"]["logratio_onpolicy_absmax"] < 1e-5
    quality = next(r for r in summary["paired"] if r["key"] == "quality")
    assert quality["z"] < -3  # the independent before/after evaluation agrees
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[2]["health/status"] == 1 and rows[2]["health/heldout_z/quality"] < -3  # step 3, after the eval at 2
    assert rows[2]["health/findings"][0].startswith("health warn at step 2: hacking: held-out quality")
    assert out.index("after − before") < out.index("training health: warn") and "hacking" in out
    assert _listed_health(capsys, tmp_path / "runs") == "warn: hacking"


def test_toy_i2v_held_out_checks_run_on_the_first_frames(ray_session, tmp_path, capsys):
    """`vgrpo train -c configs/toy_i2v.yaml`: the held-out evaluation samples every (first frame,
    prompt) pair of the held-out set with its image, and the toy I2V reward scores it (it refuses
    videos without their first frames: the checks used to be skipped). With a learning rate too
    small to move the policy, the held-out rewards stand still: stagnation fires at step 1."""
    from cluster.data.prompts import load_prompts

    assert main(["train", "-c", "configs/toy_i2v.yaml", "train.mode=sync", "train.steps=2",
                 "train.groups_per_step=2", "sampler.group_size=4", "schedule.steps=6", "bank.capacity=4",
                 "optim.micro_batch=16", "optim.lr=1e-12", "train.checkpoint_every=100", "health.eval_every=1",
                 "health.stagnation_evals=1", f"run.root={tmp_path / 'runs'}", "run.name=i2v", "--no-eval"]) == 0
    out = capsys.readouterr().out
    run = tmp_path / "runs" / "i2v"
    pairs = len(load_prompts("toy-i2v-eval")) * 2  # health.eval_seeds = 2
    assert "skipped" not in out and out.count(f"on {pairs} pairs") == 3, out
    health = json.loads((run / "health.json").read_text())
    assert health["held_out_evals"] == [0, 1, 2]
    stagnation = health["checks"]["stagnation"]
    assert stagnation["fired"] >= 1 and stagnation["first_step"] == 1
    assert "held-out rewards did not move" in stagnation["last"]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    # the hacking check compared the held-out pairs head by head, the image-alignment head too
    assert {"health/heldout_z/composite", "health/heldout_z/IA"} <= rows[1].keys()
