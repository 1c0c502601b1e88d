"""End to end: `vgrpo train` with TensorBoard and W&B (offline) on, read back with each tool's own
reader. Both hold every metric of every metrics.jsonl row at its step, and the sample videos;
`vgrpo runs` then reports the finished run."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.cli import main

pytest.importorskip("tensorboard")
pytest.importorskip("wandb")

STEPS = 2


def numeric(row: dict) -> dict[str, float]:
    """What a tracker must hold of a metrics.jsonl row (nulls are non-finite values)."""
    return {k: float(v) for k, v in row.items() if k != "step" and isinstance(v, (int, float))
            and not isinstance(v, bool) and math.isfinite(v)}


def wandb_records(run_dir: Path, log: Path | None = None) -> list[dict]:
    """The offline run's transaction log, decoded by wandb's own reader (`wandb leet inspect`)."""
    if log is None:
        (log,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_train_logs_every_metric_and_videos_to_tensorboard_and_wandb(ray_session, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red square moving left\na blue square moving up\n")
    rc = main(["train", "-c", "configs/quickstart.yaml", f"train.prompts={prompts}", "train.mode=sync",
               f"train.steps={STEPS}", "train.groups_per_step=2", "train.eval_seeds=1",
               "sampler.group_size=4", "schedule.steps=6", "optim.micro_batch=8",
               "log.backends=[jsonl,tensorboard,wandb]", "log.video_every=1", "log.video_pairs=2",
               "log.wandb.project=vgrpo-test", "log.wandb.tags=[ci,toy]",
               f"run.root={tmp_path / 'runs'}", "run.name=tracked"])
    assert rc == 0
    run = tmp_path / "runs" / "tracked"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    video_tags = {"videos/before": 0, "videos/train": STEPS, "videos/after": STEPS, "videos/before_after": STEPS}

    # 1. TensorBoard: every metric at its step, the videos as animated GIFs, the reward curve
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    ea.Reload()
    for row in rows:
        for key, value in numeric(row).items():
            got = {e.step: e.value for e in ea.Scalars(key)}
            assert got[row["step"]] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    for tag, last_step in video_tags.items():
        events = ea.Images(tag)
        assert events[-1].step == last_step
        assert events[-1].encoded_image_string[:6] == b"GIF89a"
    assert [e.step for e in ea.Images("videos/train")] == list(range(1, STEPS + 1))
    assert ea.Images("reward_curve")[-1].encoded_image_string[:4] == b"\x89PNG"

    # 2. W&B: the run (name, project, tags, masked config) and its history, read back from .wandb
    records = wandb_records(run)
    (meta,) = [r["run"] for r in records if r["type"] == "run"]
    assert (meta["display_name"], meta["project"], meta["tags"]) == ("tracked", "vgrpo-test", ["ci", "toy"])
    assert meta["config"]["update"]["train"]["steps"] == STEPS
    assert meta["run_id"] == json.loads((run / "trackers.json").read_text())["wandb_id"]
    history: dict[int, dict] = {}
    for r in records:
        if r["type"] == "history":
            history.setdefault(r["history"].get("step", {}).get("num", 0), {}).update(r["history"]["item"])
    for row in rows:
        for key, value in numeric(row).items():
            assert history[row["step"]][key] == pytest.approx(value, rel=1e-9), key
    for tag, step in video_tags.items():
        assert history[step][f"{tag}._type"] == "video-file"
        media = next(run.glob("wandb/offline-run-*/files")) / history[step][f"{tag}.path"]
        assert media.read_bytes()[:6] == b"GIF89a"
    assert history[STEPS]["reward_curve._type"] == "image-file"

    # the before/after picture of the same evaluation pairs (cluster/evaluation/before_after.py)
    assert (run / "before_after.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # 3. the before/after summary: W&B run summary, TensorBoard scalars at the last step
    summary = json.loads((run / "summary.json").read_text())
    wb_summary: dict = {}
    for r in records:
        if r["type"] == "summary":
            wb_summary.update(r["summary"].get("update", {}))
    for when in ("before", "after"):
        value = summary[when]["composite_mean"]
        assert wb_summary[f"{when}/composite_mean"] == pytest.approx(value, rel=1e-9)
        assert ea.Scalars(f"{when}/composite_mean")[-1].value == pytest.approx(value, rel=1e-5)

    # 4. `vgrpo runs` reports it finished, with its last reward and before → after result
    capsys.readouterr()
    assert main(["runs", str(tmp_path / "runs"), "--json"]) == 0
    (listed,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert listed["status"] == "finished" and listed["reason"] is None
    assert (listed["step"], listed["steps"]) == (STEPS, STEPS)
    assert listed["reward"] == rows[-1]["reward_mean"]
    assert (listed["before"], listed["after"]) == (summary["before"]["composite_mean"],
                                                   summary["after"]["composite_mean"])
    assert listed["wall_s"] >= rows[-1]["time_s"]

    # 5. `vgrpo resume` continues the same W&B run (its id kept in the run directory) and TensorBoard
    assert main(["resume", str(run), f"train.steps={STEPS + 1}", "--no-eval"]) == 0
    logs = sorted(run.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(logs) == 2 and len({p.name for p in logs}) == 1  # two sessions of one run id
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == STEPS + 1
    resumed = wandb_records(run, logs[-1])
    assert [r["run"]["run_id"] for r in resumed if r["type"] == "run"] == [meta["run_id"]]
    later = {r["history"]["step"]["num"]: r["history"]["item"] for r in resumed if r["type"] == "history"}
    assert later[STEPS + 1]["reward_mean"] == pytest.approx(last["reward_mean"], rel=1e-9)
    ea = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    ea.Reload()
    assert [e.step for e in ea.Scalars("reward_mean")] == list(range(1, STEPS + 2))
    capsys.readouterr()
    main(["runs", str(tmp_path / "runs"), "--json"])
    assert json.loads(capsys.readouterr().out)["step"] == STEPS + 1
