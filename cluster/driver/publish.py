"""Weight publishing: the learner's newest weights become the version rollout actors load next.

Object store: rank 0 packs the payload into one object; the driver keeps its `WeightsRecord`
(the ref, never the bytes) and gives it to each actor before its next group, and to the weight
registry, where a restarted actor finds it. Collective: rank 0 broadcasts to every rollout actor
in the weight group at once, so a publish waits until no member is mid-group.

Collective and restarts. The group is formed again whenever its members change
(cluster/driver/members.py). An actor that is not in it (restarted, or late to answer) stays
behind the new version; before it generates it gets the version's record, as in the object
store transport. The driver keeps such a record only while somebody needs one: a publish that
leaves an actor out makes it at once; an actor that restarts after the publish asks for it
(`RolloutFleet.wants_record`), and the training thread makes it (`serve_record`). Either way it
goes to the weight registry too, where a restarted actor's constructor finds it. A publish that
every actor took drops the record (its bytes leave the object store).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from cluster.driver.errors import StopRun
from cluster.driver.fleet import RolloutFleet
from cluster.driver.members import GroupMembers
from common.weights_record import WeightsRecord


class Publisher:
    def __init__(self, cfg, learner, fleet: RolloutFleet, registry, *, on_learner_error: Callable[[], None],
                 timers: dict[str, float], metrics):
        self.cfg, self.learner, self.fleet, self.registry = cfg, learner, fleet, registry
        self.on_learner_error, self.timers, self.metrics = on_learner_error, timers, metrics
        self.versions = fleet.versions            # the version and record are kept there, with the actors'
        self.published = 0                        # newest step whose weights the rollout actors may load
        self.ema = False                          # whether that version is the moving average
        self.group = GroupMembers(fleet, cfg.weight_sync.timeout_s)

    def publish(self, step: int, ema: bool = False) -> None:
        """Publish the weights after `step` (ema: their moving average, as version step + 1)."""
        t0 = time.monotonic()
        version = step + int(ema)
        if self.cfg.weight_sync.transport == "object_store":
            self._keep(self.learner.weights_record(version, self.cfg.weight_sync.checksum, ema))
        else:
            self._broadcast(version, ema)
        self.versions.published(version)
        self.ema, self.published = ema, step
        seconds = time.monotonic() - t0
        self.timers["publish"] += seconds
        self.metrics.observe("vgrpo_weight_sync_seconds", seconds)

    def serve_record(self) -> WeightsRecord | None:
        """Collective: the newest version's record, made now if an actor asked for one and none is
        kept. Call only from the training thread: the learner's ranks must see their calls in one
        order."""
        v = self.versions
        if v.wants_record and not v.has_newest_record():
            self._keep(self.learner.weights_record(v.current, self.cfg.weight_sync.checksum, self.ema))
        v.served()
        return v.record

    @property
    def version(self) -> int:
        """The newest version published."""
        return self.versions.current

    def _keep(self, record: WeightsRecord | None) -> None:
        self.registry.set.remote(record)  # a restarted actor's source (None: nothing kept)
        self.versions.keep(record)

    def _broadcast(self, version: int, ema: bool) -> None:
        """One broadcast to the weight group, formed again first when its members changed; once
        more with a new group when a member failed during it. Actors left out get the record."""
        import ray  # heavy: ray

        from common.dispatch import why_lost  # heavy: ray

        fleet = self.fleet
        for attempt in range(2):
            members, generation = self.group.form()
            if not members:
                break
            try:
                self.learner.publish([fleet.actors[i] for i in members], [f"rollout actor {i}" for i in members],
                                     ema=ema, generation=generation)
                break
            except ray.exceptions.RayError as e:
                cause = getattr(e, "cause", None) or e  # WeightSyncTimeout names the late peer
                self.on_learner_error()
                if isinstance(e, ray.exceptions.RayActorError):  # a learner rank, not a member: no retry
                    raise StopRun(f"weight sync of version {version} failed: the learner died ({why_lost(e)})") from None
                if attempt == 0:  # a member died mid-broadcast: once more, with whoever answers
                    self.group.invalidate()
                    continue
                raise StopRun(f"weight sync of version {version} failed: {type(cause).__name__}: "
                              f"{str(cause).splitlines()[0] if str(cause) else ''}") from None
        for i in members:
            self.versions.took(i, version)
        self.versions.published(version)
        left_out = [i for i in range(len(fleet.actors)) if fleet.behind(i)]
        self._keep(self.learner.weights_record(version, self.cfg.weight_sync.checksum, ema)
                   if left_out else None)

