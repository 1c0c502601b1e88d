"""The run directory: resolved config, metrics.jsonl, the reward-curve PNG, samples, checkpoints,
and status.json (running, finished or stopped and why, with the wall time of each session).

A run lives at a local path or at an object-store URI (`run.root: s3://bucket/prefix`). For a URI
the driver writes its own files into a local staging folder (`path`, under $VGRPO_CACHE_DIR or
~/.cache/vgrpo) and `sync()` mirrors them to `location` (each file one PUT), at every logged step
and status change; the learner writes checkpoints straight to `location/checkpoints`, where a step
is listed only once complete (learner/checkpoint.py). Trackers, the embedded Redis and the media
writers keep working on local files.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np

from cluster.runs.tracking import Tracker
from common import storage
from common.config import ConfigError, RunConfig, save_config
from common.errors import UserError
from common.processes import pid_alive


class RunFileError(UserError, ValueError):
    """A run directory's own file (metrics.jsonl, status.json) is damaged; the message names it."""


LOCAL_ONLY = ("redis", "checkpoints")   # never mirrored: Redis' own files; the learner writes the other


def staging_dir(uri: str) -> Path:
    """The local folder that mirrors run `uri`: the same for the same URI (a resume on this
    machine finds its files), under $VGRPO_CACHE_DIR (default ~/.cache/vgrpo)."""
    root = Path(os.environ.get("VGRPO_CACHE_DIR") or Path.home() / ".cache" / "vgrpo")
    scheme, _, rest = uri.rstrip("/").partition("://")
    tag = hashlib.sha256(uri.rstrip("/").encode()).hexdigest()[:8]  # two URIs never share one
    return root / "runs" / scheme / f"{rest.replace('/', '_')[-120:]}-{tag}"


