"""The run directory: never mixes two runs; metrics.jsonl and the reward curve."""

from __future__ import annotations

import math

from cluster.runs.run_dir import RunDir
from common.config import load_config


def test_second_run_with_the_same_name_gets_its_own_directory(tmp_path):
    cfg = load_config(None, [f"run.root={tmp_path}", "run.name=qs", "bank.redis_url=redis://:s3cret@h:1/0"])
    first = RunDir.create(cfg)
    first.log({"step": 1, "reward_mean": 1.0})
    second = RunDir.create(cfg)
    assert first.path.name == "qs" and second.path.name == "qs-2"
    assert second.read_metrics() == [] and len(first.read_metrics()) == 1
    assert "s3cret" not in (first.path / "config.yaml").read_text()


def test_metrics_log_truncate_and_plot(tmp_path):
    rd = RunDir.create(load_config(None, [f"run.root={tmp_path}", "run.name=r"]))
    for step in range(1, 7):
        rd.log({"step": step, "reward_mean": step / 10, "reward/VQ": 0.5, "loss": math.nan})
    assert [r["step"] for r in rd.read_metrics()] == [1, 2, 3, 4, 5, 6]
    assert rd.read_metrics()[0]["loss"] is None  # non-finite floats stay valid JSON
    rd.truncate_metrics(4)
    assert [r["step"] for r in rd.read_metrics()] == [1, 2, 3, 4]
    png = rd.plot_rewards(["VQ"])
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 5000
