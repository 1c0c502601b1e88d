"""The prompt stream: an epoch-wise permutation of the prompts, a seed per group, the cursor.

A cursor drawn again after a failure keeps its condition; its seed changes with the attempt,
so a failure the seed caused is not repeated, and the stream after it is the stream of a run
without the failure.
"""

from __future__ import annotations

import numpy as np

from cluster.driver.state import DriverState
from common.types import Condition

SEED_SPACE = 1_000_000  # training seeds stay below the toy world's evaluation seeds


class PromptStream:
    def __init__(self, conditions: list[Condition], seed: int, state: DriverState):
        self.conditions, self.seed, self.state = conditions, seed, state

    def next(self) -> tuple[Condition, int, int]:
        """(condition, seed, cursor) of the next group; the cursor stays open until it is trained."""
        s = self.state
        with s.lock:
            if s.replay:
                n = s.replay.pop(0)
            else:
                n = s.cursor
                s.cursor += 1
            s.open[n] = None
            attempt = s.attempts[n]
        epoch, i = divmod(n, len(self.conditions))
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.conditions))
        key = [self.seed, 7, n] + ([attempt] if attempt else [])
        seed = int(np.random.default_rng(key).integers(SEED_SPACE))
        return self.conditions[order[i]], seed, n
