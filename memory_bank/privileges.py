"""What the bank's actors may do on the embedded server: least privilege, written as an ACL.

The embedded server has two users. Its owner (the process that started it, `EmbeddedRedis`)
holds an admin user's password in memory only; it loads the bank's Lua scripts at every start
(SCRIPT LOAD) and reads INFO. Everyone else (the driver's own bank, every rollout actor, the
learner) holds the `default` user's password, the one in the URL the driver hands out, and that
user may run only:

- the commands the bank sends (COMMANDS: its Python code's and its scripts' `redis.call`s,
  which the server checks against the caller's ACL too), on any key;
- the bank's scripts, each by its SHA-1 digest only (`EVALSHA <digest>`, `actor_acl`).

EVAL, EVALSHA of any other digest, SCRIPT, FUNCTION, FCALL, CONFIG, DEBUG, BGREWRITEAOF, DUMP,
RESTORE, MODULE, ACL, ... are refused with NOPERM, so no actor can run script code the owner did
not load: no EVAL of a crashing (CVE-2024-31449, CVE-2025-46817) or looping script.

Why digests and not Valkey FUNCTIONs: the bank calls its scripts by EVALSHA already, falling back
to EVAL (the body) only on NOSCRIPT, which is what an external Redis whose user may run EVAL
needs; allowing `EVALSHA <digest>` keeps that one path on every server. Valkey (and Redis 7)
express it as a first-argument rule (`+evalsha|<digest>`); the server logs that such rules are
deprecated and may go in a later major version, in which case the owner's start fails loudly
(`EmbeddedRedis`), never silently with wider rights. FUNCTIONs would persist in the AOF and
need FCALL, a second call path, and a library loaded on external servers too.

Every Lua script the bank runs must be in SCRIPTS (tests/test_bank_hardening.py finds any
module-level script in memory_bank/ that is not), or an actor's call of it is refused.
"""

from __future__ import annotations

import hashlib

from memory_bank import dump, ownership, scripts

SCRIPTS: dict[str, str] = {
    "push": scripts.PUSH, "pull": scripts.PULL, "requeue": scripts.REQUEUE,
    "requeue_all": scripts.REQUEUE_ALL, "commit": scripts.COMMIT, "evict": scripts.EVICT,
    "restore": scripts.RESTORE, "touch": scripts.TOUCH, "discard": scripts.DISCARD,
    "quarantine": scripts.QUARANTINE, "lease_claim": ownership.CLAIM, "lease_renew": ownership.RENEW,
    "lease_release": ownership.RELEASE, "index_read": dump.INDEX_READ,
}

# Every command the bank sends, from Python (memory_bank/*.py) and from its scripts. HELLO and
# AUTH authenticate (redis-py; HELLO also tells a client the server's name and version), PING
# probes, MULTI/EXEC/DISCARD are redis-py's transactions.
COMMANDS = (
    "auth", "hello", "ping", "multi", "exec", "discard",
    "get", "set", "del", "exists", "strlen", "incr", "incrby", "decrby", "pexpire", "pttl", "scan",
    "object|idletime",
    "hget", "hset", "hdel", "hexists", "hgetall", "hkeys", "hvals", "hlen", "hmget", "hincrby", "hstrlen",
    "hrandfield",
    "llen", "lmove", "lpop", "lpush", "rpush", "lrange", "lrem", "ltrim",
    "sadd", "srem", "smembers", "scard",
    "zadd", "zcard", "zrange", "zrem", "zscore",
)


def digest(source: str) -> str:
    """The SHA-1 the server names a script by (SCRIPT LOAD's answer)."""
    return hashlib.sha1(source.encode()).hexdigest()


def actor_acl() -> str:
    """The ACL rules of the actors' user, after `user default on <password>`: no pub/sub
    channels, every key, no command but COMMANDS and EVALSHA of the bank's scripts."""
    evalsha = " ".join(sorted(f"+evalsha|{digest(s)}" for s in set(SCRIPTS.values())))
    return f"resetchannels ~* -@all {' '.join('+' + c for c in COMMANDS)} {evalsha}"
