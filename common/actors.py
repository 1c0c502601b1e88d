"""Ending Ray actors so that, when the call returns, they are gone.

`ray.kill` only sends the request: a call submitted right after it can still run on the
old process. Callers that then free GPUs, remove placement groups or start replacements
need the process to have ended, so we wait until the actor reports itself dead.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import ray

log = logging.getLogger(__name__)


def kill_and_wait(actors: Iterable, timeout_s: float = 30.0) -> list:
    """Kill each actor (no restart) and wait until each is dead. Returns those still alive."""
    actors = list(actors)
    for a in actors:
        ray.kill(a, no_restart=True)
    deadline = time.monotonic() + timeout_s
    alive = []
    for a in actors:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                alive.append(a)
                break
            try:
                ray.get(a.__ray_ready__.remote(), timeout=min(left, 5.0))
            except ray.exceptions.RayActorError:
                break  # dead: what we wait for
            except ray.exceptions.GetTimeoutError:
                continue
            time.sleep(0.05)  # still answering: the kill has not landed yet
    if alive:
        log.warning("%d actor(s) still alive %.0fs after ray.kill", len(alive), timeout_s)
    return alive
