"""Weight publishing: the learner's newest weights become the version rollout actors load next.

Object store: rank 0 packs the payload into one object; the driver keeps its `WeightsRecord`
(the ref, never the bytes) and gives it to each actor before its next group, and to the weight
registry, where a restarted actor finds it. Collective: rank 0 broadcasts to every rollout actor
in the weight group at once, so a publish waits until no member is mid-group.

Collective and restarts. The group is formed again whenever its members change
(cluster/driver/members.py). An actor that is not in it (restarted, or late to answer) stays
behind the new version, and gets it as a running actor does: broadcast to it bucket by bucket,
in a group of the actors that are behind (`serve_record`, on the training thread, when the
fleet found one that is back and idle and asked: `Versions.wants_record`; the next publish
forms the whole group again). No record is made and the registry holds none: a whole version
in the object store would be the whole payload at once (28.6 GB for Wan 2.2 full fine-tuning,
against a 16 GiB /dev/shm), and a restarted actor's constructor would map it.
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
                 timers: dict[str, float], metrics, learner_died: Callable[[str], StopRun]):
        self.cfg, self.learner, self.fleet, self.registry = cfg, learner, fleet, registry
        self.on_learner_error, self.timers, self.metrics = on_learner_error, timers, metrics
        self.learner_died = learner_died          # the stop for a dead learner (the driver adds how to resume)
        self.versions = fleet.versions            # the version and record are kept there, with the actors'
        self.published = 0                        # newest step whose weights the rollout actors may load
        self.ema = False                          # whether that version is the moving average
        self.group = GroupMembers(fleet, cfg.weight_sync.timeout_s)

    def publish(self, step: int, ema: bool = False) -> None:
        """Publish the weights after `step` (ema: their moving average, as version step + 1)."""
        t0 = time.monotonic()
        version = step + int(ema)
        if self.cfg.weight_sync.transport == "object_store":
            self._keep(self._record(version, ema))
        else:
            self._broadcast(version, ema)
        self.versions.published(version)
        self.ema, self.published = ema, step
        seconds = time.monotonic() - t0
        self.timers["publish"] += seconds
        self.metrics.observe("vgrpo_weight_sync_seconds", seconds)

    def serve_record(self, now: bool = False) -> WeightsRecord | None:
        """The newest version for actors that are behind it, when one asked (`now`: whether or not):
        collective, broadcast to those back and idle; object store, the kept record. Call only
        from the training thread: the learner's ranks must see their calls in one order."""
        v = self.versions
        if v.wants_record or now:
            if self.cfg.weight_sync.transport == "collective":
                self._serve_behind()
            elif not v.has_newest_record():
                self._keep(self._record(v.current, self.ema))
        v.served()
        return v.record

    def _serve_behind(self) -> None:
        """Broadcast the newest version, bucket by bucket, to the actors behind it that are back
        and idle, in a group of their own (a new generation; the next publish forms the whole
        group again). One that fails meanwhile restarts and is served when it is back."""
        import ray  # heavy: ray

        fleet, v = self.fleet, self.versions
        who = [i for i in range(len(fleet.actors))
               if v.behind(i) and i not in fleet.busy and i not in fleet.restarting]
        if not who:
            return
        try:
            self.learner.publish([fleet.actors[i] for i in who], [f"rollout actor {i}" for i in who],
                                 ema=self.ema, generation=self.group.apart())
        except ray.exceptions.RayError as e:
            self.on_learner_error()
            if isinstance(e, ray.exceptions.RayActorError):  # a learner rank, not a member
                raise self._learner_gone(v.current, e) from None
            self._lost(who, e)
            return
        for i in who:
            v.took(i, v.current)

    def _lost(self, who: list[int], err: Exception) -> None:
        """After a broadcast that failed: the actors that do not answer now failed (they restart
        and are served when back); the others stay behind and are served again when they ask."""
        import ray  # heavy: ray

        refs = {i: self.fleet.actors[i].ping.remote() for i in who}
        ray.wait(list(refs.values()), num_returns=len(refs), timeout=5.0)
        for i, ref in refs.items():
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.RayError:
                self.fleet.on_failure(i, err)

    @property
    def version(self) -> int:
        """The newest version published."""
        return self.versions.current

    def _record(self, version: int, ema: bool) -> WeightsRecord:
        """Rank 0 packs `version` into the object store. A learner that dies meanwhile (between
        its step and this call, as often as during the step) stops the run as in `Driver.train`."""
        import ray  # heavy: ray

        try:
            return self.learner.weights_record(version, self.cfg.weight_sync.checksum, ema)
        except ray.exceptions.RayActorError as e:
            self.on_learner_error()
            raise self._learner_gone(version, e) from None

    def _learner_gone(self, version: int, e: BaseException) -> StopRun:
        return self.learner_died(f"weight sync of version {version} failed: the learner died ({_why_lost(e)})")

    def _keep(self, record: WeightsRecord | None) -> None:
        self.registry.set.remote(record)  # a restarted actor's source (None: nothing kept)
        self.versions.keep(record)

    def _broadcast(self, version: int, ema: bool) -> None:
        """One broadcast to the weight group, formed again first when its members changed; once
        more with a new group when a member failed during it. Actors left out are served later
        (`serve_record`), by broadcast too."""
        import ray  # heavy: ray

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
                    raise self._learner_gone(version, e) from None
                if attempt == 0:  # a member died mid-broadcast: once more, with whoever answers
                    self.group.invalidate()
                    continue
                raise StopRun(f"weight sync of version {version} failed: {type(cause).__name__}: "
                              f"{str(cause).splitlines()[0] if str(cause) else ''}") from None
        for i in members:
            self.versions.took(i, version)
        self.versions.published(version)


def _why_lost(e: BaseException) -> str:
    from common.dispatch import why_lost  # heavy: ray

    return why_lost(e)
