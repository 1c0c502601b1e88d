"""Redis-backed memory bank: fresh-group queue, per-condition bank, embedded valkey-server.

Owns: every key in the bank (built in memory_bank/keys.py), the lease and its fence, and the
embedded server's process and its two users (memory_bank/privileges.py: what the actors may run).
Every write goes through MemoryBank's scripts. Imports no other role.
"""

from memory_bank.bank import MemoryBank
from memory_bank.codec import Entry
from memory_bank.connect import client_from_url, connect_bank, redact_url
from memory_bank.embedded import EmbeddedRedis, find_redis_server
from memory_bank.errors import (
    BankError,
    BankUnavailable,
    CorruptEntry,
    DuplicateGroup,
    InsecureRedisUrl,
    LeaseLost,
    RedisBinaryNotFound,
    UnscoredGroup,
    VulnerableServer,
)

__all__ = [
    "MemoryBank", "Entry", "connect_bank", "client_from_url", "redact_url", "EmbeddedRedis",
    "find_redis_server", "BankError", "BankUnavailable", "CorruptEntry", "DuplicateGroup",
    "InsecureRedisUrl", "LeaseLost", "RedisBinaryNotFound", "UnscoredGroup",
    "VulnerableServer",
]
