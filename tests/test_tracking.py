"""The experiment trackers on their own (no Ray): what each backend stores, read back with the
backend's own reader; secrets masked; a reopened run directory continues the same tracker runs;
a missing package named with its pip install; only the driver imports a tracker."""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cluster.evaluation.eval_set import grid_pairs
from cluster.runs.tracking import Tracker, check_installed, tiled, video_grid
from common.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
SECRET = "hunter2-not-for-trackers"


def _video(seed: int, n: int = 3, f: int = 4, h: int = 16, w: int = 16) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, f, h, w, 3), dtype=np.uint8)


def test_video_grid_places_each_video_in_its_cell():
    frames = _video(0, n=3, h=8, w=12)
    grid = video_grid(frames, per_row=2, cell=24, gap=2)  # 12 px → ×2
    assert grid.shape == (4, 2 * 16 + 2, 2 * 24 + 2, 3)
    for i, (r, c) in enumerate([(0, 0), (0, 1), (1, 0)]):
        cell = grid[:, r * 18: r * 18 + 16, c * 26: c * 26 + 24]
        np.testing.assert_array_equal(cell[:, ::2, ::2], frames[i])
        np.testing.assert_array_equal(cell[:, 1::2, 1::2], frames[i])
    assert (grid[:, 18:, 26:] == 128).all()  # the empty fourth cell stays grey


def test_eval_grid_puts_the_first_seed_of_every_prompt_first():
    frames = np.stack([np.full((2, 4, 4, 3), i, np.uint8) for i in range(6)])  # 3 prompts × 2 seeds
    grid = tiled(frames[grid_pairs(len(frames), seeds=2, limit=4)])
    cells = [grid[0, r * (64 + 2) + 1, c * (64 + 2) + 1, 0] for r in range(1) for c in range(4)]
    assert cells == [0, 2, 4, 1]  # prompt-major input: pair index = prompt * seeds + seed


def test_missing_backend_names_the_pip_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(ConfigError) as e:
        check_installed(load_config(None, ["log.backends=[tensorboard,mlflow]"]))
    assert str(e.value) == ("log.backends lists 'mlflow' but the mlflow package is not installed; "
                            "run: pip install 'vgrpo[mlflow]'")
    check_installed(load_config(None, ["log.backends=[jsonl]"]))  # jsonl needs nothing


def _wandb_records(run_dir: Path) -> list[list[dict]]:
    out = []
    for log in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        text = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)],
                              capture_output=True, text=True, timeout=120, check=True).stdout
        out.append([json.loads(line) for line in text.splitlines() if line.startswith("{")])
    return out


