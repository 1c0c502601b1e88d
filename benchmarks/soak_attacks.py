"""What the soak does to a live run (benchmarks/soak.py): damage stored entries in the real
Redis the way a bad disk, a bad producer or a foreign writer would; find the run's processes (its
rollout and reward actors, its embedded server) among the descendants of `vgrpo train`, to kill
them; find its bank. Each damage returns the entry id it damaged (None when there was none to
damage), so the soak can check afterwards where each one went.

Every write is conditional on the key still existing (`SET … XX`, a Lua guard): an entry the
bank deleted meanwhile is left alone, never recreated as an orphan. The Lua guard is not one of
the bank's scripts, so it needs the embedded server's owner client (`EmbeddedRedis.admin_client`,
as in the tests). The soak, outside the run, holds the actors' user only (the run's URL file):
`untrainable` then checks that the entry exists and writes in the next round trip.
"""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path

import redis
import torch

from memory_bank import tensorfile

FUTURE = str(10 ** 38)  # a 39-digit policy version: the codec reads it, no learner has reached it
_HSET_IF_EXISTS = ("if redis.call('EXISTS', KEYS[1]) == 1 then "
                   "return redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) end return -1")


def _any_entry(bank, rng: random.Random) -> str | None:
    """A queued group's member or a banked entry, half the time each (when there is one)."""
    banked = sorted(e.decode() if isinstance(e, bytes) else e for e in bank.r.hkeys(bank.keys.einfo))
    queued = sorted(queued_members(bank))
    pick = queued if queued and (not banked or rng.random() < 0.5) else banked
    return rng.choice(pick) if pick else None


def queued_members(bank) -> set[str]:
    """Entry ids of the members of the groups waiting to be pulled."""
    out: set[str] = set()
    for gid in bank.queued_ids():
        out.update((bank.r.hget(bank.keys.group(gid), "eids") or b"").decode().split())
    return out


def flip_bits(bank, rng: random.Random) -> str | None:
    """8–32 random bits of a stored entry's tensor blob (header or data)."""
    eid = _any_entry(bank, rng)
    blob = bank.r.get(bank.keys.blob(eid)) if eid else None
    if not blob:
        return None
    raw = bytearray(blob)
    for _ in range(rng.randint(8, 32)):
        i = rng.randrange(len(raw) * 8)
        raw[i // 8] ^= 1 << (i % 8)
    return eid if bank.r.set(bank.keys.blob(eid), bytes(raw), xx=True) else None


def non_finite(bank, rng: random.Random) -> str | None:
    """+inf in one value of a stored latent, written with a valid checksum (as a producer that
    skipped its own finite check would): only the finite check at decode can catch it."""
    eid = _any_entry(bank, rng)
    blob = bank.r.get(bank.keys.blob(eid)) if eid else None
    if not blob:
        return None
    try:
        tensors = tensorfile.loads(blob)
    except ValueError:   # damaged already
        return None
    name = "x" if "x" in tensors else "final_latents"
    t = tensors[name].clone()
    t.view(-1)[rng.randrange(t.numel())] = float("inf") if rng.random() < 0.5 else float("nan")
    tensors[name] = t
    return eid if bank.r.set(bank.keys.blob(eid), tensorfile.dumps(tensors), xx=True) else None


def untrainable(bank, rng: random.Random) -> str | None:
    """A queued group's member stamped with a policy version from the future (the codec accepts
    it; the learner must quarantine it and draw the group again)."""
    queued = bank.queued_ids()
    if not queued:
        return None
    eids = (bank.r.hget(bank.keys.group(rng.choice(queued)), "eids") or b"").decode().split()
    if not eids:
        return None
    eid = rng.choice(eids)
    meta = bank.keys.meta(eid)
    try:
        done = bank.r.eval(_HSET_IF_EXISTS, 1, meta, "version", FUTURE)
    except redis.exceptions.NoPermissionError:   # the actors' user: no EVAL of new code
        done = bank.r.hset(meta, "version", FUTURE) if bank.r.exists(meta) else -1
    return eid if done != -1 else None


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children, theirs, ...), from /proc."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):   # gone meanwhile
                continue
    out, todo = [], [pid]
    while todo:
        at = todo.pop()
        kids = [c for c, p in parent.items() if p == at]
        out += kids
        todo += kids
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def role_pids(root: int, role: str) -> list[int]:
    """The processes under `root` of a Ray actor class (`RolloutWorker`, `RewardActor`): Ray
    titles each actor's worker `ray::<Class>...`."""
    return [p for p in descendants(root) if _cmdline(p).startswith(f"ray::{role}")]


def server_pids(root: int) -> list[int]:
    """The valkey-servers (or redis-servers) under `root`: a run's embedded one."""
    return [p for p in descendants(root)
            if Path(_cmdline(p).split(" ", 1)[0]).name in ("valkey-server", "redis-server")]


def bank_url(data_dir: str | os.PathLike) -> str | None:
    """The URL of the embedded server whose socket is in `data_dir` (a run's `redis/`), from the
    0600 file its driver handed the actors (memory_bank/ref.py): the actors' user."""
    sock = str(Path(data_dir).resolve() / "redis.sock")
    for f in Path(tempfile.gettempdir()).glob("vgrpo-bank-*/redis_url"):
        try:
            url = f.read_text()
        except OSError:   # another user's, or gone
            continue
        if url.endswith(f"@{sock}?db=0"):
            return url
    return None


def checkpoint_finite(ckpt: Path) -> tuple[int, int]:
    """(tensors, non-finite ones) in a checkpoint: its policy's safetensors and its .pt files."""
    from safetensors.torch import load_file  # heavy: safetensors

    def walk(x):
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, dict):
            for v in x.values():
                yield from walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                yield from walk(v)

    tensors = [t for f in sorted(ckpt.rglob("*.safetensors")) for t in load_file(f).values()]
    tensors += [t for f in sorted(ckpt.rglob("*.pt")) for t in walk(torch.load(f, weights_only=True))]
    floats = [t for t in tensors if t.is_floating_point()]
    return len(floats), sum(not bool(torch.isfinite(t).all()) for t in floats)


ATTACKS = {"flip": flip_bits, "nonfinite": non_finite, "untrainable": untrainable}
