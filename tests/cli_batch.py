"""Many `python -m cluster.cli ...` runs for the price of one Python start.

A refusal test runs the real CLI in a subprocess to see what a user sees: the exit status, and
every byte written to stdout and stderr (a logging line or a warning is a second stderr line).
Each such subprocess spends seconds importing torch, ray and diffusers. `run_batch` starts ONE
child (this file run as a script) that imports them once and then forks once per invocation: each
fork is a real process of its own, so it starts from the same imported state, and what one
invocation leaves behind (Ray, logging handlers, warning filters and registries, os.environ, the
cwd, signal handlers, atexit callbacks) dies with its fork and cannot leak into the next one.

In each fork, exactly as `python -m cluster.cli ARGS` with that cwd and env would:
  - os.environ is the call's env, the cwd is the call's cwd, sys.argv[0] is cluster/cli/__main__.py
    and sys.path[0] the cwd (what `-m` sets);
  - file descriptors 1 and 2 are dup2'ed onto files before anything runs and stay so until the
    fork exits: whatever the CLI, a logging handler, a warning or C code writes there is captured;
  - cluster/cli/__main__.py itself runs (runpy, as `-m` does): `sys.exit(main())`. The exit status
    is the interpreter's: SystemExit's code (None -> 0, an int, else its text on stderr and 1), or 1
    with the traceback on stderr if an exception escaped; then the atexit callbacks run, the
    streams, the logging handlers and C stdio are flushed, and the fork exits with that status.
  - `ray_initialized` records whether Ray was initialised when main returned, for tests that
    assert the refusal came before Ray; `imported` lists the top-level packages the call imported
    beyond the warm-up ones.

What a batch cannot reproduce of a fresh process, and how it errs:
  - output printed while the warm-up imports (at child start) is printed once, not once per run:
    it is put at the start of EVERY call's stdout/stderr, so a noisy import can only add lines
    (a false failure), never hide one. Modules not in the warm-up are imported in each fork, so
    their import-time output belongs to the call that imports them, as in a fresh process.
  - a variable read once at import time by a warm-up module (e.g. TRANSFORMERS_VERBOSITY) is read
    from the child's start env (`env` of run_batch), not the call's; so is PYTHONPATH (sys.path is
    made when the interpreter starts; only sys.path[0], the cwd, is the call's). Calls that need such a
    variable set differently belong in their own batch, or a standalone subprocess.

Keep at least one genuine `python -m cluster.cli` subprocess per command in a file that batches
the rest, so the real process boundary stays covered.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Imported once by the child before any call: what the CLI's refusals import anyway (seen in
# BatchResult.imported), the seconds of a fresh process. Whatever their import prints is added to
# every call's output.
WARMUP = ["torch", "ray", "safetensors.torch", "diffusers", "transformers", "redis",
          "cluster.cli", "learner", "memory_bank", "rollout_worker"]


@dataclass
class Call:
    """One `python -m cluster.cli *args` run, in cwd (default ROOT) with env (default the batch's)."""

    args: list[str]
    cwd: str | os.PathLike | None = None
    env: dict[str, str] | None = None


@dataclass
class BatchResult(subprocess.CompletedProcess):
    """subprocess.CompletedProcess (args, returncode, stdout, stderr) plus what the fork saw."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str
    ray_initialized: bool = False
    imported: list[str] = field(default_factory=list)
    seconds: float = 0.0


def default_env() -> dict[str, str]:
    """What the fault tests give a `vgrpo` subprocess."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def run_batch(calls: list[Call | list[str] | tuple[str, ...]], env: dict[str, str] | None = None,
              timeout: float = 120, warmup: list[str] | None = None, module: str = "cluster.cli") -> list[BatchResult]:
    """Run every call in one child Python; one BatchResult per call, in order.

    `env`: the child's start env and every call's default (default_env()); `timeout`: seconds for
    EACH call (a call past it is killed: returncode -9 and a note on its stderr); `module`: what
    `python -m` runs (tests/test_cli_batch.py holds the batch to a real process with a probe).
    """
    env = default_env() if env is None else dict(env)
    calls = [c if isinstance(c, Call) else Call(list(c)) for c in calls]
    spec = {"warmup": WARMUP if warmup is None else warmup, "timeout": timeout, "module": module,
            "calls": [{"args": [str(a) for a in c.args], "cwd": str(c.cwd or ROOT),
                       "env": env if c.env is None else {k: str(v) for k, v in c.env.items()}} for c in calls]}
    with tempfile.TemporaryDirectory(prefix="cli_batch_") as tmp:
        (Path(tmp) / "spec.json").write_text(json.dumps(spec))
        proc = subprocess.run([sys.executable, __file__, tmp], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=120 + timeout * len(calls))
        if proc.returncode != 0 or not (Path(tmp) / "results.json").exists():
            raise RuntimeError(f"cli_batch child failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        results = json.loads((Path(tmp) / "results.json").read_text())
        warm = {n: _text(Path(tmp) / f"warmup.{n}") for n in ("out", "err")}
        return [BatchResult(c["args"], r["returncode"], warm["out"] + _text(Path(tmp) / f"{i}.out"),
                            warm["err"] + _text(Path(tmp) / f"{i}.err"), r["ray_initialized"], r["imported"], r["seconds"])
                for i, (c, r) in enumerate(zip(spec["calls"], results, strict=True))]


def _text(path: Path) -> str:
    """Bytes as subprocess.run(text=True) decodes them: locale encoding, universal newlines."""
    import locale

    data = path.read_bytes().decode(locale.getpreferredencoding(False))
    return data.replace("\r\n", "\n").replace("\r", "\n")


# --- the child -------------------------------------------------------------------------------------

def _flush_all() -> None:
    import ctypes
    import logging

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        for handler in getattr(logger, "handlers", []):
            try:
                handler.flush()
            except Exception:
                pass
    ctypes.CDLL(None).fflush(None)  # C stdio buffers (printf from a C extension)


def _redirect(out: Path, err: Path) -> None:
    _flush_all()
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)


