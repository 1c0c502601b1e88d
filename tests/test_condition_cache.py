"""Encoded conditions are kept per rollout actor (rollout_worker/condition_cache.py): a
condition's later groups skip the encoders and equal what a fresh encode gives; the cache is
bounded by entries and bytes; a changed first-frame file or negative prompt is a new entry."""

from __future__ import annotations

import os

import torch

from common.config import load_config
from common.types import Cond, Condition
from rollout_worker.condition_cache import ConditionCache
from rollout_worker.models import build_model
from rollout_worker.sampler import sample_group


class Counting:
    """The toy model, counting its encodes."""

    def __init__(self, model):
        self.model, self.calls = model, 0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def encode(self, *a, **kw):
        self.calls += 1
        return self.model.encode(*a, **kw)


def test_a_conditions_later_groups_reuse_its_encoding_and_equal_a_fresh_one():
    cfg = load_config("configs/quickstart.yaml", ["sampler.group_size=2", "schedule.steps=3"])
    model = Counting(build_model(cfg, "cpu"))
    cache = ConditionCache(8, 2**30)
    a, b = Condition("c0", "a red square moving left"), Condition("c1", "a red square moving up")
    first = sample_group(model, a, cfg, seed=1, policy_version=0, cache=cache)
    again = sample_group(model, a, cfg, seed=2, policy_version=0, cache=cache)
    other = sample_group(model, b, cfg, seed=1, policy_version=0, cache=cache)
    assert model.calls == 2 and (cache.stats.hits, cache.stats.misses) == (1, 2)
    assert again.members[0].cond is first.members[0].cond        # one object: stored once by the bank
    assert other.members[0].cond is not first.members[0].cond
    fresh = sample_group(model, a, cfg, seed=2, policy_version=0)  # no cache: encoded anew
    for k, v in fresh.members[0].cond.tensors.items():
        assert torch.equal(v, again.members[0].cond.tensors[k])
    assert torch.equal(fresh.members[0].x[0], again.members[0].x[0])


def _cond(nbytes: int) -> Cond:
    return Cond({"t": torch.zeros(1, nbytes // 4)})


def test_bounded_by_entries_and_by_bytes_least_recently_used_out_first():
    cache = ConditionCache(max_entries=2, max_bytes=1000)
    for k in ("a", "b"):
        cache.encoded((k,), lambda: _cond(400))
    cache.encoded(("a",), lambda: _cond(400))   # a is now the most recent
    cache.encoded(("c",), lambda: _cond(400))   # over 2 entries (and 1000 bytes): b goes
    assert set(k for (k,) in cache._entries) == {"a", "c"} and cache.nbytes == 800
    cache.encoded(("d",), lambda: _cond(2000))  # larger than the whole bound: used, never kept
    assert len(cache) == 2 and cache.stats.evictions == 1
    off = ConditionCache(max_entries=0, max_bytes=1000)
    off.encoded(("a",), lambda: _cond(4))
    assert len(off) == 0 and off.stats.misses == 1


def test_the_key_follows_what_the_encoding_reads(tmp_path):
    img = tmp_path / "first.png"
    img.write_bytes(b"one")
    c = Condition("c0", "p", image_path=str(img))
    k1 = ConditionCache.key(c, "enc")
    assert ConditionCache.key(c, "enc") == k1
    assert ConditionCache.key(c, "other encoder") != k1
    assert ConditionCache.key(Condition("c0", "p", image_path=str(img), negative_prompt="blur"), "enc") != k1
    img.write_bytes(b"a new first frame")
    os.utime(img, ns=(1, 2))
    assert ConditionCache.key(c, "enc") != k1
    pix = Condition("c0", "p", image=torch.zeros(4, 4, 3, dtype=torch.uint8))
    pix2 = Condition("c0", "p", image=torch.ones(4, 4, 3, dtype=torch.uint8))
    assert ConditionCache.key(pix, "enc") != ConditionCache.key(pix2, "enc")
