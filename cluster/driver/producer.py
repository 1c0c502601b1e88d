"""async mode's producer: a thread that keeps the rollout fleet busy while the learner trains.

It dispatches a group to every free actor while `may_dispatch()` allows (the staleness window,
the bank's room, the step's weights published), collects receipts, and wakes the training loop
when groups land. When the run ends it lets the groups in flight land (up to 120 s, none after
Ctrl-C), so the open cursors and the counts are exact. An error in the thread stops the run
and is raised again in the training loop's thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from cluster.driver.fleet import RolloutFleet


class Producer:
    def __init__(self, fleet: RolloutFleet, may_dispatch: Callable[[], bool], stop: threading.Event,
                 poll_s: float):
        self.fleet, self.may_dispatch, self.stop, self.poll_s = fleet, may_dispatch, stop, poll_s
        self.produced = threading.Condition()
        self.done = threading.Event()
        self.error: list[BaseException] = []
        self.thread = threading.Thread(target=self._loop, name="vgrpo-producer", daemon=True)

    def __enter__(self) -> Producer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.wake()
        self.thread.join(timeout=600)
        if self.error and exc[0] is None:
            raise self.error[0]

    def wake(self) -> None:
        with self.produced:
            self.produced.notify_all()

    def wait_until(self, ready: Callable[[], bool], tick: Callable[[], object] | None = None) -> None:
        """Block the training loop until `ready()` or a stop, calling `tick()` on each wake-up
        (work only the training thread may do, such as making a weights record)."""
        with self.produced:
            while not ready() and not self.stop.is_set():
                self.produced.wait(timeout=self.poll_s)
                if tick is not None:
                    tick()

    def _loop(self) -> None:
        fleet = self.fleet
        try:
            while not self.done.is_set():
                for i in range(len(fleet.actors)):
                    if i not in fleet.busy and not self.done.is_set() and self.may_dispatch():
                        fleet.dispatch(i)
                if not fleet.busy:
                    with self.produced:
                        self.produced.wait(timeout=self.poll_s)
                    continue
                if fleet.collect(self.poll_s):
                    self.wake()
            # the run is over: let the groups in flight land, so `open` and the counts are exact
            deadline = time.monotonic() + (0 if self.stop.is_set() else 120)
            while fleet.busy and time.monotonic() < deadline:
                fleet.collect(self.poll_s)
        except BaseException as e:  # surfaced in the training loop's thread
            self.error.append(e)
            self.stop.set()
            self.wake()
