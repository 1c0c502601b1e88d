"""A resume: the driver's state as the checkpoint recorded it, reconciled with the bank.

The bank may hold more than the checkpoint knew of: groups the lost run sampled after it (their
version numbers will be reused by other weights, so they go), groups queued at the checkpoint
(trained as they are), and cursors drawn but never queued (drawn again).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from cluster.driver.state import DriverState, cursor_of, version_of
from memory_bank.dump import restore_bank
from memory_bank.dump import step_dir as bank_step_dir


def restore(state: DriverState, extra: dict[str, Any], ckpt: Path, bank,
            commit_ids: Callable[[list[str], int], int], note: Callable[[str], None]) -> None:
    """Restore `state` from a checkpoint's `extra` and the bank's dump beside it."""
    saved = DriverState.from_saved(extra, f"{ckpt}/extra.json")
    note(restore_bank(bank, bank_step_dir(ckpt, saved.step)))  # before any requeue
    state.step, state.cursor, state.skipped_in_a_row = saved.step, saved.cursor, saved.skipped_in_a_row
    state.counts.update(saved.counts)
    bank.requeue_pending()
    if saved.uncommitted:  # groups the saved learner trained, whose commit Redis missed
        n = commit_ids(saved.uncommitted, state.step)
        note(f"committed {n} groups trained before the last stop")
    if extra.get("bank"):
        bank.restore(extra["bank"])
    reconcile(state, bank, set(saved.open), note)


def reconcile(state: DriverState, bank, opened: set[int], note: Callable[[str], None]) -> None:
    """Drop what the lost run sampled after the checkpoint, keep the queued groups, and draw
    again every cursor that was drawn (`opened`) but is not queued."""
    # what the lost run sampled after the checkpoint carries version numbers the resumed learner
    # reuses for other weights: it would pass as on-policy, so it goes (its cursors drawn again)
    lost = [g for g in bank.queued_ids() if (v := version_of(g)) is not None and v > state.step]
    groups, entries = bank.discard(lost, after_version=state.step)
    if groups or entries:
        note(f"discarded {groups} queued groups and {entries} bank entries sampled after the "
             f"checkpoint (step {state.step}) by weights this resume rolls back")
    # Groups still queued are trained as they are; groups drawn but not queued (in flight at the
    # checkpoint, or trained only by the lost run after it) are drawn again from their cursors.
    queued = bank.queued_ids()
    present = {c: g for g in queued if (c := cursor_of(g)) is not None}
    top = max([state.cursor - 1, *present]) + 1
    state.replay = sorted((opened | set(range(state.cursor, top))) - set(present))
    state.cursor = top
    state.open = {**{c: None for c in state.replay}, **present}
    # one per cursor: of two queued attempts of one cursor, the other is superseded at its pull
    state.counts["groups_produced"] = state.counts["groups_trained"] + len(present)
    state.counts["groups_pulled"] = state.counts["groups_trained"]  # pending groups were requeued
