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

from cluster.runs.policy_file import has_policy
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


def _first_step_with_its_server(proc, metrics: Path) -> set[int]:
    """Wait (at most 300 s) until the run in `proc` has written its first step; the driver's
    child processes then, among which the embedded server's binary (valkey-server)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text().strip()):
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.5)
    assert metrics.exists(), "no step finished in 300 s"
    started = _children(proc.pid)
    server = os.path.realpath(find_redis_server()[0])
    assert any(os.path.realpath(f"/proc/{p}/exe") == server for p in started
               if Path(f"/proc/{p}/exe").exists())
    return started


# SIGTERM's run starts its own Ray, which teardown must stop with the rest; Ctrl-C's joins the
# session's (the same teardown, less a Ray start): what it started, the server, must go.
@pytest.mark.parametrize("sig, code, name", [pytest.param(signal.SIGINT, 130, "Ctrl-C", marks=pytest.mark.session_ray),
                                             (signal.SIGTERM, 143, "SIGTERM")])
def test_a_stop_signal_checkpoints_and_stops_ray_and_redis(tmp_path, sig, code, name, request):
    joins = request.getfixturevalue("ray_address") if sig == signal.SIGINT else None
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}   # after the fixture: its start sets RAY_AUTH_MODE
    env.pop("RAY_ADDRESS", None)
    if joins:
        env["RAY_ADDRESS"] = joins
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "train", "--no-eval", "-c", "configs/quickstart.yaml",
         "train.steps=200", "train.mode=sync", "train.groups_per_step=2", "sampler.group_size=4",
         f"run.root={tmp_path}", "run.name=int"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = tmp_path / "int" / "metrics.jsonl"
    started = _first_step_with_its_server(proc, metrics)
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


# `vgrpo train` whose checkpoint writer waits once, after the test's first SIGTERM, in the middle
# of the stop's checkpoint (its bank dump is written, the policy and trainer state are not yet)
SLOW_CHECKPOINT = """
import sys, time
from pathlib import Path
import cluster.driver.checkpoint as ck
sent, writing = Path(sys.argv[1]), Path(sys.argv[2])
real = ck.dump_bank
def dump_bank(bank, staged):
    out = real(bank, staged)
    if sent.exists() and not writing.exists():
        writing.write_text("dumped")
        time.sleep(6)
    return out
ck.dump_bank = dump_bank
sys.argv = ["vgrpo", *sys.argv[3:]]
from cluster.cli import main
sys.exit(main())
"""


def test_a_second_sigterm_during_the_stops_checkpoint_is_ignored_until_it_is_written(tmp_path):
    """SIGTERM, then SIGTERM again while the stop's own checkpoint is being written: the driver
    logs and ignores it, the checkpoint is written whole, teardown stops the redis-server, and
    the exit is SIGTERM's 143 (before: the handlers were gone by then and the second SIGTERM
    killed the driver mid-checkpoint, with no teardown)."""
    from learner import checkpoint, dist_checkpoint

    # a Ray of its own, which teardown stops too (off the session's, whose xdist worker is the busier)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT), "COLUMNS": "2000"}
    env.pop("RAY_ADDRESS", None)
    sent, writing = tmp_path / "sent", tmp_path / "writing"
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_CHECKPOINT, str(sent), str(writing), "train", "--no-eval",
         "-c", "configs/quickstart.yaml", "train.steps=200", "train.mode=sync", "train.groups_per_step=2",
         "sampler.group_size=4", "train.checkpoint_every=1000", f"run.root={tmp_path}", "run.name=int2"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = tmp_path / "int2" / "metrics.jsonl"
    started = _first_step_with_its_server(proc, metrics)
    sent.write_text("")
    proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not writing.exists():  # the stop's checkpoint is under way
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.05)
    assert writing.exists(), "the stop's checkpoint never started"
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 143, (proc.returncode, out[-3000:])
    assert "SIGTERM: ignored, the run is writing its last checkpoint" in out, out[-3000:]
    steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    ckpts = checkpoint.list_checkpoints(tmp_path / "int2" / "checkpoints")
    assert ckpts and ckpts[-1].name == f"step_{steps[-1]:08d}", out[-3000:]  # the stop's checkpoint, whole
    assert dist_checkpoint.verify_newest(tmp_path / "int2" / "checkpoints", 1) == ckpts[-1]
    assert has_policy(ckpts[-1]) and (ckpts[-1] / "bank" / "index.json").is_file()
    status = json.loads((tmp_path / "int2" / "status.json").read_text())
    assert (status["state"], status["reason"]) == ("stopped", f"interrupted (SIGTERM) at step {steps[-1]}")
    alive = _wait_gone(started, timeout_s=30)       # teardown ran: the redis-server is gone
    assert not alive, f"processes left behind: {alive}"
