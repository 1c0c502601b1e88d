"""Errors raised by the memory bank. Each message names the key, field or setting at fault."""

from __future__ import annotations

import json

from common.config import ConfigError
from common.errors import UserError


class BankError(Exception):
    """Base class for memory-bank errors."""


class CorruptEntry(BankError):
    """A stored entry could not be decoded (bad bytes, wrong shapes, missing fields)."""


class UnscoredGroup(BankError, ValueError):
    """A group was pushed before the reward role scored it."""


class DuplicateGroup(BankError):
    """A group id was pushed twice by different producers."""


class InsecureRedisUrl(BankError, UserError):
    """An external Redis URL has no password and bank.allow_no_password is off."""


class BankUnavailable(BankError, UserError):
    """Redis could not be reached (the message never carries credentials)."""


class RedisBinaryNotFound(BankError, UserError):
    """No valkey-server or redis-server binary for the embedded server."""


class VulnerableServer(BankError, ConfigError):
    """The bank's server (embedded or a URL's) lacks the fixes for known CVEs and
    bank.allow_vulnerable_server is off."""


class BankFull(BankError):
    """A push would take the bank over bank.max_bytes beside the groups already queued."""


class BankTooSmall(BankError, ConfigError):
    """bank.max_bytes cannot hold one training step's groups."""


class NamespaceBusy(BankError, ConfigError):
    """Another live run holds the namespace's lease."""


class StaleBank(BankError, ConfigError):
    """The namespace holds a dead run's data and bank.clear_stale is off."""


class LeaseLost(BankError):
    """Another run holds the namespace's lease (this run's lapsed and was taken over, or this
    bank holds none while a run does): the bank refuses every operation that moves a group."""

    @classmethod
    def from_reply(cls, namespace: str, message: str, fenced: bool) -> LeaseLost:
        rest = message.partition(" ")[2]
        if fenced and rest.startswith("epoch "):  # the lease is free, but another run claimed it since
            return cls(f"memory bank: this run's lease on bank.namespace {namespace!r} lapsed and another run "
                       f"claimed it since (claim {rest.split()[1]}) and released it; this run must stop "
                       "(no push, pull or commit is taken)")
        holder = describe_holder(rest)
        if fenced:
            return cls(f"memory bank: this run lost the lease on bank.namespace {namespace!r} to "
                       f"another run ({holder}); it must stop (no push, pull or commit is taken)")
        return cls(f"memory bank: bank.namespace {namespace!r} is leased by a live run ({holder}) "
                   "and this bank holds no lease: open it through that run's BankRef, or stop it")


def describe_holder(raw: bytes | str | None) -> str:
    """A lease value (JSON: run, host, pid) in words."""
    try:
        d = json.loads(raw or "")
        return f"run {d['run']} on {d['host']} pid {d['pid']}"
    except (ValueError, TypeError, KeyError):
        return "an unknown holder"
