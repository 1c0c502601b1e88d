"""tests/cli_batch.py against real processes: for the same invocations, a batch (one child, a fork
per call) gives each call what `python -m MODULE ARGS` in its own process gives it (exit status,
stdout, stderr), and nothing one call does to its process reaches the next."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from cli_batch import Call, default_env, run_batch

HERE = Path(__file__).resolve().parent
CALLS = [["log", "exit=2"], ["log", "warn", "fd2", "stdout", "exit=2"], ["warn"], ["env"], ["env", "atexit"],
         ["raise"], ["exitmsg"], ["exit=0"], ["exit=7", "warn", "log"], ["stdout"]]


def _real(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli_batch_probe", *args], cwd=HERE, env=env,
                          capture_output=True, text=True, timeout=60)


def test_a_batched_call_sees_and_leaves_what_a_real_process_does():
    env = {k: v for k, v in default_env().items() if k != "PYTHONUNBUFFERED"}  # stdout buffered: flushes matter
    env["X"] = "x"
    got = run_batch([Call(a, cwd=HERE) for a in CALLS], env=env, warmup=[], module="cli_batch_probe")
    for args, out in zip(CALLS, got, strict=True):
        real = _real(args, env)
        assert out.returncode == real.returncode, (args, out, real)
        assert out.stdout == real.stdout, (args, out, real)
        if "raise" in args:  # the frames above the probe differ (runpy called from the fork)
            assert out.stderr.startswith("Traceback") and real.stderr.startswith("Traceback"), (out, real)
            assert out.stderr.splitlines()[-1] == real.stderr.splitlines()[-1] == "RuntimeError: a program error"
        else:
            assert out.stderr == real.stderr, (args, out, real)
        assert not out.ray_initialized
    assert got[3].stdout == f"X=x LEAK=None cwd={HERE} argv0=cli_batch_probe.py\n"  # the call's env and cwd
    assert got[4].stdout == got[3].stdout  # nothing left by the call before (env, cwd)
    assert got[1].stderr.count("a warning through logging") == 2  # one handler added by the call, not two
    assert "a UserWarning" in got[2].stderr and "said at exit" in got[4].stderr


def test_a_call_gets_its_own_env_and_cwd_and_a_hung_call_is_killed(tmp_path):
    env = {**default_env(), "X": "x"}
    shutil.copy(HERE / "cli_batch_probe.py", tmp_path)  # `-m` finds it in the cwd (sys.path[0])
    (tmp_path / "empty").mkdir()
    got = run_batch([Call(["env"], cwd=tmp_path, env={**env, "X": "y"}), Call(["env"], cwd=HERE),
                     Call(["hang"], cwd=HERE), Call(["env"], cwd=tmp_path / "empty")],
                    env=env, warmup=[], module="cli_batch_probe", timeout=3)
    assert got[0].stdout.startswith(f"X=y LEAK=None cwd={tmp_path} "), got[0]
    assert got[1].stdout.startswith(f"X=x LEAK=None cwd={HERE} "), got[1]
    assert got[2].returncode == -9 and "killed after 3s" in got[2].stderr, got[2]
    assert got[3].returncode == 1 and "No module named cli_batch_probe" in got[3].stderr  # as `python -m` there
