"""Actors reach the bank by reference: the Redis URL never travels in their (pickled) arguments."""

from __future__ import annotations

import os
import pickle
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
