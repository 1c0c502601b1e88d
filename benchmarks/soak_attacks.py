"""What the soak does to a live run besides killing actors (benchmarks/soak.py): damage stored
entries in the real Redis the way a bad disk, a bad producer or a foreign writer would, and pause
the driver past its bank lease. Each returns the entry id it damaged (None when there was none
to damage), so the soak can check afterwards where each one went.

Every write is conditional on the key still existing (`SET … XX`, a Lua guard): an entry the
bank deleted meanwhile is left alone, never recreated as an orphan. The Lua guard is not one of
the bank's scripts, so the `bank` handed in holds the embedded server's owner client
(`EmbeddedRedis.admin_client`): the actors' user may run the bank's own scripts only.
"""

from __future__ import annotations

import os
import random
import subprocess

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
    done = bank.r.eval(_HSET_IF_EXISTS, 1, bank.keys.meta(eid), "version", FUTURE)
    return eid if done != -1 else None


def pause_me(seconds: float) -> subprocess.Popen:
    """SIGSTOP this whole process (driver, lease thread and all) for `seconds`, then SIGCONT,
    from a child that outlives the stop."""
    pid = os.getpid()
    return subprocess.Popen(["sh", "-c", f"sleep 0.2; kill -STOP {pid}; sleep {seconds:.1f}; kill -CONT {pid}"])


def weights_finite(driver) -> bool:
    """Every parameter of the learner's rank 0 is finite (its local shard under FSDP)."""
    import ray

    def check(self) -> bool:
        params = self.trainer.model.trainable_module().parameters()
        return all(bool(torch.isfinite(getattr(p, "to_local", lambda p=p: p)()).all()) for p in params)

    return all(ray.get([r.__ray_call__.remote(check) for r in driver.learner.ranks], timeout=120))


ATTACKS = {"flip": flip_bits, "nonfinite": non_finite, "untrainable": untrainable}