def _run_one(call: dict, module: str, tmp: Path, i: int) -> None:
    """In the fork: become `python -m MODULE ARGS` in the call's cwd and env, then exit."""
    import atexit
    import runpy
    import traceback

    _redirect(tmp / f"{i}.out", tmp / f"{i}.err")
    code: object = 0
    before = {m.split(".")[0] for m in sys.modules}
    ray_on = False
    try:
        os.chdir(call["cwd"])
        os.environ.clear()
        os.environ.update(call["env"])
        sys.argv = ["-m", *call["args"]]  # runpy puts the module's file in sys.argv[0], as `-m` does
        sys.path[0] = os.getcwd()
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code
        except BaseException:  # what the interpreter does with an uncaught exception
            traceback.print_exc()
            code = 1
        ray = sys.modules.get("ray")
        ray_on = bool(ray is not None and ray.is_initialized())
        if code is None:
            code = 0
        elif not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
        imported = sorted({m.split(".")[0] for m in sys.modules} - before)
        (tmp / f"{i}.json").write_text(json.dumps({"returncode": code, "ray_initialized": ray_on,
                                                   "imported": imported}))
        atexit._run_exitfuncs()  # what the interpreter runs at exit (they may print, too)
    except BaseException:
        traceback.print_exc()
        code = 1 if not isinstance(code, int) or code == 0 else code
    finally:
        _flush_all()
        os._exit(code if isinstance(code, int) else 1)


def _child(tmp: Path) -> None:
    import importlib
    import signal
    import time

    sys.path[0] = str(ROOT)  # as `python -m` sets it (this file ran as a script: tests/)
    spec = json.loads((tmp / "spec.json").read_text())
    saved = os.dup(1), os.dup(2)
    _redirect(tmp / "warmup.out", tmp / "warmup.err")
    try:
        for name in spec["warmup"]:
            importlib.import_module(name)
    finally:
        _flush_all()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
    results = []
    for i, call in enumerate(spec["calls"]):
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:
            _run_one(call, spec["module"], tmp, i)  # never returns
        deadline = time.monotonic() + spec["timeout"]
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                _, status = os.waitpid(pid, 0)
                with open(tmp / f"{i}.err", "a") as f:
                    f.write(f"\ncli_batch: killed after {spec['timeout']}s\n")
                break
            time.sleep(0.01)
        code = os.waitstatus_to_exitcode(status)
        got = tmp / f"{i}.json"
        info = json.loads(got.read_text()) if got.exists() else {"ray_initialized": False, "imported": []}
        results.append({**info, "returncode": code, "seconds": round(time.monotonic() - start, 3)})  # the status the fork really exited with
    (tmp / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    _child(Path(sys.argv[1]))
