"""Resolve the bank's Redis (config URL, environment variable, or an embedded server).

The URL is a secret: it is only ever logged or raised through `redact_url`.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from common.config import BankConfig
from memory_bank.bank import MemoryBank
from memory_bank.embedded import EmbeddedRedis, check_version, client_kwargs, listen_mode
from memory_bank.errors import BankUnavailable, InsecureRedisUrl

log = logging.getLogger(__name__)


def redact_url(url: str) -> str:
    """The URL with any user and password replaced by '***'."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        netloc = (f"***@{host}" if (parts.username or parts.password) else host) + (
            f":{parts.port}" if parts.port else "")
        return urlunsplit((parts.scheme, netloc, parts.path, "", ""))
    except ValueError:
        return "<unparseable redis url>"


def client_from_url(url: str, allow_no_password: bool = False) -> redis.Redis:
    """A client with bounded retries; refuses a password-less URL unless allowed."""
    safe = redact_url(url)
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 — raises ValueError on a bad port
    except ValueError:
        raise BankUnavailable(f"bank.redis_url is malformed: {safe}") from None
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise BankUnavailable(f"bank.redis_url {safe}: scheme must be redis://, rediss:// or unix://")
    if not parts.password and not allow_no_password:
        raise InsecureRedisUrl(
            f"bank.redis_url {safe} has no password: use redis://:PASSWORD@host:port/0 (e.g. from "
            "the environment variable named by bank.redis_url_env), or set "
            "bank.allow_no_password=true to accept an unauthenticated Redis")
    return redis.Redis.from_url(url, **client_kwargs())


def server_identity(client: redis.Redis) -> tuple[str, tuple[int, ...] | None]:
    """(server name, version), ("valkey", (9, 1, 2)): from HELLO without arguments (which any
    authenticated client may send, and which changes nothing), then, when that says Redis or is
    refused, from INFO server where the user may read it (Valkey 7.2 answers HELLO as the Redis
    7.2.4 it is compatible with; INFO has `valkey_version`). ("redis", None) when neither tells."""
    name, version = "redis", None
    try:
        reply = client.execute_command("HELLO")
        if isinstance(reply, list):   # RESP2: a flat list of pairs
            reply = dict(zip(reply[::2], reply[1::2], strict=False))
        fields = {_text(k): _text(v) for k, v in dict(reply).items()}
        name, version = fields.get("server", "").lower() or "redis", _version(fields.get("version", ""))
    except redis.ResponseError:
        pass
    if name == "redis":
        try:
            info = client.info("server")
        except redis.ResponseError:
            return name, version
        if info.get("valkey_version"):
            return "valkey", _version(str(info["valkey_version"]))
        version = version or _version(str(info.get("redis_version", "")))
    return name, version


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _version(text: str) -> tuple[int, ...] | None:
    m = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)", text.strip())
    return tuple(int(g) for g in m.groups()) if m else None


def resolve_redis_url(cfg: BankConfig) -> tuple[str | None, str]:
    """(URL, where it came from): bank.redis_url in the process that loaded the config, else the
    file bank.redis_url_file, else $bank.redis_url_env; (None, "") means an embedded server.
    A config pickled into another process (a Ray actor) has no redis_url: it resolves the URL
    here, from the file or the variable, so the password never travels in its arguments."""
    if cfg.redis_url is not None:
        return cfg.redis_url.get_secret_value(), "bank.redis_url"
    if cfg.redis_url_file:
        path = Path(cfg.redis_url_file).expanduser()
        try:
            url = path.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise BankUnavailable(f"bank.redis_url_file {str(path)!r} cannot be read "
                                  f"({type(e).__name__}): point it at a file holding the URL") from None
        if not url:
            raise BankUnavailable(f"bank.redis_url_file {str(path)!r} is empty: write the URL in it")
        return url, f"bank.redis_url_file {str(path)!r}"
    if os.environ.get(cfg.redis_url_env):
        return os.environ[cfg.redis_url_env], f"${cfg.redis_url_env}"
    if cfg._url_withheld:
        raise BankUnavailable(
            "bank.redis_url holds a password and is not sent to other processes: give this "
            f"process the URL through bank.redis_url_file or ${cfg.redis_url_env}")
    return None, ""


def connect_bank(cfg: BankConfig, data_dir: str | Path | None = None, host: str | None = None
                 ) -> tuple[MemoryBank, EmbeddedRedis | None]:
    """resolve_redis_url(cfg), else an embedded server (AOF in data_dir). `host`: the node address
    actors on other Ray nodes reach this one at, when the run spans nodes (None: one node); it
    decides where the embedded server listens with bank.embedded_listen (`listen_mode`).

    The caller owns the returned EmbeddedRedis (stop it at the end; it also stops at exit).
    Workers in other processes connect with `embedded.url`.
    """
    url, source = resolve_redis_url(cfg)
    server = None
    if url:
        client = client_from_url(url, cfg.allow_no_password)
        probe = redis.Redis.from_url(url, socket_connect_timeout=5, retry=Retry(NoBackoff(), 0))
        where = f"{redact_url(url)} (from {source})"
    else:
        listen = listen_mode(cfg.embedded_listen, spans_nodes=host is not None)
        server = EmbeddedRedis(data_dir=data_dir, aof=cfg.aof, binary=cfg.redis_server,
                               listen=listen, host=host or "127.0.0.1", max_bytes=cfg.max_bytes,
                               allow_vulnerable=cfg.allow_vulnerable_server).start()
        if cfg.aof:   # with its append-only file, a server that dies is started again (`supervise`)
            server.supervise()
        client = probe = server.client()
        where = repr(server)   # its binary's version was checked before it started
    # 1. One unretried probe, so a wrong password or a dead host fails fast and clearly; 2. a
    #    URL's server passes the same version check as an embedded one's binary did.
    try:
        probe.ping()
        if server is None:
            name, version = server_identity(probe)
            where = f"{check_version(name, version, redact_url(url), cfg.allow_vulnerable_server)} at {where}"
    except redis.AuthenticationError:
        raise BankUnavailable(f"Redis at {where} refused the password") from None
    except redis.RedisError as e:
        if server is not None:
            server.stop()
        raise BankUnavailable(f"Redis at {where} is unreachable: {type(e).__name__}") from None
    finally:
        if probe is not client:
            probe.close()
    log.info("memory bank on %s, namespace %r", where, cfg.namespace)
    return MemoryBank(client, cfg), server
