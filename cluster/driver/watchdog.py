"""What the driver starts outside Ray dies with it, SIGKILL included.

A SIGKILLed driver runs no teardown: the embedded redis-server holding the whole bank and the
0600 file holding its password used to outlive it. `Watchdog.start()` starts a small process,
in its own session (a Ctrl-C or a kill of the driver's process group does not reach it), that
reads a pipe whose write end only the driver holds. The driver tells it, one line each, which
processes to stop (`kill_with_me`) and which paths to delete (`remove_with_me`). When the driver
exits by any means the kernel closes the pipe; the watchdog reads EOF, sends SIGTERM to those
processes (redis-server flushes its AOF and exits) and deletes those paths. A clean teardown
ends it with `stop()` after doing the same itself, so the two never race.

Processes are held by pidfd (Linux 5.3+), so a pid reused after its process ended is never hit.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path


class Watchdog:
    def __init__(self, proc: subprocess.Popen):
        self.proc = proc

    @classmethod
    def start(cls) -> Watchdog:
        here = str(Path(__file__).resolve().parents[2])   # the folder holding the `cluster` package
        path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
        proc = subprocess.Popen([sys.executable, "-m", "cluster.driver.watchdog"], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, start_new_session=True, text=True,
                                env={**os.environ, "PYTHONPATH": path})
        return cls(proc)

    def _say(self, line: str) -> None:
        if "\n" in line:
            raise ValueError(f"watchdog: {line!r} is not one line")
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def kill_with_me(self, pid: int) -> None:
        self._say(f"pid {int(pid)}")

    def remove_with_me(self, path: str | os.PathLike) -> None:
        self._say(f"path {Path(path).resolve()}")

    def stop(self) -> None:
        """The driver cleaned up itself: the watchdog leaves everything as it is and exits."""
        try:
            self._say("done")
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            self.proc.kill()


def _hold(pid: int) -> int | None:
    """A pidfd for pid (None when it is gone already, or pidfds are not available)."""
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None


def _clean_up(pids: dict[int, int | None], paths: list[str]) -> None:
    for pid, fd in pids.items():
        try:
            if fd is not None:
                signal.pidfd_send_signal(fd, signal.SIGTERM)
            else:
                os.kill(pid, signal.SIGTERM)
        except (ProcessLookupError, OSError):
            pass  # it ended already
    for p in paths:
        if os.path.isdir(p):
            shutil.rmtree(p, ignore_errors=True)
        elif os.path.exists(p):
            os.unlink(p)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # only the pipe's EOF ends it
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    pids: dict[int, int | None] = {}
    paths: list[str] = []
    for line in sys.stdin:
        kind, _, arg = line.rstrip("\n").partition(" ")
        if kind == "done":
            return
        if kind == "pid":
            pids[int(arg)] = _hold(int(arg))
        elif kind == "path":
            paths.append(arg)
    _clean_up(pids, paths)   # EOF without `done`: the driver is gone


if __name__ == "__main__":
    main()
