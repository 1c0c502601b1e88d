"""The run directory: resolved config, metrics.jsonl, the reward-curve PNG, samples, checkpoints,
and status.json (running, finished or stopped and why, with the wall time of each session)."""

from __future__ import annotations

import json
import math
import os
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np

from common.config import RunConfig, save_config


class RunDir:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.checkpoints = self.path / "checkpoints"
        self.samples = self.path / "samples"
        self.metrics_file = self.path / "metrics.jsonl"
        self.curve_file = self.path / "reward_curve.png"
        self.status_file = self.path / "status.json"
        self.summary_file = self.path / "summary.json"
        self.tracker = None  # cluster.runs.tracking.Tracker, attached by `vgrpo train` in the driver
        self.video_fps = 4.0

    @classmethod
    def create(cls, cfg: RunConfig) -> RunDir:
        name = cfg.run.name or time.strftime("%Y%m%d-%H%M%S")
        path = Path(cfg.run.root) / name
        n = 1
        while path.exists() and any(path.iterdir()):  # never mix two runs: quickstart-2, -3, …
            n += 1
            path = Path(cfg.run.root) / f"{name}-{n}"
        path.mkdir(parents=True, exist_ok=True)
        rd = cls(path)
        rd.checkpoints.mkdir(exist_ok=True)
        rd.samples.mkdir(exist_ok=True)
        rd.video_fps = cfg.log.video_fps
        save_config(cfg, rd.path / "config.yaml")
        return rd

    def attach(self, tracker) -> None:
        """Send what is logged here to experiment trackers as well (driver process only)."""
        self.tracker = tracker

    def log(self, record: dict[str, Any]) -> None:
        """Append one line to metrics.jsonl (non-finite floats as null, so the file stays JSON),
        and send the row to the attached trackers at its step."""
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with self.metrics_file.open("a", encoding="utf-8") as f:
            f.write(json.dumps(clean) + "\n")
        if self.tracker is not None:
            self.tracker.metrics(record)

    def log_video(self, tag: str, frames, step: int) -> Path:
        """uint8 [F, H, W, 3] → samples/videos/<tag>_step<step>.gif, and a video in each tracker."""
        from cluster.runs.tracking import Tracker

        tracker = self.tracker or Tracker([])
        path = self.samples / "videos" / f"{tag.replace('/', '_')}_step{step:06d}.gif"
        tracker.video(tag, frames, path, step, self.video_fps)
        if tag == "videos/before":
            self._before = frames
        elif tag == "videos/after" and getattr(self, "_before", None) is not None \
                and self._before.shape == frames.shape:
            # the same pairs side by side: before on the left, after on the right
            gap = np.full((*frames.shape[:2], 4, 3), 255, np.uint8)
            both = np.concatenate([self._before, gap, frames], axis=2)
            tracker.video("videos/before_after", both, path.with_name(f"before_after_step{step:06d}.gif"),
                          step, self.video_fps)
        return path

    # --- status: what `vgrpo runs` reports -----------------------------------------------------

    def read_status(self) -> dict[str, Any]:
        try:
            return json.loads(self.status_file.read_text())
        except (OSError, ValueError):
            return {}

    def set_status(self, state: str, reason: str | None = None) -> None:
        """`running` opens a session (pid, host, start time); any other state closes it."""
        status = self.read_status()
        sessions = status.get("sessions", [])
        now = time.time()
        if state == "running":
            sessions.append([now, None])
            status.update(pid=os.getpid(), host=socket.gethostname())
        elif sessions and sessions[-1][1] is None:
            sessions[-1][1] = now
        status.update(state=state, reason=reason, sessions=sessions, updated=now)
        tmp = self.status_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(status, indent=2))
        tmp.replace(self.status_file)

    def read_metrics(self) -> list[dict[str, Any]]:
        if not self.metrics_file.exists():
            return []
        return [json.loads(line) for line in self.metrics_file.read_text().splitlines() if line.strip()]

    def truncate_metrics(self, after_step: int) -> None:
        """On resume: drop lines past the checkpoint's step so the curve has no duplicate steps."""
        keep = [r for r in self.read_metrics() if r.get("step", 0) <= after_step]
        self.metrics_file.write_text("".join(json.dumps(r) + "\n" for r in keep))

    def plot_rewards(self, heads: list[str]) -> Path:
        """Reward per step (composite and heads), with a moving average; rewritten as the run goes."""
        # not pyplot: its global figure list is not thread-safe, and `vgrpo compare --parallel`
        # plots from several threads
        from matplotlib.figure import Figure

        rows = self.read_metrics()
        fig = Figure(figsize=(7, 4))
        ax = fig.subplots()
        steps = [r["step"] for r in rows]
        for key, label in [("reward_mean", "composite")] + [(f"reward/{h}", h) for h in heads]:
            ys = [r.get(key) for r in rows]
            pts = [(s, y) for s, y in zip(steps, ys, strict=True) if y is not None]
            if not pts:
                continue
            xs, vs = zip(*pts, strict=True)
            line, = ax.plot(xs, vs, alpha=0.35, lw=1)
            w = max(1, len(vs) // 10)
            smooth = [sum(vs[max(0, i - w + 1): i + 1]) / len(vs[max(0, i - w + 1): i + 1]) for i in range(len(vs))]
            ax.plot(xs, smooth, color=line.get_color(), lw=2, label=label)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("training reward (rollouts)")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(loc="best", fontsize=8)
        fig.tight_layout()
        tmp = self.curve_file.with_suffix(".tmp.png")
        fig.savefig(tmp, dpi=100)
        tmp.replace(self.curve_file)
        if self.tracker is not None and rows:
            self.tracker.image("reward_curve", self.curve_file, rows[-1]["step"])
        return self.curve_file
