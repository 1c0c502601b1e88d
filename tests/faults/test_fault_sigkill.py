"""SIGKILL of the driver: the embedded redis-server holding the bank and the 0600 file holding
its password die with it (cluster/driver/watchdog.py), and the status.json it left saying
`running` is recognised as stale by `vgrpo runs` and `vgrpo resume`."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from fault_helpers import ROOT, when

pytestmark = pytest.mark.timeout(600)


def _gone(pid: int) -> bool:
    """Ended (a zombie no one reaps counts: it holds no port, memory or data)."""
    try:
        state = Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0]
    except (FileNotFoundError, IndexError):
        return True
    return state in ("Z", "X")


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def _exe(pid: int) -> str:
    """The program a process runs (its argv is no guide: redis-server rewrites its own)."""
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return ""


CHILD = """
import sys, time
from common.config import BankConfig
from memory_bank.embedded import EmbeddedRedis
from memory_bank.ref import make_ref
from cluster.driver.watchdog import Watchdog

redis = EmbeddedRedis(data_dir=sys.argv[1]).start()
ref, secret = make_ref(BankConfig(), redis.url.get_secret_value(), secret_dir=sys.argv[2])
dog = Watchdog.start()
dog.kill_with_me(redis.pid)
dog.remove_with_me(secret)
print(redis.pid, secret, flush=True)
time.sleep(600)
"""


def test_the_watchdog_stops_redis_and_deletes_the_url_file_when_its_owner_is_sigkilled(tmp_path):
    (tmp_path / "secret").mkdir()
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path / "redis"), str(tmp_path / "secret")],
                             cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True)
    try:
        pid, secret = child.stdout.readline().split()
        pid = int(pid)
        assert not _gone(pid) and Path(secret, "redis_url").is_file()
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
        assert when(lambda: _gone(pid), 15), "the redis-server outlived its owner"
        assert when(lambda: not Path(secret).exists(), 5), "the password file outlived its owner"
    finally:
        child.kill()


def test_sigkill_of_vgrpo_train_takes_its_redis_and_password_file_along(tmp_path):
    """The real driver, SIGKILLed mid-run: no redis-server of it left, no URL file; `vgrpo runs`
    and `vgrpo resume` read its status.json as stale, not running."""
    from cluster.cli.runs_cmd import describe
    from cluster.cli.train_cmd import check_saved_state
    from cluster.runs.run_dir import RunDir
    from common.config import load_config

    tmp = Path(tempfile.mkdtemp(prefix="vk", dir="/tmp"))  # short: Ray's unix sockets live under it
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp)}
    driver = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "train", "-c", "configs/quickstart.yaml", "--no-eval",
         f"run.root={tmp_path}", "run.name=killed", "train.steps=500", "train.checkpoint_every=1",
         "health.enabled=false"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run = tmp_path / "killed"
    try:
        def started() -> bool:
            return bool([c for c in _children(driver.pid) if _exe(c).endswith("redis-server")]) \
                and any(tmp.glob("vgrpo-bank-*/redis_url")) and any((run / "checkpoints").glob("step_*"))
        assert when(started, 400, poll_s=0.5), "the run did not reach its first checkpoint"
        redis = [c for c in _children(driver.pid) if _exe(c).endswith("redis-server")]
        secret = next(tmp.glob("vgrpo-bank-*"))
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=10)
        assert when(lambda: all(map(_gone, redis)), 20), "the embedded redis-server outlived the driver"
        assert when(lambda: not secret.exists(), 5), "the Redis password file outlived the driver"
        assert describe(run)["status"] == "stopped"
        rd = RunDir.open(run)
        notes = check_saved_state(rd, sorted((run / "checkpoints").glob("step_*"))[-1], load_config(run / "config.yaml"))
        assert any(f"pid {driver.pid}" in n and "ended without saying why" in n for n in notes), notes
    finally:
        driver.kill()
        _end_what_it_left(tmp)
        shutil.rmtree(tmp, ignore_errors=True)


def _end_what_it_left(tmp: Path) -> None:
    """The Ray processes the killed driver started (their command lines name its TMPDIR), by pid."""
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if str(tmp).encode() in cmd and int(proc.name) != os.getpid():
            try:
                os.kill(int(proc.name), signal.SIGKILL)
            except ProcessLookupError:
                pass
    time.sleep(1)
