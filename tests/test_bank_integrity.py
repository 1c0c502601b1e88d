"""Integrity of stored tensors on a real redis-server: bits flipped in Redis, a +inf or NaN
in a latent, an inf in mu_old are each a corrupt entry at pull (skipped, counted, evicted),
and the clean members of the same group are trained as stored."""

from __future__ import annotations

import logging
import random

import safetensors.torch
import torch
from bank_helpers import make_group

from memory_bank.tensorfile import dumps


def _flip_bits(bank, eid: str, n: int, rng: random.Random) -> None:
    key = bank.keys.blob(eid)
    blob = bytearray(bank.r.get(key))
    start = 8 + int.from_bytes(blob[:8], "little")    # the data, after the header
    for _ in range(n):
        i = rng.randrange(start, len(blob))
        blob[i] ^= 1 << rng.randrange(8)
    bank.r.set(key, bytes(blob))


def _rewrite(bank, eid: str, spoil) -> None:
    """Replace a stored blob by one with a valid checksum but spoiled values (a producer that
    wrote without checking), so that only the finite check can catch it."""
    key = bank.keys.blob(eid)
    t = safetensors.torch.load(bank.r.get(key))
    spoil(t)
    bank.r.set(key, dumps(t))


def test_flipped_bits_and_non_finite_floats_are_corrupt_at_pull(bank, caplog):
    grp = make_group("c", "g0", g=6, seed=3)
    for m in grp.members:
        m.mu_old = torch.randn_like(m.x)                 # [K, C, F, H, W]
    bank.push_group(grp)
    eids = bank.r.hget(bank.keys.group("g0"), "eids").decode().split()
    by_member = {int(bank.r.hget(bank.keys.meta(e), "member")): e for e in eids}
    clean = {m: grp.members[m].x.clone() for m in (4, 5)}
    rng = random.Random(0)
    _flip_bits(bank, by_member[0], 8, rng)
    _flip_bits(bank, by_member[1], 32, rng)

    def inf_latent(t):
        t["x"].reshape(-1)[5] = float("inf")

    def nan_next(t):
        t["x_next"].reshape(-1)[-1] = float("nan")

    def inf_mu(t):
        t["mu_old"].reshape(-1)[0] = float("-inf")

    _rewrite(bank, by_member[2], inf_latent)
    _rewrite(bank, by_member[3], lambda t: (nan_next(t), inf_mu(t)))
    with caplog.at_level(logging.ERROR, logger="memory_bank.bank"):
        batch = bank.pull(1, 0)
    (got,) = batch.fresh
    assert [m.member for m in got.members] == [4, 5]
    for m in got.members:
        assert torch.equal(m.x, clean[m.member]) and bool(torch.isfinite(m.mu_old).all())
    assert bank.stats()["corrupt"] == 4
    assert caplog.text.count("checksum mismatch") == 2
    assert "tensor 'x' has non-finite values" in caplog.text
    assert "has non-finite values" in caplog.text.split(by_member[3])[1]
    # the corrupt members were dropped with the group's commit, never banked
    bank.commit(batch, 1)
    assert sorted(e.trajectory.member for e in bank.entries("c")) == [4, 5]


def test_a_banked_entry_corrupted_later_is_evicted_at_pull(bank, caplog):
    bank.push_group(make_group("c", "g0", g=2, seed=0))
    bank.commit(bank.pull(1, 0), 1)
    banked = [e.id for e in bank.entries("c")]
    _flip_bits(bank, banked[0], 1, random.Random(1))     # one bit is enough
    bank.push_group(make_group("c", "g1", g=2, seed=1))
    with caplog.at_level(logging.ERROR, logger="memory_bank.bank"):
        batch = bank.pull(1, 0)
    assert [t.bank_id for t, _, _ in batch.bank[0]] == banked[1:]
    assert "checksum mismatch" in caplog.text and bank.stats()["corrupt"] == 1
    assert not bank.r.exists(bank.keys.blob(banked[0]))
