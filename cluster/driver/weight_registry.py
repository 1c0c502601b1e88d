"""Where a restarted rollout actor finds the newest published weights.

A named, zero-CPU Ray actor that holds only an object ref to the newest payload; the
rollout actor's constructor asks it for `latest()` so a restart never trains on stale weights.
It hands out the ref, never the bytes: the actor reads the payload from the object store.
"""

from __future__ import annotations

from common.weights_record import WeightsRecord


class WeightRegistry:
    """Where a restarted rollout actor finds the newest published weights (`latest()`)."""

    def __init__(self):
        self.record: WeightsRecord | None = None

    def set(self, record: WeightsRecord) -> None:
        # the payload's ref inside the record travels as a ref: the registry never holds the bytes
        self.record = record

    def latest(self) -> WeightsRecord | None:
        """The newest record, checksum included: a restarted actor verifies what it loads."""
        return self.record


def remote_registry():
    import ray  # heavy: ray

    return ray.remote(WeightRegistry)


def start_registry(name: str):
    """The run's registry, pinned to the driver's node: it lives as long as the run (a node
    that dies takes the driver with it only if it is the driver's), and holds no resources."""
    # heavy: ray
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    return remote_registry().options(name=name, num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
        here, soft=False)).remote()
