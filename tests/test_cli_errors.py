"""User errors are one base class (common/errors.UserError): the CLI prints one line and exits 2
for any of them, also when a Ray actor raised it (Ray wraps it, keeping it as `cause`); any
other exception keeps its traceback."""

from __future__ import annotations

import argparse

import pytest

from cluster import cli
from common.config import ConfigError
from common.errors import UserError
from learner.checkpoint import CheckpointError
from memory_bank.errors import BankUnavailable, RedisBinaryNotFound
from rollout_worker.models.base import ModelLoadError


class _Wrapped(Exception):
    """What ray.get raises for an actor's error: another exception, the original as `cause`."""

    def __init__(self, cause):
        super().__init__("ray task error")
        self.cause = cause


def _run_raising(monkeypatch, exc) -> int:
    def parser():
        p = argparse.ArgumentParser(prog="vgrpo")
        p.set_defaults(func=lambda args: (_ for _ in ()).throw(exc))
        return p

    monkeypatch.setattr(cli, "build_parser", parser)
    return cli.main([])


@pytest.mark.parametrize("err", [ConfigError("train.steps: must be > 0"), ModelLoadError("model.path missing"),
                                 CheckpointError("trainer.pt: damaged"), BankUnavailable("redis down"),
                                 RedisBinaryNotFound("no redis-server")])
def test_every_user_error_is_one_line_and_exit_2(monkeypatch, capsys, err):
    assert isinstance(err, UserError)
    assert _run_raising(monkeypatch, err) == 2
    assert capsys.readouterr().err == f"error: {err}\n"
    assert _run_raising(monkeypatch, _Wrapped(err)) == 2  # raised inside an actor
    assert capsys.readouterr().err == f"error: {err}\n"


def test_a_new_user_error_needs_no_registration(monkeypatch, capsys):
    class FreshError(UserError):
        pass

    assert _run_raising(monkeypatch, FreshError("the field x is wrong")) == 2
    assert "error: the field x is wrong" in capsys.readouterr().err


def test_a_program_error_keeps_its_traceback(monkeypatch):
    with pytest.raises(KeyError):
        _run_raising(monkeypatch, KeyError("bug"))
