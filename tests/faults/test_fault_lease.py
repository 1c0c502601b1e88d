"""A run whose bank lease another run takes (it was paused past bank.lease_ttl_s, or Redis
restarted without AOF) stops in one line: it trains, commits and checkpoints nothing more."""

from __future__ import annotations

import time

from cluster.driver.driver import Driver
from cluster.runs.run_dir import RunDir
from common.config import load_config


def test_a_run_that_lost_its_lease_stops_without_training_or_checkpointing(ray_session, tmp_path):
    cfg = load_config("configs/quickstart.yaml", [
        "train.steps=3", "train.groups_per_step=1", "sampler.group_size=4", "schedule.steps=4",
        "bank.lease_ttl_s=1.5", "health.enabled=false", f"run.root={tmp_path}", "run.name=lease"])
    driver = Driver(cfg, RunDir.create(cfg))
    try:
        driver.setup()
        lease = driver.started.lease
        # another run takes the namespace: its lease value replaces ours in Redis
        driver.bank.r.set(lease.key, '{"run": "another", "token": "x"}', px=60_000)
        deadline = time.monotonic() + 30
        while not lease.lost and time.monotonic() < deadline:
            time.sleep(0.1)
        assert lease.lost  # the renewal thread saw it
        driver.run()
        assert driver.stop_reason is not None and "lost the bank lease" in driver.stop_reason
        assert driver.step == 0  # nothing trained after the loss
        assert driver.checkpoint() is None and not list(driver.run_dir.checkpoints.glob("step_*"))
        assert driver.bank.r.lrange(driver.bank.keys.done, 0, -1) == []  # nothing committed
    finally:
        driver.teardown()
