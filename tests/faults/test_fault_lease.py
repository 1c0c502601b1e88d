"""A run whose bank lease another run takes (it was paused past bank.lease_ttl_s, or Redis
restarted without AOF) stops in one line: it trains, commits and checkpoints nothing more.
The line is the same whichever finds out first: the driver's lease thread, or the bank's
scripts refusing the run (LeaseLost) on a rollout actor, the learner or the driver itself."""

from __future__ import annotations

import time

import pytest

from cluster.driver.driver import Driver
from cluster.driver.errors import LeaseStop
from cluster.runs.run_dir import RunDir
from common.config import load_config


@pytest.mark.parametrize("first", ["lease thread", "bank scripts"])
def test_a_run_that_lost_its_lease_stops_without_training_or_checkpointing(ray_session, tmp_path, first):
    ttl = 1.5 if first == "lease thread" else 600.0  # 600: no renewal comes before the run's first push
    cfg = load_config("configs/quickstart.yaml", [
        "train.steps=3", "train.groups_per_step=1", "sampler.group_size=4", "schedule.steps=4",
        f"bank.lease_ttl_s={ttl}", "health.enabled=false", f"run.root={tmp_path}", "run.name=lease"])
    driver = Driver(cfg, RunDir.create(cfg))
    line = str(LeaseStop(cfg.bank.namespace))
    try:
        driver.setup()
        assert driver.redis.listen == "unix"  # one local node: bank.embedded_listen auto
        lease = driver.started.lease
        # another run takes the namespace: its lease value replaces ours in Redis
        driver.bank.r.set(lease.key, '{"run": "another", "token": "x"}', px=600_000)
        if first == "lease thread":
            deadline = time.monotonic() + 30
            while not lease.lost and time.monotonic() < deadline:
                time.sleep(0.1)
            assert lease.lost  # the renewal thread saw it
        driver.run()
        assert lease.lost == (first == "lease thread")  # else only the scripts have refused so far
        assert driver.stop_reason == line
        assert driver.step == 0  # nothing trained after the loss
        assert driver.checkpoint() is None and not list(driver.run_dir.checkpoints.glob("step_*"))
        assert driver.bank.r.lrange(driver.bank.keys.done, 0, -1) == []  # nothing committed
        # the learner's rank 0 and the driver's own bank are refused by the scripts: the same line
        for what, fn, args in (("pull", driver.learner.pull, (1, 0)),
                               ("requeue_pending", driver.bank.requeue_pending, ())):
            with pytest.raises(LeaseStop) as e:
                driver._bank(what, fn, *args)
            assert str(e.value) == line
    finally:
        driver.teardown()
