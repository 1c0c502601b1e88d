"""Where a restarted rollout actor finds the newest published weights.

A named, zero-CPU Ray actor that holds only an object ref to the newest payload; the
rollout actor's constructor asks it for `latest()` so a restart never trains on stale weights.
It hands out the ref, never the bytes: the actor reads the payload from the object store.
"""

from __future__ import annotations


class WeightRegistry:
    """Where a restarted rollout actor finds the newest published weights (`latest()`)."""

    def __init__(self):
        self.record: dict | None = None

    def set(self, version: int, boxed_ref: list) -> None:
        # the ref comes boxed in a list so Ray hands over the ref, not a copy of the weights
        self.record = {"version": version, "ref": boxed_ref[0]}

    def latest(self) -> dict | None:
        if self.record is None:
            return None
        # the ref inside a dict travels as a ref; the caller resolves it from the object store
        return {"version": self.record["version"], "weights": self.record["ref"], "checksum": None}


def remote_registry():
    import ray

    return ray.remote(WeightRegistry)
