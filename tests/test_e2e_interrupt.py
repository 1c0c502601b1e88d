"""Ctrl-C, and SIGTERM (what Kubernetes sends before it evicts a pod), finish the current step,
write a checkpoint, and stop what the run started."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memory_bank.embedded import find_redis_server

ROOT = Path(__file__).resolve().parents[1]


def _children(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    tree: dict[int, list[int]] = {}
    for line in out.splitlines():
        p, pp = map(int, line.split())
        tree.setdefault(pp, []).append(p)
    seen, todo = set(), [pid]
    while todo:
        for c in tree.get(todo.pop(), []):
            if c not in seen:
                seen.add(c)
                todo.append(c)
    return seen


@pytest.mark.parametrize("sig, code, name", [(signal.SIGINT, 130, "Ctrl-C"), (signal.SIGTERM, 143, "SIGTERM")])
def test_a_stop_signal_checkpoints_and_stops_ray_and_redis(tmp_path, sig, code, name):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "train", "--no-eval", "-c", "configs/quickstart.yaml",
         "train.steps=200", "train.mode=sync", "train.groups_per_step=2", "sampler.group_size=4",
         f"run.root={tmp_path}", "run.name=int"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = tmp_path / "int" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text().strip()):
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.5)
    assert metrics.exists(), "no step finished in 300 s"
    started = _children(proc.pid)
    server = os.path.realpath(find_redis_server()[0])      # the embedded server's binary
    assert any(os.path.realpath(f"/proc/{p}/exe") == server for p in started
               if Path(f"/proc/{p}/exe").exists())
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == code, out[-3000:]
    assert "vgrpo resume" in out
    steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) < 200
    ckpts = sorted((tmp_path / "int" / "checkpoints").glob("step_*"))
    assert ckpts and ckpts[-1].name == f"step_{steps[-1]:08d}"  # the step it finished was saved
    status = json.loads((tmp_path / "int" / "status.json").read_text())  # what `vgrpo runs` reports
    assert (status["state"], status["reason"]) == ("stopped", f"interrupted ({name}) at step {steps[-1]}")
    alive = _wait_gone(started, timeout_s=30)
    assert not alive, f"processes left behind: {alive}"


def _wait_gone(pids: set[int], timeout_s: float) -> list[int]:
    """The pids still alive once each has exited or `timeout_s` passed (Ray's workers exit on
    their own once the driver's cluster is gone; a pid that is a zombie counts as gone)."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [p for p in pids if _alive(p)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"