def test_backends_store_metrics_videos_and_masked_config_and_resume_the_same_runs(tmp_path, monkeypatch):
    for mod in ("tensorboard", "wandb", "mlflow"):
        pytest.importorskip(mod)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = load_config(None, ["log.backends=[tensorboard,wandb,mlflow]", "log.wandb.name=exp",
                             f"bank.redis_url=redis://:{SECRET}@redis.example:6379/0"])
    rows = [{"step": s, "reward_mean": 0.25 * s, "kl/d_step": 1e-4 / s, "groups_trained": 2 * s,
             "bank/bytes": float("nan"), "note": "text"} for s in (1, 2, 3)]

    tracker = Tracker.open(cfg, tmp_path)
    for row in rows[:2]:
        tracker.metrics(row)
    tracker.video("videos/train", video_grid(_video(1), 3), tmp_path / "samples" / "v.gif", 2, 4.0)
    tracker.metrics({"step": 3, "reward_mean": -9.0})  # lost: the checkpoint was at step 2
    tracker.close("interrupted")
    ids = json.loads((tmp_path / "trackers.json").read_text())
    # reopened as `vgrpo resume` does: the same W&B and MLflow runs go on; TensorBoard purges past step 2
    tracker = Tracker.open(cfg, tmp_path, resume_step=2)
    tracker.metrics(rows[2])
    tracker.close("finished")
    assert json.loads((tmp_path / "trackers.json").read_text()) == ids

    expected = {s: {"reward_mean": 0.25 * s, "kl/d_step": 1e-4 / s, "groups_trained": 2.0 * s} for s in (1, 2, 3)}
    # TensorBoard
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    ea.Reload()
    assert "bank/bytes" not in ea.Tags()["scalars"] and "note" not in ea.Tags()["scalars"]
    for key in expected[1]:
        got = [(e.step, e.value) for e in ea.Scalars(key)]  # the lost step 3 purged, not doubled
        assert got == [(s, pytest.approx(v[key], rel=1e-6)) for s, v in expected.items()]
    (img,) = ea.Images("videos/train")
    assert img.step == 2 and img.encoded_image_string == (tmp_path / "samples" / "v.gif").read_bytes()

    # W&B: two sessions of one run id, the config with the Redis password masked
    first, second = _wandb_records(tmp_path)
    for records in (first, second):
        (meta,) = [r["run"] for r in records if r["type"] == "run"]
        assert meta["run_id"] == ids["wandb_id"] and meta["display_name"] == "exp"
        assert meta["config"]["update"]["bank"]["redis_url"] == "**********"
        assert SECRET not in json.dumps(records)
    history = {}
    for r in first + second:
        if r["type"] == "history":
            history.setdefault(r["history"]["step"]["num"], {}).update(r["history"]["item"])
    for s, values in expected.items():
        assert {k: history[s][k] for k in values} == pytest.approx(values, rel=1e-12)
    assert history[2]["videos/train._type"] == "video-file"

    # MLflow: one run, every metric at its step, the video as an artifact, params masked
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    run = client.get_run(ids["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["bank.redis_url"] == "**********"
    for key in expected[1]:
        got = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        assert got == pytest.approx({s: v[key] for s, v in expected.items()}, rel=1e-12)
    (art,) = client.list_artifacts(run.info.run_id, "videos/train")
    assert art.path.endswith("v.gif")


def test_a_broken_backend_is_dropped_and_the_others_go_on(tmp_path):
    class Broken:
        name = "broken"

        closed: list = []

        def metrics(self, values, step):
            raise ConnectionError("server gone")

        def close(self, state):
            self.closed.append(state)

    class Keeps:
        name = "keeps"
        seen: list = []

        def metrics(self, values, step):
            self.seen.append((step, values))

    tracker = Tracker([Broken(), Keeps()])
    tracker.metrics({"step": 1, "loss": 0.5})
    tracker.metrics({"step": 2, "loss": 0.25})
    assert [type(b).__name__ for b in tracker.backends] == ["Keeps"]
    assert Broken.closed == ["failed"]
    assert Keeps.seen == [(1, {"loss": 0.5}), (2, {"loss": 0.25})]


TRACKER_MODULES = {"wandb", "tensorboard", "mlflow", "tensorboardX", "torch.utils.tensorboard", "cluster.runs.tracking",
                   "cluster.runs.trackers"}


def test_only_the_driver_imports_a_tracker():
    """Actor code (rollout, reward, learner, bank, common) never imports a tracker package."""
    offenders = []
    for pkg in ("rollout_worker", "reward_worker", "learner", "memory_bank", "common"):
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names
                              if any(n == m or n.startswith(m + ".") for m in TRACKER_MODULES)]
    assert offenders == []


def test_step_videos_follow_video_every_and_never_stop_the_run(tmp_path, monkeypatch):
    """Every log.video_every steps one tiled video of the fixed pairs; a failed sampling is skipped."""
    import types

    import torch

    import cluster.evaluation.run_eval
    from cluster.evaluation.run_eval import step_videos
    from cluster.runs.run_dir import RunDir

    cfg = load_config(None, [f"run.root={tmp_path}", "run.name=v", "log.video_every=2", "log.video_pairs=3"])
    asked = []

    def sample_pairs(rollouts, evals):
        asked.append(evals.pairs)
        if rollouts == "restarting":
            raise RuntimeError("actor restarting")
        return torch.zeros(len(evals), 2, 16, 16, 3, dtype=torch.uint8)

    monkeypatch.setattr(cluster.evaluation.run_eval, "sample_pairs", sample_pairs)
    driver = types.SimpleNamespace(cfg=cfg, run_dir=RunDir.create(cfg), rollouts=[], step=0)
    for step in (1, 2, 3, 4):
        driver.step = step
        step_videos(driver.cfg, driver.step, driver.rollouts, driver.run_dir)
    driver.rollouts, driver.step = "restarting", 6
    step_videos(driver.cfg, driver.step, driver.rollouts, driver.run_dir)  # logs a warning, raises nothing
    videos = sorted(p.name for p in (driver.run_dir.samples / "videos").iterdir())
    assert videos == ["videos_train_step000002.gif", "videos_train_step000004.gif"]
    from cluster.data.prompts import load_prompts
    from common.toyworld import eval_seeds

    first_seed = eval_seeds(cfg.train.eval_seeds)[0]  # three prompts at their first seed
    assert asked == [[(c.prompt, first_seed) for c in load_prompts(cfg.train.eval_prompts)[:3]]] * 3


def test_a_backend_that_cannot_start_fails_in_one_line_and_closes_the_others(tmp_path, monkeypatch):
    import cluster.runs.trackers

    closed = []

    class Opens:
        name = "tensorboard"

        def __init__(self, *a):
            pass

        def close(self, state):
            closed.append(state)

    class NoLogin:
        def __init__(self, *a):
            raise PermissionError("api_key not configured (no-tty)\nsecond line")

    monkeypatch.setattr(cluster.runs.trackers, "BACKENDS", {"tensorboard": Opens, "wandb": NoLogin})
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    with pytest.raises(ConfigError) as e:
        Tracker.open(load_config(None, ["log.backends=[tensorboard,wandb]"]), tmp_path)
    assert str(e.value) == ("log.backends: wandb could not start (PermissionError: api_key not configured "
                            "(no-tty)); fix that or drop 'wandb' from log.backends")
    assert closed == ["failed"]


@pytest.mark.parametrize("override, field", [("log.video_every=-1", "log.video_every"),
                                             ("log.backends=[jsonl,comet]", "log.backends.1"),
                                             ("log.wandb.mode=cloud", "log.wandb.mode")])
def test_log_config_rejects_bad_values_naming_the_field(override, field):
    with pytest.raises(ConfigError, match=f"^config: {field}"):
        load_config(None, [override])


def test_jsonl_is_implied_and_trackers_listed_once():
    cfg = load_config(None, ["log.backends=[wandb,tensorboard,wandb]"])
    assert cfg.log.trackers == ["wandb", "tensorboard"]
    assert load_config(None, []).log.trackers == []
