"""SIGKILL of the driver: the embedded redis-server holding the bank, the 0600 file holding its
password and the processes of the local Ray cluster it started die with it
(cluster/driver/watchdog.py), never another Ray's; and the status.json it left saying `running`
is recognised as stale by `vgrpo runs` and `vgrpo resume`."""

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

from memory_bank.embedded import find_redis_server

SERVER = os.path.realpath(find_redis_server()[0])   # the binary the embedded server runs

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


def _descendants(pid: int) -> set[int]:
    out, todo = set(), [pid]
    while todo:
        for c in _children(todo.pop()):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def _naming(tmp: Path) -> set[int]:
    """Live processes whose command line names `tmp` (this one aside)."""
    out = set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if str(tmp).encode() in (proc / "cmdline").read_bytes() and int(proc.name) != os.getpid():
                out.add(int(proc.name))
        except OSError:
            continue
    return {p for p in out if not _gone(p)}


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


RESTARTED = """
import sys, time
from pathlib import Path
from common.config import load_config
from cluster.driver.driver import Driver
from cluster.runs.run_dir import RunDir
from memory_bank.embedded import EmbeddedRedis

cfg = load_config("configs/quickstart.yaml", [f"run.root={sys.argv[1]}", "run.name=r"])
driver = Driver(cfg, RunDir.create(cfg))
driver.started.redis = EmbeddedRedis(data_dir=Path(sys.argv[1]) / "redis").start()
driver._guard()                          # what setup does once the bank is up
first = driver.started.redis.pid
driver.started.redis.restart()           # a new redis-server process, after the watchdog was told
print(first, driver.started.redis.pid, flush=True)
time.sleep(600)
"""


def test_the_watchdog_follows_a_restart_of_the_embedded_redis(tmp_path):
    """EmbeddedRedis.restart() launches a new redis-server: the driver's watchdog is told of it
    too (EmbeddedRedis.on_start), so a SIGKILLed driver leaves no restarted server behind."""
    child = subprocess.Popen([sys.executable, "-c", RESTARTED, str(tmp_path)], cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True)
    second = None
    try:
        first, second = map(int, child.stdout.readline().split())
        assert first != second and _gone(first) and not _gone(second)
        assert _exe(second) == SERVER
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
        assert when(lambda: _gone(second), 15), "the restarted redis-server outlived its driver"
    finally:
        child.kill()
        if second is not None and not _gone(second):
            os.kill(second, signal.SIGKILL)


def test_sigkill_of_vgrpo_train_takes_its_redis_and_password_file_along(tmp_path):
    """The real driver, SIGKILLed mid-run: no redis-server of it left, no URL file; `vgrpo runs`
    and `vgrpo resume` read its status.json as stale, not running."""
    from cluster.cli.runs_cmd import describe
    from cluster.driver.saved_state import check_saved_state
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
            return bool([c for c in _children(driver.pid) if _exe(c) == SERVER]) \
                and any(tmp.glob("vgrpo-bank-*/redis_url")) and any((run / "checkpoints").glob("step_*"))
        assert when(started, 400, poll_s=0.5), "the run did not reach its first checkpoint"
        redis = [c for c in _children(driver.pid) if _exe(c) == SERVER]
        secret = next(tmp.glob("vgrpo-bank-*"))
        started = _descendants(driver.pid)  # Ray's gcs_server, raylet, agents, workers; redis; the watchdog
        assert len(started) > 5 and _naming(tmp), started
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=10)
        assert when(lambda: all(map(_gone, redis)), 20), "the embedded redis-server outlived the driver"
        assert when(lambda: not secret.exists(), 5), "the Redis password file outlived the driver"
        # the local Ray cluster it started: SIGTERM, SIGKILL after the watchdog's 5 s grace
        assert when(lambda: all(map(_gone, started)), 30), \
            [(p, Path(f"/proc/{p}/cmdline").read_bytes()[:80]) for p in started if not _gone(p)]
        assert not _naming(tmp), "processes naming the run's TMPDIR outlived the driver"
        assert describe(run)["status"] == "stopped"
        rd = RunDir.open(run)
        notes = check_saved_state(rd, sorted((run / "checkpoints").glob("step_*"))[-1], load_config(run / "config.yaml"))
        assert any(f"pid {driver.pid}" in n and "ended without saying why" in n for n in notes), notes
    finally:
        driver.kill()
        _end_what_it_left(tmp)
        shutil.rmtree(tmp, ignore_errors=True)


