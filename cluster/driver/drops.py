"""Groups taken out on their way to the learner, and what the driver does about each.

A fresh group leaves the queue untrained when the bank finds it corrupt, when the learner's rank
0 finds it untrainable (quarantined) or sampled with other settings (learner/admit.py), or when
the learner's step raised on its batch (the batch is quarantined whole: no resume meets it again).
Each is counted by kind in the driver's counts, said in one line, and its cursor drawn again, so
the prompt stream does not change. Steps that raise TRAIN_FAILURES times in a row are the
learner's fault, not the data's: the run stops in one line (and checkpoints).
A group superseded by a later attempt of its cursor is dropped too, but not drawn again: that
attempt stands for the cursor (`superseded`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from cluster.driver.errors import StopRun
from cluster.driver.state import DriverState, cursor_of
from common.errors import last_line
from common.types import PullReceipt

TRAIN_FAILURES = 3  # learner steps failing in a row (each batch quarantined) before the run stops
# a dropped group's count, by the first word of its reason (PullReceipt.reasons)
COUNTS = {"corrupt": "groups_dropped", "quarantined": "groups_quarantined", "other settings": "groups_resampled"}


class Drops:
    def __init__(self, state: DriverState, note: Callable[[str], None]):
        self.state, self.note = state, note
        self.failures = 0   # learner steps failed in a row

    def refill(self, gids: list[str], reasons: dict[str, str]) -> None:
        """Fresh groups no longer queued: counted by kind, said once per reason, cursors drawn again."""
        s = self.state
        by_reason: dict[str, list[str]] = defaultdict(list)
        for g in gids:
            by_reason[reasons.get(g, "corrupt")].append(g)
        with s.lock:
            s.counts["groups_produced"] -= len(gids)
            for why, these in by_reason.items():
                s.counts[COUNTS[why.split(":")[0]]] += len(these)
        for n in filter(lambda n: n is not None, map(cursor_of, gids)):
            s.redraw(n)
        for why, these in by_reason.items():
            self.note(f"dropped {len(these)} fresh group(s) ({why}): {', '.join(these)}; "
                      "drawing their conditions again")

    def superseded(self, learner, pulled: PullReceipt, bank_call) -> bool:
        """Drop the pulled groups that no longer stand for their cursor (DriverState.superseded:
        a rollout actor that died between its push and its answer left its group queued, and the
        cursor was drawn again), untrained and not drawn again; the rest go back to the queue.
        Returns whether any was dropped (the step is then pulled again)."""
        stale = self.state.superseded(pulled.group_ids)
        if not stale:
            return False
        bank_call("drop superseded", learner.drop_pulled, stale)
        with self.state.lock:
            self.state.counts["groups_superseded"] += len(stale)
        self.note(f"dropped {len(stale)} fresh group(s) superseded by a later attempt of their "
                  f"condition (pushed by a rollout actor that died before it answered): {', '.join(stale)}")
        return True

    def train_or_quarantine(self, learner, pulled: PullReceipt, bank_call):
        """The step on the pulled batch, or None when it raised: the batch quarantined, its
        groups refilled. `bank_call(what, fn, *args)`: the driver's bank call (retries, fencing)."""
        import ray  # heavy: ray

        try:
            stats = learner.train_pulled(pulled)
        except ray.exceptions.RayTaskError as e:  # not a dead learner (RayActorError): the driver stops for that
            why = last_line(e)
            self.failures += 1
            gids, version = bank_call("quarantine", learner.quarantine_pulled, f"the step failed on it: {why}")
            with self.state.lock:
                self.state.counts["groups_pulled"] -= len(pulled.group_ids)
            self.refill(gids, dict.fromkeys(gids, f"quarantined: the step failed on it: {why}"))
            if version != self.state.step:   # it failed after the optimizer step: weights and step disagree
                raise StopRun(f"the learner's step failed after it updated the weights (version {version}, "
                              f"step {self.state.step}), with: {why}") from None
            if self.failures >= TRAIN_FAILURES:
                raise StopRun(f"{self.failures} steps in a row failed in the learner, the last "
                              f"with: {why}") from None
            return None
        self.failures = 0
        return stats
