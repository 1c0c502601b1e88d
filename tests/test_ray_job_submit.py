"""`ray job submit --working-dir . -- vgrpo train …` against a `ray start --head` cluster.

The head runs in its own process group with its own temp dir, and is ended by signalling that
group (never `ray stop`, which would also end the test session's shared Ray instance).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def ray_head_home(tmp_path):
    """A head whose processes (the job's entrypoint among them) have HOME in the test's tmp_path."""
    home = tmp_path / "home"
    home.mkdir()
    # the token is given, not read from ~/.ray: the head's HOME is not the client's
    for address, env in _head(tmp_path, {"HOME": str(home)}, {"RAY_AUTH_TOKEN": secrets.token_hex(16)}):
        yield address, env, home


def _head(tmp_path, head_only: dict, both: dict):
    port, dash = _free_port(), _free_port()
    # the session's own Ray instance holds the default agent ports: give this head its own
    agent_ports = [f"--{name}={_free_port()}" for name in (
        "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "runtime-env-agent-port",
        "metrics-export-port", "ray-client-server-port")]
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "RAY_AUTH_MODE": "token", **both}
    # the head's own SIGTERM handler would first drain the node for Serve, 30 s by default
    head_env = {**env, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0", **head_only}
    temp = tempfile.mkdtemp(prefix="vrj", dir="/tmp")  # short: Ray's socket paths have a length limit
    head = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", f"--port={port}", f"--dashboard-port={dash}",
         "--dashboard-host=127.0.0.1", "--num-cpus=2", f"--temp-dir={temp}", *agent_ports,
         '--resources={"rollout": 1, "reward": 1, "learner": 1}'],
        env=head_env, stdout=open(tmp_path / "head.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{dash}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        probe = subprocess.run([str(BIN / "ray"), "job", "list", "--address", address], env=env,
                               capture_output=True, text=True, timeout=60)
        if probe.returncode == 0:
            break
        if head.poll() is not None:
            pytest.fail(f"ray start --head exited: {(tmp_path / 'head.log').read_text()[-2000:]}")
        time.sleep(2)
    else:
        pytest.fail("the Ray head's job server did not come up in 120 s")
    yield address, env
    os.killpg(head.pid, signal.SIGTERM)
    try:
        head.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(head.pid, signal.SIGKILL)


def test_the_readme_line_trains_two_steps_and_keeps_a_relative_run_root_where_its_first_line_says(ray_head_home):
    """README's `ray job submit --working-dir . -- vgrpo train -c CONFIG`, as written (run.root is the
    default, relative): the run directory does not land in Ray's per-job copy of the working
    directory, which Ray deletes, but where the entrypoint's first line says; and the rollout
    actors' constructor arguments are plain data (no handle Ray keeps in its object store).

    One head, one job: the same submission proves that the job trains its two steps (the job
    succeeds, metrics.jsonl holds steps 1 and 2, summary.json is written); an absolute run.root
    under a job is left alone (tests/test_cluster_preflight.py)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "`ray job submit --working-dir . -- vgrpo train -c " in readme  # the line this test runs
    address, env, home = ray_head_home
    cmd = [str(BIN / "ray"), "job", "submit", "--address", address, "--working-dir", str(ROOT), "--",
           "vgrpo", "train", "-c", "configs/quickstart.yaml", "train.steps=2", "train.eval_seeds=2", "run.name=job"]
    for _ in range(20):  # the job agent may come up a little after the job server answers
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if "No available agent" not in res.stdout + res.stderr:
            break
        time.sleep(3)
    out = res.stdout + res.stderr
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert "succeeded" in out
    lines = res.stdout.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("Running entrypoint for job"))
    first = next(ln for ln in lines[start + 1:] if ln.strip())  # the entrypoint's own first line
    runs = home / "runs"
    assert first.startswith("vgrpo: run.root = 'runs' is relative and this is a Ray job") and \
        f"runs go to {runs} (under $HOME)" in first, first
    rows = [json.loads(x) for x in (runs / "job" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert (runs / "job" / "summary.json").is_file()
    assert "constructor arguments in the object store" not in out, out[-4000:]
