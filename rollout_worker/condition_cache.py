"""Encoded conditions, kept by the rollout actor that encoded them.

A condition is encoded once per actor, not once per group: the text encoder (UMT5-XXL on Wan, a
7B Qwen2.5-VL on HunyuanVideo 1.5) and the I2V first-frame VAE encode run on a miss only. The
encoders are frozen for the whole run, so an entry never goes stale; it is keyed by everything
the encoding reads: the condition's id, prompt, negative prompt and first frame (its file's
path, size and mtime, or the in-memory pixels' digest) and what encodes it
(`encoder_fingerprint`). Bounded by entries and bytes, least recently used out first.

Owns: the actor's cache of encoded conditions (the same `Cond` object is handed to every group of
its condition).
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from dataclasses import dataclass

from common.types import Cond, Condition


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0


def _nbytes(cond: Cond) -> int:
    parts = [*cond.tensors.values(), *(cond.uncond or {}).values()]
    return sum(t.numel() * t.element_size() for t in parts)


def _image_key(condition: Condition) -> tuple:
    if condition.image is not None:
        return ("pixels", hashlib.blake2b(condition.image.contiguous().numpy().tobytes(), digest_size=16).hexdigest())
    if condition.image_path is None:
        return ()
    try:  # a local file: a changed file is a new condition; a remote one is keyed by its path alone
        st = os.stat(condition.image_path)
        return ("file", condition.image_path, st.st_size, st.st_mtime_ns)
    except OSError:
        return ("file", condition.image_path)


class ConditionCache:
    """`encoded(key, encode)`: the cached Cond of `key`, else `encode()`'s, kept."""

    def __init__(self, max_entries: int, max_bytes: int):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[tuple, tuple[Cond, int]] = OrderedDict()
        self.nbytes = 0
        self.stats = CacheStats()

    @staticmethod
    def key(condition: Condition, encoder: str) -> tuple:
        return (condition.id, condition.prompt, condition.negative_prompt, _image_key(condition), encoder)

    def encoded(self, key: tuple, encode) -> Cond:
        hit = self._entries.get(key)
        if hit is not None:
            self._entries.move_to_end(key)
            self.stats.hits += 1
            return hit[0]
        self.stats.misses += 1
        cond = encode()
        size = _nbytes(cond)
        if self.max_entries > 0 and size <= self.max_bytes:
            self._entries[key] = (cond, size)
            self.nbytes += size
            while len(self._entries) > self.max_entries or self.nbytes > self.max_bytes:
                _, (_, dropped) = self._entries.popitem(last=False)
                self.nbytes -= dropped
                self.stats.evictions += 1
        return cond

    def __len__(self) -> int:
        return len(self._entries)
