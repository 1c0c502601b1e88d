"""Actors reach the bank by reference: the Redis URL never travels in their (pickled) arguments."""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
import stat

import pytest
from pydantic import SecretStr

from common.config import BankConfig
from memory_bank.ref import BankRef, make_ref


def test_a_configured_url_goes_to_a_private_file_not_into_the_reference(redis_server, tmp_path):
    url = redis_server.url.get_secret_value()
    secret = url.split("@")[0].rsplit(":", 1)[-1]
    cfg = BankConfig(redis_url=SecretStr(url), namespace="refs")
    ref, folder = make_ref(cfg, url, secret_dir=tmp_path)
    assert ref.env is None and ref.cfg.redis_url is None
    assert secret.encode() not in pickle.dumps(ref)               # what Ray would store
    mode = os.stat(ref.file).st_mode
    assert stat.S_IMODE(mode) == 0o600 and stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    bank = ref.open()                                              # a worker's own connection
    assert bank.r.ping() and bank.cfg.namespace == "refs"


def test_a_url_from_the_environment_is_passed_as_the_variable_name(redis_server, monkeypatch):
    url = redis_server.url.get_secret_value()
    monkeypatch.setenv("VGRPO_TEST_REDIS_URL", url)
    ref, folder = make_ref(BankConfig(redis_url_env="VGRPO_TEST_REDIS_URL"), url)
    assert folder is None and ref.file is None and ref.env == "VGRPO_TEST_REDIS_URL"
    assert ref.open().r.ping()
    monkeypatch.delenv("VGRPO_TEST_REDIS_URL")
    with pytest.raises(RuntimeError, match=r"\$VGRPO_TEST_REDIS_URL is not set on this worker"):
        ref.url()


def test_a_missing_url_file_names_the_file_and_the_fix(tmp_path):
    ref = BankRef(BankConfig(), file=str(tmp_path / "gone"))
    with pytest.raises(RuntimeError, match=r"gone.*bank.redis_url_env"):
        ref.url()


def test_a_reader_on_another_node_asks_the_drivers_node_for_the_url(ray_session, redis_server, tmp_path):
    """On a cluster the file is on the driver's node only: elsewhere a UrlServer pinned there
    reads it and answers; the reference still carries no secret (only the file's path and the
    server's handle)."""
    ray = ray_session
    url = redis_server.url.get_secret_value()
    secret = url.split("@")[0].rsplit(":", 1)[-1]
    ref, folder = make_ref(BankConfig(redis_url=SecretStr(url), namespace="refs"), url,
                           secret_dir=tmp_path, other_nodes=True)
    try:
        assert ref.node == ray.get_runtime_context().get_node_id() and ref.server is not None
        assert secret.encode() not in ray.cloudpickle.dumps(ref)      # what Ray would store
        away = dataclasses.replace(ref, node="ff" * 28)                # as a reader on another node sees it

        @ray.remote(num_cpus=0)
        def ping_from_a_worker(r):
            return r.open().r.ping()

        assert ray.get(ping_from_a_worker.remote(away), timeout=120)   # the answer came from the server
        # the server's own worker imported no torch (it was 2.7 s of CPU and ~300 MB per run)
        loaded = ray.get(ref.server.__ray_call__.remote(lambda self: sorted(
            m for m in __import__("sys").modules if m.split(".")[0] in ("torch", "redis", "memory_bank"))), timeout=60)
        assert loaded == ["memory_bank", "memory_bank.url_server"], loaded
        shutil.rmtree(folder)                                          # the run ended: the file is gone
        with pytest.raises(RuntimeError, match=r"did not give the Redis URL.*VGRPO_REDIS_URL on every node"):
            away.url()
        with pytest.raises(RuntimeError, match=r"Redis URL file is on Ray node f+, not on this one"):
            dataclasses.replace(away, server=None).url()
    finally:
        ray.kill(ref.server)
        shutil.rmtree(folder, ignore_errors=True)
