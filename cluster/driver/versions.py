"""Which weights each rollout actor holds: the one owner of the newest version published, its
record, and the version every actor holds.

The fleet marks what an actor took as its calls return (`took`, `reported`, `lost`); the
publisher advances the version and keeps the record (`published`, `keep`). Nothing else writes
these; both read them here.
"""

from __future__ import annotations

from common.weights_record import WeightsRecord


class Versions:
    def __init__(self, n_actors: int):
        self.current = 0                         # newest version published (step, or step + 1: EMA)
        self.record: WeightsRecord | None = None  # the newest version's record (collective: on request)
        self.wants_record = False                # an actor is behind and there is no record to give it
        self._held = [0] * n_actors              # the version each actor holds (-1: restarting)

    def holds(self, i: int) -> int:
        """The version actor i holds (a restarting one holds v0 at least)."""
        return max(self._held[i], 0)

    def behind(self, i: int) -> bool:
        return self.holds(i) < self.current

    def restarting(self, i: int) -> bool:
        """Actor i failed and has not taken weights since."""
        return self._held[i] == -1

    def took(self, i: int, version: int) -> None:
        """Actor i loaded `version` (a set_weights call or a broadcast returned)."""
        self._held[i] = version

    def reported(self, i: int, version: int) -> None:
        """Actor i generated a group with `version` (it may have loaded it from the registry)."""
        self._held[i] = max(self._held[i], version)

    def lost(self, i: int) -> bool:
        """Actor i failed: it takes the newest version before its next group. True at the first
        failure since it last took weights."""
        first = self._held[i] != -1
        self._held[i] = -1
        return first

    def ask_record(self) -> None:
        """An actor is behind and there is no record to give it: the training thread makes one."""
        self.wants_record = True

    def has_newest_record(self) -> bool:
        return self.record is not None and self.record.version >= self.current

    def published(self, version: int) -> None:
        self.current = version

    def keep(self, record: WeightsRecord | None) -> None:
        self.record = record

    def served(self) -> None:
        self.wants_record = False