def _end_what_it_left(tmp: Path) -> None:
    """Cleanup after a failed assert: the Ray processes the killed driver started (their command
    lines name its TMPDIR), by pid."""
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


HOLDER = """
import os, signal, sys, time
if sys.argv[1:] == ["stubborn"]:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)   # an agent stuck in a call: SIGKILL after the grace
log = open(os.environ["LOG"], "a")                  # named by no argument, as Ray's retitled `ray::…` agents
print("ready", flush=True)
time.sleep(600)
"""


def _holder(log: Path, *args: str) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    p = subprocess.Popen([sys.executable, "-c", HOLDER, *args], env={**os.environ, "LOG": str(log)},
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def _named(arg: str) -> subprocess.Popen:
    """A process whose command line names the dir (as Ray's gcs_server and raylet do)."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", arg])


def test_the_watchdog_ends_the_ray_session_it_was_told_of_and_no_other(tmp_path):
    """At EOF every process whose command line or open files name the session dir gets SIGTERM,
    then SIGKILL; another session's processes (a name that merely starts the same) are left alone."""
    from cluster.driver.watchdog import Watchdog

    mine, other = tmp_path / "ray/session_1_2", tmp_path / "ray/session_1_23"
    ours = [_holder(mine / "logs/agent.log"), _holder(mine / "logs/stuck.log", "stubborn"),
            _named(f"--session-dir={mine}")]
    theirs = [_holder(other / "logs/agent.log"), _named(f"--log_dir={other}/logs")]
    try:
        dog = Watchdog.start()
        dog.end_ray_session(mine)
        dog.proc.stdin.close()        # EOF without `done`: what the driver's death leaves
        assert dog.proc.wait(timeout=30) == 0
        for p in ours:
            assert p.wait(timeout=5) in (-signal.SIGTERM, -signal.SIGKILL)
        assert ours[1].returncode == -signal.SIGKILL   # it ignored SIGTERM: killed after the grace
        assert ours[0].returncode == -signal.SIGTERM
        assert all(p.poll() is None for p in theirs), "another Ray session's processes were hit"
    finally:
        for p in ours + theirs:
            p.kill()
            p.wait()


def test_a_joined_or_found_ray_cluster_is_never_given_to_the_watchdog(tmp_path, monkeypatch):
    """Only a local cluster this driver started has an own_session; a joined cluster's (or one
    already running in the process) is never told to the watchdog, so its processes are never hit."""
    from cluster.driver import watchdog
    from cluster.driver.driver import Driver
    from cluster.driver.pools import RayHandle
    from cluster.runs.run_dir import RunDir
    from common.config import load_config

    assert RayHandle(started_here=True, session_dir="/tmp/ray/session_1").own_session == "/tmp/ray/session_1"
    assert RayHandle(started_here=False, joined=True, session_dir="/tmp/ray/session_1").own_session is None
    assert RayHandle(started_here=False, session_dir="/tmp/ray/session_1").own_session is None

    told: list[str] = []

    class Recorder:  # records what the driver tells its watchdog (a unit test: no process started)
        def end_ray_session(self, d): told.append(f"ray {d}")
        def kill_with_me(self, pid): told.append(f"pid {pid}")
        def remove_with_me(self, p): told.append(f"path {p}")

    monkeypatch.setattr(watchdog.Watchdog, "start", classmethod(lambda cls: Recorder()))
    cfg = load_config(ROOT / "configs/quickstart.yaml", [f"run.root={tmp_path}", "run.name=g"])
    for handle, want in ((RayHandle(started_here=False, joined=True, session_dir="/tmp/ray/session_9"), []),
                         (RayHandle(started_here=True, session_dir="/tmp/ray/session_9"), ["ray /tmp/ray/session_9"])):
        told.clear()
        d = Driver(cfg, RunDir.create(cfg) if not (tmp_path / "g").exists() else RunDir.open(tmp_path / "g"))
        d.started.ray, d.started.secret_dir = handle, tmp_path / "secret"
        d._guard()
        assert [t for t in told if t.startswith("ray")] == want
        assert f"path {tmp_path / 'secret'}" in told
