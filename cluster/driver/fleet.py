"""The rollout pool as the driver steers it: dispatch a group to a free actor, collect its events.

Each group goes through its actor as up to three calls submitted at once: `set_weights` (when
the actor is behind), `stage` (generate) and `deliver` (score and push). Each phase has its own
deadline: weight_sync.timeout_s, sampler.timeout_s, then every reward try plus a Redis outage.
A group that fails (actor death, a deadline, a reward failure, an invalid reward) is drawn again
from the same cursor; `MAX_FAILED_IN_ROW` failures one after another stop the run. An actor past
its deadline is killed and restarted by Ray; it reloads the newest weights before its next group.

An actor behind the newest version (cluster/driver/versions.py) is given its record before its next group. With
the collective transport the driver keeps no record, so an actor that is behind is not
dispatched: it sets `wants_record`, and the training thread (the only one that calls the
learner) broadcasts the version to it bucket by bucket (`serve_record`, cluster/driver/publish.py).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cluster.driver.errors import ConfigStop, LeaseStop, StopRun
from cluster.driver.state import DriverState, group_id
from cluster.driver.stream import PromptStream
from cluster.driver.versions import Versions
from common.types import GroupReceipt
from common.weights_record import WeightsRecord

log = logging.getLogger("vgrpo.driver")

MAX_FAILED_IN_ROW = 12  # groups failing one after another (dead actor, broken reward): stop
PROBE_S = 1.0            # how often a restarting actor is asked whether it is back
RESTART_TIMEOUT_S = 900.0  # an actor not back this long after it failed is lost: stop


@dataclass
class Flight:
    """One group on its way through a rollout actor: weights, then stage, then deliver."""

    cursor: int
    gid: str
    stage: Any                      # ObjectRef of the stage call
    deliver: Any                    # ObjectRef of the deliver call (submitted with it)
    sync: Any = None                # ObjectRef of a set_weights call before it, or None
    sync_version: int = -1
    deadline: float = 0.0           # of the phase now running
    staged: bool = False


class RolloutFleet:
    def __init__(self, cfg, actors: list, state: DriverState, stream: PromptStream, *,
                 versions: Versions, on_sync_error: Callable[[], None],
                 timers: dict[str, float], metrics, note: Callable[[str], None],
                 serve_record: Callable[[], WeightsRecord | None] | None = None):
        self.cfg, self.actors, self.state, self.stream = cfg, actors, state, stream
        self.versions, self.on_sync_error = versions, on_sync_error  # who holds which weights (publisher's too)
        # who makes the newest version's record when an actor asks for one (collective)
        self.serve_record = serve_record or (lambda: versions.record)
        self.timers, self.metrics, self.note = timers, metrics, note
        self.restarting: dict[int, list] = {}   # failed actor -> [ping ref, asked at, failed at]
        self.failed_since_group: set[int] = set()  # failures seen since the weight group last formed
        self.busy: dict[int, Flight] = {}       # actor index -> its group in flight
        self.group_bytes = 0                    # the largest group stored (bank space per group)
        self.receipts: deque[GroupReceipt] = deque(maxlen=100_000)  # what the actors reported
        self.failed_in_row = 0
        self.restarting_in_row = 0              # groups refused by a reward replica Ray is restarting

    # --- dispatch -------------------------------------------------------------------------------

    def behind(self, i: int) -> bool:
        """Actor i holds an older version than the newest published (a restarted one holds v0 at least)."""
        return self.versions.behind(i)

    def dispatch(self, i: int) -> bool:
        """Give rollout actor i its next group (its weights first when it is behind). False when
        it is behind and no record of the newest version exists yet (`wants_record` is set)."""
        actor, cfg = self.actors[i], self.cfg
        if not self.back(i):
            return False
        sync, sync_version = None, -1
        latest = self.versions.record
        if self.behind(i):
            if not self.versions.has_newest_record():
                self.versions.ask_record()  # never a group from older weights than the newest published
                return False
            # by reference: the actor maps the packed payload from the object store
            sync = actor.set_weights.remote(latest.weights, latest.version, latest.checksum)
            sync_version = latest.version
        cond, seed, cursor = self.stream.next()
        version = sync_version if sync is not None else self.versions.holds(i)
        gid = group_id(cursor, version, self.state.attempts[cursor])
        deadline = time.monotonic() + (cfg.weight_sync.timeout_s if sync is not None else cfg.sampler.timeout_s)
        self.busy[i] = Flight(cursor, gid, actor.stage.remote(cond, seed, gid, cursor), actor.deliver.remote(gid),
                              sync, sync_version, deadline)
        return True

    def abandon(self, n: int) -> None:
        """A drawn group that failed before it was stored: its cursor is drawn again next."""
        self.state.redraw(n)
        self.failed_in_row += 1
        if self.failed_in_row >= MAX_FAILED_IN_ROW:
            raise StopRun(f"{self.failed_in_row} groups in a row failed to generate or score; "
                          "see the log for each failure")

    # --- collect --------------------------------------------------------------------------------

    def collect(self, timeout: float) -> list[GroupReceipt]:
        """Wait up to `timeout` for the next event of any group in flight; handle what arrived."""
        import ray  # heavy: ray

        if not self.busy:  # every actor is restarting or waits for a record: nothing to wait on
            time.sleep(timeout)
            return []
        refs = {(f.sync if f.sync is not None else (f.deliver if f.staged else f.stage)): i
                for i, f in self.busy.items()}
        nearest = min(f.deadline for f in self.busy.values())
        ready, _ = ray.wait(list(refs), num_returns=1, timeout=max(0.0, min(timeout, nearest - time.monotonic())))
        got = [rec for ref in ready if (rec := self._on_event(refs[ref], ref)) is not None]
        now = time.monotonic()
        for i, f in list(self.busy.items()):
            if f.deadline <= now and self.busy.get(i) is f:
                self._on_late(i, f)
        return got

    def wait_idle(self, poll_s: float) -> None:
        """Until no rollout actor has a group in flight (their receipts are collected)."""
        while self.busy:
            self.collect(poll_s)

    def _on_event(self, i: int, ref) -> GroupReceipt | None:
        import ray  # heavy: ray

        f = self.busy[i]
        try:
            out = ray.get(ref)
        except ray.exceptions.RayActorError as e:
            # a call to an actor Ray is still restarting is the same failure again, not a new one
            again = self.versions.restarting(i) and isinstance(e, ray.exceptions.ActorUnavailableError)
            del self.busy[i]
            self.restarting_in_row += again
            self.on_failure(i, e)
            self.state.redraw(f.cursor) if again else self.abandon(f.cursor)
            return None
        except ray.exceptions.RayTaskError as e:
            del self.busy[i]
            cause = getattr(e, "cause", None) or e
            if ref is f.sync:  # a checksum mismatch or a payload the model cannot load: no retry helps
                self.on_sync_error()
                raise StopRun(f"weight sync of version {f.sync_version} failed on rollout actor {i}: "
                              f"{cause}") from None
            self.note(f"rollout actor {i}: group {f.gid} failed ({type(cause).__name__}: "
                      f"{str(cause).splitlines()[0] if str(cause) else ''}); drawing it again")
            self.abandon(f.cursor)
            return None
        return self._advance(i, f, ref, out)

    def _advance(self, i: int, f: Flight, ref, out) -> GroupReceipt | None:
        """The next phase of a group whose call `ref` returned `out`; the receipt when delivered."""
        now = time.monotonic()
        if ref is f.sync:
            self.versions.took(i, f.sync_version)
            f.sync, f.deadline = None, now + self.cfg.sampler.timeout_s
            return None
        if not f.staged:
            f.staged, f.deadline = True, now + self._deliver_budget()
            self.versions.reported(i, int(out["version"]))
            return None
        del self.busy[i]
        self._on_receipt(out)
        return out

    def _deliver_budget(self) -> float:
        """The longest scoring and storing may take: every reward try, plus a Redis outage."""
        tries = max(m.timeout_s * (m.retries + 1) for m in self.cfg.rewards.models)
        return tries + self.cfg.bank.outage_s + 30.0

    def _on_late(self, i: int, f: Flight) -> None:
        if f.sync is not None:
            raise StopRun(f"weight sync of version {f.sync_version} timed out: rollout actor {i} did not "
                          f"answer within {self.cfg.weight_sync.timeout_s}s (weight_sync.timeout_s)")
        del self.busy[i]
        self._on_timeout(i, f.cursor, "generate" if not f.staged else "score and store")

    def _on_receipt(self, rec: GroupReceipt) -> None:
        s = self.state
        rec.step = s.step
        self.receipts.append(rec)
        with s.lock:
            for k in ("generate", "score", "store"):
                self.timers[k] += rec.seconds.get(k, 0.0)
            s.counts["reward_timeouts"] += rec.reward_timeouts
            s.counts["reward_failures"] += rec.reward_failures
        if rec.ok:
            self.group_bytes = max(self.group_bytes, rec.latent_bytes)
            with s.lock:
                s.open[rec.cursor] = rec.group_id
                s.counts["groups_produced"] += 1
                s.counts["videos"] += rec.size
            self.failed_in_row = self.restarting_in_row = 0
            return
        if rec.failure == "lease_lost":  # the bank refused this run's push: another run holds it
            raise LeaseStop(self.cfg.bank.namespace)
        if rec.failure == "fatal":  # the settings cannot work (a step that cannot fit the bank)
            raise ConfigStop(f"{rec.detail}; stopping")
        if rec.failure == "bank_unavailable":
            raise StopRun(f"{rec.detail}; stopping")
        s.counts["groups_refilled"] += 1
        if rec.failure == "reward_restarting":
            self._wait_for_reward(rec)
            return
        if rec.failure == "invalid":
            s.counts["invalid_members"] += rec.invalid_members
            self.metrics.inc("vgrpo_invalid_rewards_total", rec.invalid_members, head="any")
        self.note(f"group {rec.group_id} not stored ({rec.failure}: {rec.detail}); drawing it again")
        self.abandon(rec.cursor)

    # --- failures -------------------------------------------------------------------------------

    def _wait_for_reward(self, rec: GroupReceipt) -> None:
        """A reward replica is restarting (Ray restarts it, up to its max_restarts; after that its
        calls fail as a dead actor's, which do count): the group is drawn again after a backoff,
        and the failures in a row are not counted, so a slow restart on a busy machine cannot stop
        the run; a reward model that is really broken still does."""
        self.restarting_in_row += 1
        self.note(f"group {rec.group_id} not scored: a reward replica is restarting; drawing it again")
        self.state.redraw(rec.cursor)
        time.sleep(min(0.5 * self.restarting_in_row, 5.0))

    def _on_timeout(self, i: int, cursor: int, phase: str) -> None:
        """A rollout actor past its deadline (a hung device, a stuck kernel): restart it."""
        import ray  # heavy: ray

        self.state.counts["rollout_timeouts"] += 1
        self.metrics.inc("vgrpo_errors_total", 1, kind="rollout_timeout")
        limit = (f"within {self.cfg.sampler.timeout_s:.0f}s (sampler.timeout_s)" if phase == "generate"
                 else "in time (rewards.models[].timeout_s and retries, bank.outage_s)")
        self.note(f"rollout actor {i} did not {phase} its group {limit}; restarting it")
        ray.kill(self.actors[i], no_restart=False)  # Ray starts a fresh process
        self.on_failure(i, TimeoutError(phase))
        self.abandon(cursor)

    def on_failure(self, i: int, err: Exception) -> None:
        """A rollout actor died: Ray restarts it; it gets the current weights before it generates."""
        if self.versions.lost(i):  # the first failure since it last took weights: one restart
            self.state.counts["actor_restarts"] += 1  # exported with the step's record
            self.note(f"rollout actor {i} failed ({type(err).__name__}); it restarts and reloads weights")
        else:  # calls to an actor that is still restarting fail at once (ActorUnavailableError)
            log.debug("rollout actor %d still restarting (%s)", i, type(err).__name__)
        self.failed_since_group.add(i)  # and the collective weight group is formed again
        # while Ray restarts it (on another node, a model load: minutes) calls to it fail at once:
        # it gets no group until it answers a ping, so its restart burns no refills (see `back`)
        if i not in self.restarting:
            self.restarting[i] = [self.actors[i].ping.remote(), time.monotonic(), time.monotonic()]

    def back(self, i: int) -> bool:
        """Whether actor i can take a group: it never failed, or it answers again since."""
        import ray  # heavy: ray

        probe = self.restarting.get(i)
        if probe is None:
            return True
        ready, _ = ray.wait(probe[:1], timeout=0)
        if ready:
            try:
                ray.get(probe[0])
                del self.restarting[i]
                return True
            except ray.exceptions.RayError:  # still restarting: ask again, at most every PROBE_S
                now = time.monotonic()
                if now - probe[1] >= PROBE_S:
                    probe[:2] = [self.actors[i].ping.remote(), now]
        if time.monotonic() - probe[2] > RESTART_TIMEOUT_S:
            raise StopRun(f"rollout actor {i} is not back {RESTART_TIMEOUT_S:.0f}s after it failed: Ray could "
                          "not restart it (see its log; pools.rollout.max_restarts); continue with vgrpo resume")
        return False

    # --- weights on idle actors -------------------------------------------------------------------

    def sync_idle(self, poll_s: float) -> None:
        """Every rollout actor holds the newest version (before an evaluation; actors are idle)."""
        import ray  # heavy: ray

        self.wait_idle(poll_s)
        behind = [i for i in range(len(self.actors)) if self.behind(i)]
        if not behind:
            return
        latest = self.versions.record
        if not self.versions.has_newest_record():
            # collective: no record; broadcast now (this is the training thread) to every actor
            # behind, once each is back (one not back in RESTART_TIMEOUT_S stops the run)
            while not all([self.back(i) for i in behind]):
                time.sleep(PROBE_S)
            latest = self.serve_record()
        behind = [i for i in behind if self.behind(i)]
        if latest is None or not behind:
            return
        calls = {i: self.actors[i].set_weights.remote(latest.weights, latest.version, latest.checksum)
                 for i in behind}
        timeout = self.cfg.weight_sync.timeout_s
        _, late = ray.wait(list(calls.values()), num_returns=len(calls), timeout=timeout)
        if late:
            who = ", ".join(f"rollout actor {i}" for i, c in calls.items() if c in late)
            raise StopRun(f"weight sync of version {latest.version} timed out: {who} did not answer "
                          f"within {timeout}s (weight_sync.timeout_s)")
        for i, c in calls.items():
            try:
                ray.get(c)
                self.versions.took(i, latest.version)
            except ray.exceptions.RayActorError as e:  # restarting: it loads the registry's weights
                self.on_failure(i, e)
