"""Redis-backed memory bank: fresh-group queue, per-condition bank, embedded valkey-server.

Owns: every key in the bank (built in memory_bank/keys.py), the lease and its fence, and the
embedded server's process and its two users (memory_bank/privileges.py: what the actors may run).
Every write goes through MemoryBank's scripts. Imports no other role.
"""

import importlib

# The names below load on first use (PEP 562): a worker that needs one light module of the package
# (memory_bank.url_server, memory_bank.errors) does not import torch through memory_bank.bank.
_EXPORTS = {
    "MemoryBank": "bank", "Entry": "codec", "connect_bank": "connect", "client_from_url": "connect",
    "redact_url": "connect", "EmbeddedRedis": "embedded", "find_redis_server": "embedded",
    **{name: "errors" for name in ("BankError", "BankUnavailable", "CorruptEntry", "DuplicateGroup",
                                   "InsecureRedisUrl", "LeaseLost", "RedisBinaryNotFound", "UnscoredGroup",
                                   "VulnerableServer")},
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'memory_bank' has no attribute {name!r}")
    return getattr(importlib.import_module(f"memory_bank.{_EXPORTS[name]}"), name)


__all__ = [
    "MemoryBank", "Entry", "connect_bank", "client_from_url", "redact_url", "EmbeddedRedis",
    "find_redis_server", "BankError", "BankUnavailable", "CorruptEntry", "DuplicateGroup",
    "InsecureRedisUrl", "LeaseLost", "RedisBinaryNotFound", "UnscoredGroup",
    "VulnerableServer",
]
