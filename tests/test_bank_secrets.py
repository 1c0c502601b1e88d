"""Secrets and hardening: the Redis password never travels pickled in Ray actor arguments
(it goes by reference: a file or an environment variable, resolved where it is needed), and
the embedded redis-server refuses the commands the bank never sends."""

from __future__ import annotations

import copy
import pickle

import cloudpickle
import pytest
import redis
from bank_helpers import make_group

from common.config import BankConfig, load_config
from memory_bank.bank import MemoryBank
from memory_bank.connect import connect_bank, resolve_redis_url
from memory_bank.embedded import DISABLED_COMMANDS, EmbeddedRedis
from memory_bank.errors import BankUnavailable

SECRET = "hunter2-Zq9xK"
URL = f"redis://:{SECRET}@db.internal:6379/0"


def test_a_pickled_config_never_carries_the_password():
    cfg = load_config(None, [f"bank.redis_url={URL}", "bank.namespace=sec"])
    for dumps in (pickle.dumps, cloudpickle.dumps):
        blob = dumps(cfg)
        assert SECRET.encode() not in blob
        copy_ = pickle.loads(blob)
        assert copy_.bank.redis_url is None and copy_.bank.namespace == "sec"
        with pytest.raises(BankUnavailable) as err:     # told how to pass it by reference
            resolve_redis_url(copy_.bank)
        assert "\n" not in str(err.value) and "bank.redis_url_file" in str(err.value)
        assert "$VGRPO_REDIS_URL" in str(err.value) and SECRET not in str(err.value)
    # the process that loaded it keeps it, and so do its in-process copies
    assert resolve_redis_url(cfg.bank) == (URL, "bank.redis_url")
    assert copy.deepcopy(cfg).bank.redis_url.get_secret_value() == URL
    assert cfg.model_copy(deep=True).bank.redis_url.get_secret_value() == URL


def test_url_by_reference_file_and_environment(tmp_path, monkeypatch):
    f = tmp_path / "redis-url"
    f.write_text(URL + "\n")
    assert resolve_redis_url(BankConfig(redis_url_file=str(f))) == (URL, f"bank.redis_url_file {str(f)!r}")
    monkeypatch.setenv("MY_REDIS", URL)
    assert resolve_redis_url(BankConfig(redis_url_env="MY_REDIS")) == (URL, "$MY_REDIS")
    with pytest.raises(BankUnavailable, match="bank.redis_url_file .* cannot be read"):
        resolve_redis_url(BankConfig(redis_url_file=str(tmp_path / "absent")))


def test_a_ray_actor_gets_no_password_and_resolves_the_url_itself(ray_session, redis_server, tmp_path):
    ray = ray_session
    url = redis_server.url.get_secret_value()
    secret_file = tmp_path / "redis-url"
    secret_file.write_text(url)
    secret_file.chmod(0o600)
    cfg = load_config(None, ["bank.namespace=secactor", f"bank.redis_url_file={secret_file}"])
    cfg.bank.redis_url = redis_server.url          # also inline, as a user may give it

    @ray.remote(num_cpus=0)
    class Probe:
        def check(self, cfg):
            from memory_bank.connect import connect_bank, resolve_redis_url

            bank, server = connect_bank(cfg.bank)
            return cfg.bank.redis_url is None, resolve_redis_url(cfg.bank)[1], server is None, \
                bank.stats()["fresh"]

    probe = Probe.remote()
    try:
        inline_gone, source, external, fresh = ray.get(probe.check.remote(cfg), timeout=120)
    finally:
        ray.kill(probe)
    assert inline_gone and external and fresh == 0
    assert source == f"bank.redis_url_file {str(secret_file)!r}"


def test_embedded_server_refuses_admin_commands_and_the_bank_still_works():
    with EmbeddedRedis() as server:
        c = server.client()
        c.set("kept", "1")
        for cmd in (("CONFIG", "GET", "dir"), ("CONFIG", "SET", "dir", "/tmp"), ("DEBUG", "SLEEP", "0"),
                    ("FLUSHALL",), ("KEYS", "*"), ("MONITOR",), ("SHUTDOWN", "NOSAVE"),
                    ("SWAPDB", "0", "1"), ("CLIENT", "PAUSE", "60000"),
                    ("CLIENT", "KILL", "TYPE", "normal"), ("CLIENT", "LIST")):
            with pytest.raises(redis.ResponseError, match="unknown command"):
                c.execute_command(*cmd)
        assert c.get("kept") == b"1" and c.ping()          # nothing swapped out, nobody paused
        assert {"CONFIG", "DEBUG", "SWAPDB", "CLIENT"} <= set(DISABLED_COMMANDS)
        bank = MemoryBank(c, BankConfig(namespace="hard", capacity=2))
        for i in range(3):
            bank.push_group(make_group("c", f"g{i}", g=2, seed=i))
            bank.commit(bank.pull(1, i), i + 1)
        st = bank.stats()
        assert (st["committed"], st["banked"], st["corrupt"]) == (3, 2, 0)
        assert bank.clear() > 0
        server.restart()                            # stopped by signal, not SHUTDOWN
        assert server.client().ping()


def test_connect_bank_reads_the_url_file(redis_server, tmp_path):
    f = tmp_path / "url"
    f.write_text(redis_server.url.get_secret_value())
    bank, server = connect_bank(BankConfig(namespace="secfile", redis_url_file=str(f)))
    assert server is None and bank.stats()["fresh"] == 0
