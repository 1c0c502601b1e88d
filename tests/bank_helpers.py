"""Small scored groups for the memory-bank tests (K=3 trained steps of [C=4, F=6, 16, 16]),
each with its encoded condition (text [1, 5, 8] fp32, a bool mask, an unconditional text)."""

from __future__ import annotations

import json
from collections import Counter
from typing import TYPE_CHECKING

import torch

from common.sde import Sage, Schedule
from common.types import Cond, Condition, Group, Scores, Trajectory
from memory_bank.codec import cond_nbytes

if TYPE_CHECKING:
    from memory_bank.bank import MemoryBank

SHAPE = (4, 6, 16, 16)   # [C, F, H, W]
HEADS = ["vq", "mq", "ta"]


def make_cond(cid: str, encoder: str = "test-encoder") -> Cond:
    """A condition's encoding, a function of its id (so two groups of one condition share it)."""
    import zlib

    gen = torch.Generator().manual_seed(zlib.crc32(cid.encode()))
    return Cond({"text": torch.randn(1, 5, 8, generator=gen), "mask": torch.ones(1, 5, dtype=torch.bool)},
                {"text": torch.randn(1, 5, 8, generator=gen)}, encoder)


def make_traj(cond: Condition, group_id: str, member: int, version: int, gen: torch.Generator,
              k: int = 3, shape: tuple[int, ...] = SHAPE, dtype=torch.float32, enc: Cond | None = None
              ) -> Trajectory:
    spec = Sage(0.5).spec(Schedule.explicit(torch.linspace(1, 0, 9).tolist()))
    return Trajectory(
        condition=cond, group_id=group_id, member=member, seed=1234 + member, spec=spec,
        guidance_scale=1.0, policy_version=version, step_indices=list(range(k)),
        x=torch.randn(k, *shape, generator=gen).to(dtype),          # [K, C, F, H, W]
        x_next=torch.randn(k, *shape, generator=gen).to(dtype),     # [K, C, F, H, W]
        logp_old=torch.randn(k, generator=gen),                     # [K]
        final_latents=torch.randn(*shape, generator=gen).to(dtype),  # [C, F, H, W]
        frames=torch.randint(0, 255, (shape[1], 8, 8, 3), dtype=torch.uint8, generator=gen),
        cond=enc,
    )


def make_group(cid: str = "c0", group_id: str = "g0", version: int = 0, g: int = 4,
               seed: int = 0, composite: list[float] | None = None, image: bool = False,
               shape: tuple[int, ...] = SHAPE) -> Group:
    gen = torch.Generator().manual_seed(seed)
    img = torch.randint(0, 255, (8, 8, 3), dtype=torch.uint8, generator=gen) if image else None
    cond = Condition(id=cid, prompt=f"a prompt for {cid} ✓", image=img)
    enc = make_cond(cid)
    members = [make_traj(cond, group_id, i, version, gen, shape=shape, enc=enc) for i in range(g)]
    values = torch.rand(g, len(HEADS), generator=gen)                 # [G, H]
    comp = torch.tensor(composite, dtype=torch.float32) if composite is not None else values.sum(1)
    return Group(condition=cond, group_id=group_id, policy_version=version, members=members,
                 scores=Scores(list(HEADS), values), composite=comp)


def json_hash(bank: MemoryBank, key: str) -> dict[str, dict]:
    return {a.decode(): json.loads(b) for a, b in bank.r.hgetall(key).items()}


def queued_groups(bank: MemoryBank) -> list[str]:
    k = bank.keys
    gids = [g.decode() for g in bank.r.lrange(k.fresh, 0, -1)]
    for c in bank.r.smembers(k.consumers):
        gids += [g.decode() for g in bank.r.lrange(k.pending(c.decode()), 0, -1)]
    return gids


def check_accounting(bank: MemoryBank) -> dict[str, dict]:
    """Every record's (n, q), `bytes`, `qbytes` and the record keys, recomputed independently."""
    k = bank.keys
    einfo, cinfo = json_hash(bank, k.einfo), json_hash(bank, k.cinfo)
    queued = {e for g in queued_groups(bank) for e in bank.r.hget(k.group(g), "eids").decode().split()}
    refs = Counter(d["k"] for d in einfo.values())
    qrefs = Counter(d["k"] for e, d in einfo.items() if e in queued)
    assert {c: (d["n"], d["q"]) for c, d in cinfo.items()} == {c: (refs[c], qrefs[c]) for c in refs}
    records = {key.decode().rsplit(":", 1)[1] for key in bank.r.scan_iter(match=f"{k.namespace}:*condrec:*")}
    assert records == set(cinfo)
    for c, d in cinfo.items():   # a record's bytes are what it holds in Redis
        assert d["b"] == cond_nbytes({a.decode(): v if a == b"blob" else v.decode()
                                      for a, v in bank.r.hgetall(k.cond_record(c)).items()})
    group_bytes = sum(int(bank.r.hget(k.group(g), "bytes")) for g in queued_groups(bank))
    assert bank.bytes_used() == sum(d["b"] for d in einfo.values()) + sum(d["b"] for d in cinfo.values())
    assert bank.queued_bytes() == group_bytes + sum(d["b"] for d in cinfo.values() if d["q"])
    return cinfo
