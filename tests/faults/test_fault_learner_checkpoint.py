"""A learner that dies while writing a checkpoint, on a real run (Ray, the real redis-server,
the toy model): the run stops in one line that says so, and the last committed checkpoint
stands. Before, the actor's death came out of `Driver.checkpoint` as a traceback (as
tests/test_s3_run.py met when its SIGKILL landed during a checkpoint write)."""

from __future__ import annotations

import pytest
from fault_helpers import Lines, tiny_cfg

from cluster.driver.driver import Driver
from cluster.runs.run_dir import RunDir
from learner.checkpoint import list_checkpoints

pytestmark = pytest.mark.timeout(900)


def _arm_die_in_the_second_policy_write(rank) -> None:
    """The rank's second policy write (the checkpoint at step 4) exits its process mid-write."""
    import ray

    def arm(self):  # defined here: sent to the actor by value
        import os

        from learner import checkpoint

        real, calls = checkpoint.write_policy, [0]

        def write_then_die(*a, **kw):
            calls[0] += 1
            if calls[0] == 2:
                os._exit(1)
            return real(*a, **kw)
        checkpoint.write_policy = write_then_die

    ray.get(rank.__ray_call__.remote(arm), timeout=60)


def test_a_learner_dying_mid_checkpoint_stops_in_one_line_and_the_last_checkpoint_stands(ray_session, tmp_path):
    cfg = tiny_cfg(tmp_path, "c", steps=5)           # checkpoints at steps 2 and 4
    run_dir, console = RunDir.create(cfg), Lines()
    driver = Driver(cfg, run_dir, console=console)
    try:
        driver.setup()
        _arm_die_in_the_second_policy_write(driver.learner.ranks[0])
        driver.run()
        assert driver.checkpoint() is None           # what `vgrpo train` does after run(): no traceback
    finally:
        driver.teardown()
    assert driver.stop_reason == "the learner died while writing a checkpoint (ActorDiedError)"
    assert driver.learner_lost and driver.step == 4
    assert any("no checkpoint: the learner died while writing a checkpoint" in line for line in console.lines)
    # the step-4 write was staged, never committed: the step-2 checkpoint is the last one
    assert [d.name for d in list_checkpoints(run_dir.checkpoints)] == ["step_00000002"]
