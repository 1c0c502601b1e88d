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


class ByName:
    """A Ray actor passed by its name instead of its handle.

    An actor's constructor arguments that hold a handle are kept in Ray's object store (a handle
    carries a reference), and with max_restarts > 0 a restart fails once they are lost (Ray
    issue 53727). A name is plain data, passed by value; the handle is looked up (once per
    process) on first use, in the creating job's namespace. Attribute access is the handle's:
    `ByName("x").method.remote(...)`."""

    def __init__(self, name: str):
        self.name = name
        self._handle = None

    def __reduce__(self):
        return ByName, (self.name,)

    def __getattr__(self, attr: str):
        if attr.startswith("__") or attr in ("name", "_handle"):
            raise AttributeError(attr)
        if self._handle is None:
            self._handle = ray.get_actor(self.name)
        return getattr(self._handle, attr)

    def __repr__(self) -> str:
        return f"ByName({self.name!r})"
