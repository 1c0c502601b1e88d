"""Weight publishing: the learner's newest weights become the version rollout actors load next.

Object store: rank 0 packs the payload into one object; the driver keeps its `WeightsRecord`
(the ref, never the bytes) and gives it to each actor before its next group, and to the weight
registry, where a restarted actor finds it. Collective: rank 0 broadcasts to every rollout actor
at once, so a publish waits until no actor is mid-group.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from cluster.driver.errors import StopRun
from cluster.driver.fleet import RolloutFleet
from common.weights import WeightsRecord


class Publisher:
    def __init__(self, cfg, learner, fleet: RolloutFleet, registry, *, on_learner_error: Callable[[], None],
                 timers: dict[str, float], metrics):
        self.cfg, self.learner, self.fleet, self.registry = cfg, learner, fleet, registry
        self.on_learner_error, self.timers, self.metrics = on_learner_error, timers, metrics
        self.latest: WeightsRecord | None = None  # object store: the newest published version
        self.published = 0                        # newest version the rollout actors may load

    def publish(self, step: int, ema: bool = False) -> None:
        """Publish the weights after `step` (ema: their moving average, as version step + 1)."""
        import ray

        t0 = time.monotonic()
        version = step + int(ema)
        if self.cfg.weight_sync.transport == "object_store":
            record = self.learner.weights_record(version, self.cfg.weight_sync.checksum, ema)
            self.registry.set.remote(record)  # a restarted actor's source
            self.latest = record
        else:
            try:
                self.learner.publish(self.fleet.actors, ema=ema)
            except ray.exceptions.RayError as e:
                cause = getattr(e, "cause", None) or e  # WeightSyncTimeout names the late peer
                self.on_learner_error()
                raise StopRun(f"weight sync of version {step} failed: {type(cause).__name__}: "
                              f"{str(cause).splitlines()[0] if str(cause) else ''}") from None
            self.fleet.actor_version = [version] * len(self.fleet.actors)
        self.published = step
        seconds = time.monotonic() - t0
        self.timers["publish"] += seconds
        self.metrics.observe("vgrpo_weight_sync_seconds", seconds)