class RunDir:
    def __init__(self, path: Path, location: str | os.PathLike | None = None):
        """`path`: the local folder; `location`: where the run lives when that is a URI."""
        self.path = Path(path)
        self.location = storage.location(location) if location is not None else self.path
        self.remote = storage.is_uri(self.location)
        self.checkpoints = self.location / "checkpoints"
        self.samples = self.path / "samples"
        self.metrics_file = self.path / "metrics.jsonl"
        self.curve_file = self.path / "reward_curve.png"
        self.status_file = self.path / "status.json"
        self.summary_file = self.path / "summary.json"
        self.tracker = None  # cluster.runs.tracking.Tracker, attached by `vgrpo train` in the driver
        self.video_fps = 4.0
        self._sent: dict[str, tuple[int, int]] = {}

    @classmethod
    def create(cls, cfg: RunConfig) -> RunDir:
        name = cfg.run.name or time.strftime("%Y%m%d-%H%M%S")
        root = storage.location(cfg.run.root)
        where = root / name
        n = 1
        while _in_use(where):  # never mix two runs: quickstart-2, -3, …
            n += 1
            where = root / f"{name}-{n}"
        if storage.is_uri(where):
            local = staging_dir(where)
            shutil.rmtree(local, ignore_errors=True)  # a staging copy of a run no longer there
            rd = cls(local, where)
        else:
            rd = cls(where)
        rd.path.mkdir(parents=True, exist_ok=True)
        if not rd.remote:
            rd.checkpoints.mkdir(exist_ok=True)
        rd.samples.mkdir(exist_ok=True)
        rd.video_fps = cfg.log.video_fps
        save_config(cfg, rd.path / "config.yaml")
        try:
            rd.sync()
        except Exception as e:  # the first write to the store: no bucket, no credentials, no access
            shutil.rmtree(rd.path, ignore_errors=True)
            raise ConfigError(f"run.root {cfg.run.root}: cannot write {rd.location} ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}); check that the bucket exists and "
                              "the credentials (AWS_* variables, or the pod's identity) may write to it") from None
        return rd

    @classmethod
    def open(cls, where: str | os.PathLike) -> RunDir:
        """An existing run: a local folder, or a URI whose files are brought into staging."""
        if not storage.is_uri(where):
            return cls(Path(where))
        rd = cls(staging_dir(str(where)), where)
        shutil.rmtree(rd.path, ignore_errors=True)  # the object store's copy is the run
        rd._sent = storage.pull_tree(rd.location, rd.path, skip=LOCAL_ONLY)
        return rd

    def sync(self) -> None:
        """Mirror the staging folder's changed files to the object store (local runs: nothing)."""
        if self.remote:
            self._sent = storage.push_tree(self.path, self.location, LOCAL_ONLY, self._sent)

    def remove(self) -> None:
        """Delete the run (a new run that failed before its first checkpoint)."""
        if self.remote:
            storage.remove(self.location)
        shutil.rmtree(self.path, ignore_errors=True)

    def has_checkpoint(self) -> bool:
        return any(self.checkpoints.glob("step_*")) if self.checkpoints.is_dir() else False

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
        self.sync()

    def log_video(self, tag: str, frames, step: int) -> Path:
        """uint8 [F, H, W, 3] → samples/videos/<tag>_step<step>.gif, and a video in each tracker."""
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
            if sessions and sessions[-1][1] is None:  # a session killed without closing it (stale)
                sessions[-1][1] = max(sessions[-1][0], status.get("updated") or sessions[-1][0])
            sessions.append([now, None])
            status.update(pid=os.getpid(), host=socket.gethostname())
        elif sessions and sessions[-1][1] is None:
            sessions[-1][1] = now
        status.update(state=state, reason=reason, sessions=sessions, updated=now)
        tmp = self.status_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(status, indent=2))
        tmp.replace(self.status_file)
        self.sync()

    def read_metrics(self) -> list[dict[str, Any]]:
        return self.metrics_rows()[0]

    def metrics_rows(self) -> tuple[list[dict[str, Any]], str | None]:
        """(rows, note). A torn last line (what a kill or a full disk leaves) is dropped, and the
        note says so; a damaged line before it is a RunFileError naming the file and the line."""
        if not self.metrics_file.exists():
            return [], None
        lines = self.metrics_file.read_text(encoding="utf-8", errors="replace").splitlines()
        rows, last = [], max((i for i, line in enumerate(lines) if line.strip()), default=-1)
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if not isinstance(row, dict) or not isinstance(row.get("step", 0), int):
                    raise ValueError("not a step record")
            except ValueError as e:
                if i == last:
                    return rows, (f"{self.metrics_file}: dropped its torn last line ({len(line)} characters, "
                                  "what a kill or a full disk leaves)")
                raise RunFileError(f"{self.metrics_file}: line {i + 1} is damaged ({str(e)[:80]}); "
                                   "remove that line, or move the file aside to resume without the curve so far") from None
            rows.append(row)
        return rows, None

    def truncate_metrics(self, after_step: int) -> str | None:
        """On resume: drop lines past the checkpoint's step so the curve has no duplicate steps
        (and a torn last line); returns the note about a torn line, if there was one."""
        rows, note = self.metrics_rows()
        keep = [r for r in rows if r.get("step", 0) <= after_step]
        self.metrics_file.write_text("".join(json.dumps(r) + "\n" for r in keep))
        return note

    def plot_rewards(self, heads: list[str]) -> Path:
        """Reward per step (composite and heads), with a moving average; rewritten as the run goes."""
        # not pyplot: its global figure list is not thread-safe, and `vgrpo compare --parallel`
        # plots from several threads
        from matplotlib.figure import Figure  # lazy: matplotlib (kept out of vgrpo --help)

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


def is_stale(status: dict[str, Any]) -> bool:
    """A `running` status whose process on this host is gone (SIGKILL, OOM, a power cut)."""
    pid = status.get("pid")
    return (status.get("state") == "running" and status.get("host") == socket.gethostname()
            and isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 and not pid_alive(pid))


def _in_use(where) -> bool:
    """Whether a run (or anything) is already at `where`."""
    if storage.is_uri(where):
        return where.is_dir() and any(True for _ in where.iterdir())
    return where.exists() and any(where.iterdir())
