"""The driver's state: what a checkpoint records and a resume restores, defined once.

`DriverState` is the recipe state in one place (torchtune's habit): the optimizer step, the
prompt-stream cursor, the groups drawn but not trained, the counters, and the groups trained
whose commit Redis missed. The prompt stream, the rollout fleet and the training loop all read
and write this one object, under its lock. Group ids carry the cursor and version they were drawn
at, so a resume can tell from the bank alone which groups still count.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from learner.checkpoint import CheckpointError

SAVED = ("step", "cursor", "open", "counts", "uncommitted", "skipped_in_a_row")  # what extra.json holds


def group_id(cursor: int, version: int, attempt: int = 0) -> str:
    """Group ids carry the prompt-stream cursor they were drawn at (see cursor_of); a group
    drawn again after a failure gets an attempt suffix, so no two pushes share an id."""
    return f"g{cursor:07d}-v{version}" + (f"-a{attempt}" if attempt else "")


def cursor_of(gid: str) -> int | None:
    head = gid.split("-", 1)[0]
    return int(head[1:]) if head[:1] == "g" and head[1:].isdigit() else None


def version_of(gid: str) -> int | None:
    """The policy version in a group id `g0000012-v3[-a1]`, or None for another id."""
    part = gid.split("-")[1:2]
    return int(part[0][1:]) if part and part[0][:1] == "v" and part[0][1:].isdigit() else None


def attempt_of(gid: str) -> int:
    """The attempt in a group id `g0000012-v3-a1` (0 without the suffix)."""
    last = gid.rsplit("-", 1)[-1]
    return int(last[1:]) if gid.count("-") >= 2 and last[:1] == "a" and last[1:].isdigit() else 0


@dataclass
class DriverState:
    step: int = 0                   # optimizer steps done == the learner's policy version
    cursor: int = 0                 # groups drawn from the prompt stream so far
    open: dict[int, str | None] = field(default_factory=dict)  # drawn, not yet trained: cursor -> pushed id
    counts: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    uncommitted: list[str] = field(default_factory=list)       # trained, but Redis was down for the commit
    # the last steps the finite-update guard skipped, in a row (health `numerics`): a resume goes on counting
    skipped_in_a_row: int = 0
    # not saved: a resume derives them from `open` and the bank
    replay: list[int] = field(default_factory=list)            # cursors drawn again before new ones
    attempts: defaultdict[int, int] = field(default_factory=lambda: defaultdict(int))  # cursor -> failures
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def redraw(self, n: int) -> None:
        """Cursor n goes back to the head of the stream: the same condition, a new seed."""
        with self.lock:
            self.open[n] = None
            self.attempts[n] += 1
            if n not in self.replay:
                self.replay.insert(0, n)

    def superseded(self, gids: list[str]) -> list[str]:
        """The pulled groups that no longer stand for their cursor: an attempt the cursor was drawn
        again after (a push that landed though its actor died before it could say so), another
        attempt than the one the cursor received, or a cursor already trained."""
        out = []
        with self.lock:
            for g in gids:
                n = cursor_of(g)
                if n is None:
                    continue
                if n not in self.open:
                    out.append(g)                           # trained already
                elif (have := self.open[n]) is not None:
                    if have != g:
                        out.append(g)                       # the cursor received another attempt
                elif attempt_of(g) < self.attempts[n]:
                    out.append(g)                           # drawn again since this attempt
        return out

    def saved(self) -> dict[str, Any]:
        """The fields a checkpoint records (JSON-ready)."""
        with self.lock:
            return {"step": self.step, "cursor": self.cursor,
                    "open": {str(c): g for c, g in self.open.items()},
                    "counts": dict(self.counts), "uncommitted": list(self.uncommitted),
                    "skipped_in_a_row": self.skipped_in_a_row}

    @classmethod
    def from_saved(cls, extra: dict[str, Any], where: str) -> DriverState:
        """The state a checkpoint recorded, checked field by field (CheckpointError names it)."""
        def need(name: str, ok, what: str):
            value = extra.get(name)
            if not ok(value):
                raise CheckpointError(f"{where}: field {name!r} must be {what}, got {_short(value)}")
            return value

        is_count = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0  # noqa: E731
        step = need("step", is_count, "a whole number >= 0")
        cursor = need("cursor", is_count, "a whole number >= 0")
        opened = need("open", lambda v: v is None or (isinstance(v, dict) and all(
            str(k).isdigit() and (g is None or isinstance(g, str)) for k, g in v.items())),
            "a map of cursor -> group id or null") or {}
        counts = need("counts", lambda v: v is None or (isinstance(v, dict) and all(
            isinstance(k, str) and is_count(n) for k, n in v.items())), "a map of name -> count") or {}
        uncommitted = need("uncommitted", lambda v: v is None or (isinstance(v, list) and all(
            isinstance(g, str) for g in v)), "a list of group ids") or []
        # absent from checkpoints written before it was kept: 0, as those runs' resumes counted
        in_a_row = need("skipped_in_a_row", lambda v: v is None or is_count(v), "a whole number >= 0") or 0
        return cls(step=step, cursor=cursor, open={int(c): g for c, g in opened.items()},
                   counts=defaultdict(int, counts), uncommitted=list(uncommitted), skipped_in_a_row=in_a_row)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"
