"""What the driver starts dies with it, SIGKILL included.

A SIGKILLed driver runs no teardown: the embedded redis-server holding the whole bank, the 0600
file holding its password and the local Ray cluster's agents used to outlive it. `Watchdog.start()`
starts a small process, in its own session (a Ctrl-C or a kill of the driver's process group does
not reach it), that reads a pipe whose write end only the driver holds. The driver tells it, one
line each, which processes to stop (`kill_with_me`), which paths to delete (`remove_with_me`) and
which Ray session it started itself (`end_ray_session`). When the driver exits by any means the
kernel closes the pipe; the watchdog reads EOF, sends SIGTERM to those processes (redis-server
flushes its AOF and exits), deletes those paths and ends that Ray session's processes. A clean
teardown ends it with `stop()` after doing the same itself, so the two never race.

Processes are held by pidfd (Linux 5.3+), so a pid reused after its process ended is never hit.
A Ray session's processes are found at EOF: those whose command line or open files name the
session's directory (Ray's agents and workers retitle themselves `ray::…`, but keep their log
files there open). Each is held by pidfd first and checked after, so what is signalled is the
process that matched. Only a session the driver started is ever named: a joined cluster's
directory is never told to the watchdog (`RayHandle.own_session`).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

GRACE_S = 5.0  # how long a Ray process has to exit after SIGTERM before it gets SIGKILL


class Watchdog:
    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self._lock = threading.Lock()  # EmbeddedRedis.restart() may tell it from another thread

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
        with self._lock:
            if self.proc.stdin.closed:
                return  # stopped: the driver cleaned up itself, nothing is left to follow
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()

    def kill_with_me(self, pid: int) -> None:
        self._say(f"pid {int(pid)}")

    def remove_with_me(self, path: str | os.PathLike) -> None:
        self._say(f"path {Path(path).resolve()}")

    def end_ray_session(self, session_dir: str | os.PathLike) -> None:
        """The Ray session this driver started (never a joined cluster's): its processes end with it."""
        self._say(f"ray {Path(session_dir).resolve()}")

    def stop(self) -> None:
        """The driver cleaned up itself: the watchdog leaves everything as it is and exits."""
        try:
            self._say("done")
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            self.proc.kill()


def guard(ray_session: str | None, redis, secret_dir: Path | None) -> Watchdog | None:
    """A watchdog for what this driver started outside Ray and its own Ray session: it stops the
    embedded redis-server (and each one a restart() launches), deletes the Redis URL file (and a
    socket directory of its own) and ends the processes of the local Ray cluster the driver
    started (None: a joined cluster). None when there is nothing to guard."""
    if redis is None and secret_dir is None and ray_session is None:
        return None
    dog = Watchdog.start()
    if ray_session is not None:
        dog.end_ray_session(ray_session)
    if redis is not None:
        redis.on_start(dog.kill_with_me)  # the running server, and each restart's
        sock = redis.socket  # a short 0700 directory of its own when the run dir's path is too long
        if sock is not None and sock.parent != redis.data_dir:
            dog.remove_with_me(sock.parent)
    if secret_dir is not None:
        dog.remove_with_me(secret_dir)
    return dog


def _hold(pid: int) -> int | None:
    """A pidfd for pid (None when it is gone already, or pidfds are not available)."""
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None


def _names(text: str, session: str) -> bool:
    """Whether `text` names `session` itself or a path inside it (not session_…_12 for session_…_1)."""
    at = text.find(session)
    while at >= 0:
        end = at + len(session)
        if end == len(text) or text[end] in "/\0":
            return True
        at = text.find(session, end)
    return False


def _of_session(pid: int, session: str) -> bool:
    """A process of the Ray session: its command line, or one of its open files, names the dir."""
    try:
        if _names(Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"), session):
            return True
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False
    for fd in fds:
        try:
            if _names(os.readlink(fd), session):
                return True
        except OSError:
            continue
    return False


def _alive(pid: int) -> bool:
    """Running (a zombie holds nothing but its exit status)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def _session_processes(session: str) -> Iterator[int]:
    """pidfds of the live processes of `session` (this one never; the caller closes them). The
    pidfd is taken before the check and the process is still alive after it, so the pid was not
    reused in between: what the pidfd holds is what matched."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        fd = _hold(int(entry.name))
        if fd is None:
            continue
        if _of_session(int(entry.name), session) and _alive(int(entry.name)) and _held(fd):
            yield fd
        else:
            os.close(fd)


def _held(fd: int) -> bool:
    try:
        signal.pidfd_send_signal(fd, 0)
        return True
    except OSError:
        return False


def _signal_all(session: str, sig: int) -> int:
    """Send `sig` (0: none, a look) to every live process of the session; how many there were."""
    n = 0
    for fd in _session_processes(session):
        try:
            signal.pidfd_send_signal(fd, sig)
            n += 1
        except OSError:
            pass  # it ended in between
        finally:
            os.close(fd)
    return n


def end_session(session: str, grace_s: float = GRACE_S) -> None:
    """SIGTERM every process of the Ray session, then SIGKILL what is left after `grace_s`."""
    _signal_all(session, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and _signal_all(session, 0):
        time.sleep(0.2)
    for _ in range(25):
        if not _signal_all(session, signal.SIGKILL):
            return
        time.sleep(0.2)


def _clean_up(pids: dict[int, int | None], paths: list[str], sessions: list[str] = ()) -> None:
    for pid, fd in pids.items():
        try:
            if fd is not None:
                signal.pidfd_send_signal(fd, signal.SIGTERM)
            else:
                os.kill(pid, signal.SIGTERM)
        except (ProcessLookupError, OSError):
            pass  # it ended already
    for p in paths:  # before Ray's grace: the password file goes at once
        if os.path.isdir(p):
            shutil.rmtree(p, ignore_errors=True)
        elif os.path.exists(p):
            os.unlink(p)
    for session in sessions:
        end_session(session)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # only the pipe's EOF ends it
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    pids: dict[int, int | None] = {}
    paths: list[str] = []
    sessions: list[str] = []
    for line in sys.stdin:
        kind, _, arg = line.rstrip("\n").partition(" ")
        if kind == "done":
            return
        if kind == "pid":
            pids[int(arg)] = _hold(int(arg))
        elif kind == "path":
            paths.append(arg)
        elif kind == "ray":
            sessions.append(arg)
    _clean_up(pids, paths, sessions)   # EOF without `done`: the driver is gone


if __name__ == "__main__":
    main()
