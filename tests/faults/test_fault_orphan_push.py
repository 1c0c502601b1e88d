"""A rollout actor that dies between its push and its answer, on a real run (Ray, the real
redis-server, the toy model). Its group is in the bank, but the driver never heard of it and drew
the cursor again; without `Drops.superseded` both attempts were trained (the cursor twice, and a
later cursor left queued at the end), as tests/test_multinode.py met when its rollout node died
at that moment."""

from __future__ import annotations

import pytest
from fault_helpers import Ledger, Lines, tiny_cfg

from cluster.driver.driver import Driver
from cluster.driver.state import attempt_of, cursor_of
from cluster.runs.run_dir import RunDir

pytestmark = pytest.mark.timeout(900)
STEPS = 3


def _arm_die_after_the_first_push(rollout) -> None:
    """The rollout actor's next push lands in the bank, then its process exits before the call
    can answer (as a node that fails at that moment)."""
    import ray

    def arm(self):  # defined here: sent to the actor by value
        import os

        bank = self._open_bank()
        real = bank.push_group

        def push_then_die(group):
            real(group)
            os._exit(1)
        bank.push_group = push_then_die

    ray.get(rollout.__ray_call__.remote(arm), timeout=60)


@pytest.fixture(scope="module")
def orphaned(ray_session, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("orphan")
    cfg = tiny_cfg(tmp, "o", steps=STEPS)
    console = Lines()
    driver = Driver(cfg, RunDir.create(cfg), console=console)
    try:
        driver.setup()
        ledger = Ledger(driver)
        _arm_die_after_the_first_push(driver.rollouts[0])
        driver.run()
        bank = driver.bank
        out = {"stop": driver.stop_reason, "step": driver.step, "counts": dict(driver.counts),
               "trained": ledger.trained, "pushed": [g for g, _, _ in ledger.pushed],
               "queued": bank.queued_ids(), "dead": [g.decode() for g in bank.r.lrange(bank.keys.dead, 0, -1)],
               "lines": list(console.lines)}
    finally:
        driver.teardown()
    return out


def test_the_orphaned_push_is_dropped_and_its_redraw_trained_once(orphaned):
    o = orphaned
    assert o["stop"] is None and o["step"] == STEPS
    assert o["counts"]["actor_restarts"] >= 1 and o["counts"]["groups_superseded"] == 1
    # the group nobody answered for: in the bank (trained, dropped or queued), never in a receipt
    (orphan,) = [g for g in {*o["trained"], *o["dead"], *o["queued"]} if g not in o["pushed"]]
    assert attempt_of(orphan) == 0 and orphan in o["dead"] and orphan not in o["trained"]
    redraw = [g for g in o["trained"] if cursor_of(g) == cursor_of(orphan)]
    assert len(redraw) == 1 and attempt_of(redraw[0]) >= 1
    # every cursor trained once, every answered push trained, nothing left queued
    assert sorted(cursor_of(g) for g in o["trained"]) == list(range(2 * STEPS))
    assert sorted(o["trained"]) == sorted(o["pushed"]) and o["queued"] == []
    assert any("superseded by a later attempt" in line and orphan in line for line in o["lines"])
