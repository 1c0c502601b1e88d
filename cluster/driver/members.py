"""Who is in the collective weight group, and which generation of it is current.

A process group cannot take a new process in place of one that died: a restarted rollout actor
is a new process with no group at all, and a broadcast over the old group fails ("Connection
closed by peer" on gloo; a hang until the watchdog on NCCL). So before each collective publish
the driver asks every rollout actor who it is (`ping()`'s incarnation, new in each process) and
forms the group again, under a new generation number, whenever its members change:
- an actor that restarted, whether the fleet saw it fail or it died idle and nobody saw it;
- an actor that does not answer in time (restarting, or stuck in a long group) is left out;
  it stays behind the new version, so the fleet gives it the version's record before its
  next group, and it is back in the group formed at the next publish.
Learner rank 0 forms a fresh group (new store, port and key prefix) when the generation
changes (learner.actor.LearnerRank.publish); every member joins it afresh.
"""

from __future__ import annotations

import logging

from cluster.driver.fleet import RolloutFleet

log = logging.getLogger("vgrpo.driver")


class ActorRestarted(RuntimeError):
    """A rollout actor answered as a new process: it died and Ray restarted it unseen."""


class GroupMembers:
    def __init__(self, fleet: RolloutFleet, timeout_s: float):
        self.fleet, self.timeout_s = fleet, timeout_s
        self.generation = 0
        self.members: tuple[tuple[int, str], ...] = ()  # (actor index, incarnation) of the group
        self.known: dict[int, str] = {}                 # the last incarnation each actor answered with
        self.elsewhere = False                          # the learner's group is one formed `apart`

    def form(self) -> tuple[list[int], int]:
        """The actors of the group for this publish, and its generation (new when they changed)."""
        answers = self._ask()
        fleet = self.fleet
        for i, incarnation in answers.items():
            if self.known.get(i, incarnation) != incarnation and i not in fleet.failed_since_group:
                fleet.on_failure(i, ActorRestarted(f"rollout actor {i} is a new process"))
        self.known.update(answers)
        members = tuple(sorted(answers.items()))
        if members != self.members or self.elsewhere:
            self.generation += 1
            self.members, self.elsewhere = members, False
            log.info("weight group generation %d: rollout actors %s", self.generation,
                     [i for i, _ in members])
        fleet.failed_since_group -= set(answers)  # those that did not answer are still to be seen
        return [i for i, _ in members], self.generation

    def apart(self) -> int:
        """A generation for a group formed apart from this one (the actors left behind, served by
        the publisher); the next `form` makes a new one again, so the whole group forms afresh."""
        self.generation += 1
        self.elsewhere = True
        return self.generation

    def invalidate(self) -> None:
        """The group broke during a publish: the next `form` builds a new one, whoever answers."""
        self.members = ()

    def _ask(self) -> dict[int, str]:
        """Each rollout actor's incarnation, for those that answer: the steady ones within the
        timeout (an actor finishing a group answers after it), a restarting one only if it is
        already back (a slow model load must not hold the publish)."""
        import ray  # heavy: ray

        fleet = self.fleet
        refs = {i: a.ping.remote() for i, a in enumerate(fleet.actors)}
        steady = [r for i, r in refs.items() if not fleet.versions.restarting(i)]
        if steady:
            ray.wait(steady, num_returns=len(steady), timeout=self.timeout_s)
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=0)
        out = {}
        for i, ref in refs.items():
            if ref not in ready:
                log.info("rollout actor %d did not answer in time: left out of this weight group", i)
                continue
            try:
                out[i] = ray.get(ref)["incarnation"]
            except ray.exceptions.RayError as e:  # died or restarting: it gets the record later
                fleet.on_failure(i, e)
        return out
