"""Redis restarted under a run (AOF on), then the learner killed and the run resumed from its
checkpoint; Redis gone for good; a weight sync that times out. Each is bounded in time."""

from __future__ import annotations

import json
import time

import pytest
import torch
from fault_helpers import Ledger, in_thread, tiny_cfg, when

from cluster.driver.driver import Driver
from cluster.driver.state import cursor_of
from cluster.runs.run_dir import RunDir
from learner import dist_checkpoint

STEPS = 4


def _steps(run_dir):
    return [json.loads(x)["step"] for x in run_dir.metrics_file.read_text().splitlines()]


@pytest.fixture(scope="module")
def crashed_and_resumed(ray_session, tmp_path_factory):
    import ray

    tmp = tmp_path_factory.mktemp("resume")
    cfg = tiny_cfg(tmp, "res", "bank.aof=true", steps=STEPS)
    run_dir = RunDir.create(cfg)
    out = {"run_dir": run_dir}
    first = Driver(cfg, run_dir)
    try:
        first.setup()
        out["ledger1"] = Ledger(first)

        def attack():
            if when(lambda: first.step >= 1, 300):
                out["before_restart"] = first.bank.stats()
                first.redis.restart()                      # same port and data dir: AOF reloads
                out["after_restart"] = first.bank.stats()
                out["restarted_at"] = first.step
            if when(lambda: first.step >= 3, 300):
                ray.kill(first.learner.ranks[0], no_restart=True)
                out["killed_at"] = first.step

        thread = in_thread(attack)
        first.run()
        thread.join(timeout=60)
        out["first"] = (first.step, first.stop_reason, first.checkpoint())
        out["ledger1"].freeze()
    finally:
        first.teardown()
    ckpt = max(run_dir.checkpoints.glob("step_*"))
    assert dist_checkpoint.verify_newest(run_dir.checkpoints, 1) == ckpt  # `vgrpo resume`'s check: no false alarm
    out["ckpt_extra"] = json.loads((ckpt / "extra.json").read_text())
    out["ckpt_kl"] = torch.load(ckpt / "trainer.pt", weights_only=True)["kl"]
    second = Driver(tiny_cfg(tmp, "res", "bank.aof=true", steps=STEPS), RunDir(run_dir.path))
    try:
        second.setup(resume=run_dir.checkpoints)
        out["resumed_step"] = second.step
        out["resumed_bank"] = second.bank.snapshot()["banked"]
        out["resumed_kl"] = ray.get(second.learner.ranks[0].__ray_call__.remote(
            lambda self: self.trainer.kl.state_dict()), timeout=60)
        out["ledger2"] = Ledger(second)
        second.run()
        out["second"] = (second.step, second.stop_reason, dict(second.counts), second.bank.stats(),
                         dict(second.open), second.cursor)
        out["ledger2"].freeze()
    finally:
        second.teardown()
    return out


def test_redis_restart_with_aof_recovers_the_bank_and_the_run_goes_on(crashed_and_resumed):
    out = crashed_and_resumed
    assert "after_restart" in out, "the restart never happened"
    before, after = out["before_restart"], out["after_restart"]
    # The driver keeps running while the attack reads and restarts, so a group may be pushed or
    # committed in between. Nothing is evicted in this run (bank.capacity 64 > all entries), so
    # every one of these only grows; a server that lost its data would read less (or 0).
    assert before["pushed"] > 0 and before["entries"] > 0
    for k in ("pushed", "committed", "entries", "bytes"):
        assert after[k] >= before[k], k                          # nothing lost across the restart
    assert out["killed_at"] >= out["restarted_at"] + 1          # and training went on after it


def test_killed_learner_resumes_at_the_checkpoint_with_bank_and_kl_state(crashed_and_resumed):
    out = crashed_and_resumed
    step, reason, ckpt = out["first"]
    assert reason is not None and "learner died" in reason and "vgrpo resume" in reason
    assert ckpt is None                                          # no checkpoint from a dead learner
    extra = out["ckpt_extra"]
    assert out["resumed_step"] == extra["step"] == 2 < step
    assert out["resumed_bank"] == extra["bank"]["banked"]       # the same per-condition bank
    assert out["resumed_kl"] == out["ckpt_kl"]                  # λ_KL controller state
    # the resumed run finishes, metrics continuous, nothing left behind
    step2, reason2, counts, stats, left, cursor = out["second"]
    assert reason2 is None and step2 == STEPS
    assert _steps(out["run_dir"]) == list(range(1, STEPS + 1))
    assert stats["fresh"] == stats["pending"] == 0 and not left
    assert counts["groups_trained"] == counts["groups_produced"] == STEPS * 2
    # exactly once over the resumed timeline: the checkpoint's groups plus the resumed run's cover
    # the prompt stream with no gap and no repeat
    before_ckpt = out["ledger1"].trained[: extra["step"] * 2]
    cursors = sorted(cursor_of(g) for g in before_ckpt + out["ledger2"].trained)
    assert cursors == list(range(cursor)), cursors


def test_redis_unreachable_stops_cleanly_with_a_checkpoint(ray_session, tmp_path):
    cfg = tiny_cfg(tmp_path, "down", "bank.outage_s=4", steps=20)
    run_dir = RunDir.create(cfg)
    driver = Driver(cfg, run_dir)
    try:
        driver.setup()
        gone = {}

        def kill_redis():
            if when(lambda: driver.step >= 1, 300):
                driver.redis.terminate()
                gone["t"] = time.monotonic()

        in_thread(kill_redis)
        driver.run()
        stopped = time.monotonic()
        ckpt = driver.checkpoint()
    finally:
        driver.teardown()
    assert "t" in gone
    assert stopped - gone["t"] < 60                              # bounded backoff, no hang
    assert driver.stop_reason and "unreachable for 4s" in driver.stop_reason and "redis" in driver.stop_reason.lower()
    assert driver.step < 20 and ckpt is not None and ckpt.name == f"step_{driver.step:08d}"
    assert json.loads((ckpt / "extra.json").read_text())["bank"] is None
    assert _steps(run_dir) == list(range(1, driver.step + 1))


def test_weight_sync_timeout_names_the_peer_and_does_not_hang(ray_session, tmp_path):
    cfg = tiny_cfg(tmp_path, "sync", "weight_sync.timeout_s=3", steps=3)
    driver = Driver(cfg, RunDir.create(cfg))
    try:
        driver.setup()
        train_pulled = driver.learner.train_pulled

        def busy_after_train(pulled):
            stats = train_pulled(pulled)
            # the rollout actor is stuck in something else when the weights come
            driver.rollouts[0].__ray_call__.remote(lambda self: time.sleep(40))
            return stats

        driver.learner.train_pulled = busy_after_train
        t0 = time.monotonic()
        driver.run()
        elapsed = time.monotonic() - t0
    finally:
        driver.teardown()
    assert driver.stop_reason is not None
    assert "weight sync" in driver.stop_reason and "rollout actor 0" in driver.stop_reason
    assert "weight_sync.timeout_s" in driver.stop_reason
    assert driver.step == 1 and elapsed < 35
