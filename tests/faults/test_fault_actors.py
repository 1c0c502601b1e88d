"""One short sync run under fire, checked by several tests: a rollout actor is killed and later
hangs past sampler.timeout_s, the reward model gives a NaN row, hangs past its timeout and crashes, and banked entries are overwritten
with a pickle and with garbage. The bank is an external Redis URL with a password.

Invariants: the run completes, versions stay continuous, every pushed group trains exactly once,
nothing half-scored is trained, and the password shows up nowhere."""

from __future__ import annotations

import json
import logging
import os
import pickle

import fault_helpers
import pytest
from fault_helpers import FlakyFactory, Ledger, hang_next_generate, in_thread, tiny_cfg, when
from ray import cloudpickle

from cluster.driver.driver import Driver
from cluster.runs.run_dir import RunDir

STEPS = 6
ROLLOUT_TIMEOUT_S = 15  # a restarted actor imports and loads in ~3 s (lean imports): 5x that on a busy machine
cloudpickle.register_pickle_by_value(fault_helpers)  # Ray workers cannot import tests/faults


@pytest.fixture(scope="module")
def run(ray_session, redis_server, tmp_path_factory):
    import ray
    from pydantic import SecretStr

    tmp = tmp_path_factory.mktemp("faults")
    url = redis_server.url.get_secret_value()
    cfg = tiny_cfg(tmp, "fire", f"bank.namespace=f{os.getpid()}", f"sampler.timeout_s={ROLLOUT_TIMEOUT_S}",
                   steps=STEPS)
    cfg.bank.redis_url = SecretStr(url)
    run_dir = RunDir.create(cfg)
    # capture every log record of the run, whatever the handlers
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(handler.format(r))
    logging.getLogger().addHandler(handler)
    old_level = logging.getLogger().level
    logging.getLogger().setLevel(logging.DEBUG)
    # the reward role: the same toy scorer, misbehaving once at chosen calls
    cfg.rewards.models[0] = cfg.rewards.models[0].model_copy(update={"timeout_s": 2.0, "retries": 1})
    marker = tmp / "markers"
    marker.mkdir()
    driver = Driver(cfg, run_dir, reward_factory=FlakyFactory(marker_dir=str(marker), nan_at=2, hang_at=4,
                                                              hang_s=3.0, crash_at=6))
    out = {"driver": driver, "run_dir": run_dir, "cfg": cfg, "password": url.split(":")[2].split("@")[0],
           "records": records}
    try:
        driver.setup()
        out["ledger"] = Ledger(driver)
        rollout = driver.rollouts[0]
        out["pid_before"] = ray.get(rollout.__ray_call__.remote(lambda self: os.getpid()), timeout=60)

        def attack():
            # after step 2: spoil two banked entries, then kill the rollout actor mid-generation
            if not when(lambda: driver.step >= 2, 300):
                return
            snap = driver.bank.snapshot()["banked"]
            eids = [e for ids in snap.values() for e in ids]
            r, k = driver.bank.r, driver.bank.keys
            r.set(k.blob(eids[0]), pickle.dumps({"evil": "payload"}))
            r.set(k.blob(eids[-1]), b"\x00" * 64)
            out["spoiled"] = [eids[0], eids[-1]]
            step = driver.step
            when(lambda: driver.step > step, 120, 0.05)  # right after a step: the actor is generating
            out["killed_at"] = driver.step
            ray.kill(rollout, no_restart=False)
            # once that step is done the restarted actor hangs on its next group, past
            # sampler.timeout_s (two steps, four groups, are left for it to hit)
            if not when(lambda: driver.step > out["killed_at"], 300, 0.05):
                return
            ray.get(rollout.__ray_call__.remote(lambda self: hang_next_generate(self, 4 * ROLLOUT_TIMEOUT_S)),
                    timeout=60)
            out["hung_at"] = driver.step

        thread = in_thread(attack)
        driver.run()
        thread.join(timeout=60)
        out["pid_after"] = ray.get(rollout.__ray_call__.remote(lambda self: os.getpid()), timeout=60)
        out["version_after"] = ray.get(rollout.version.remote(), timeout=60)
        out["stats"] = driver.bank.stats()
        driver.checkpoint()
        out["ledger"].freeze()
        yield out
    finally:
        driver.teardown()
        logging.getLogger().removeHandler(handler)
        logging.getLogger().setLevel(old_level)


def _rows(run):
    return [json.loads(x) for x in run["run_dir"].metrics_file.read_text().splitlines()]


def test_run_completes_with_continuous_versions(run):
    assert run["driver"].stop_reason is None
    assert [r["step"] for r in _rows(run)] == list(range(1, STEPS + 1))
    assert [r["version"] for r in _rows(run)] == list(range(1, STEPS + 1))


def test_every_pushed_group_trains_exactly_once(run):
    led, counts, stats = run["ledger"], run["driver"].counts, run["stats"]
    pushed = [g for g, _, _ in led.pushed]
    assert len(set(pushed)) == len(pushed) == STEPS * 2
    assert sorted(led.trained) == sorted(pushed)                 # the bank's done list: none lost, none twice
    assert counts["groups_trained"] == counts["groups_produced"] == STEPS * 2
    assert stats["pushed"] == stats["committed"] == STEPS * 2 and stats["fresh"] == stats["pending"] == 0
    assert not run["driver"].open                                # nothing drawn is left untrained


def test_killed_rollout_actor_restarts_with_current_weights(run):
    assert "killed_at" in run, "the attack never ran"
    assert run["pid_after"] != run["pid_before"]                 # it really was a new process
    assert run["version_after"] == STEPS                         # and holds the newest weights
    # sync mode: every group, before and after the restart, was made by the current policy
    assert all(version == step for _, version, step in run["ledger"].pushed), run["ledger"].pushed
    assert all(r["staleness_max"] == 0 for r in _rows(run))


def test_hung_rollout_actor_is_restarted_after_its_timeout(run):
    assert "hung_at" in run, "the hang was never set up"
    assert run["driver"].counts["rollout_timeouts"] == 1
    assert _rows(run)[-1]["rollout_timeouts"] == 1
    assert any("sampler.timeout_s" in r and "restarting" in r for r in run["records"])
    # the restart was a real one: two restarts in all (the kill and the hang)
    assert run["driver"].counts["actor_restarts"] == 2, [r for r in run["records"] if "rollout actor" in r]


def test_reward_nan_hang_and_crash_are_retried_or_refilled(run):
    counts = run["driver"].counts
    assert counts["reward_timeouts"] >= 1                        # the hang was retried
    assert counts["reward_failures"] >= 1                        # the crash was retried on the restarted actor
    assert counts["groups_refilled"] >= 1 and counts["invalid_members"] >= 1   # the NaN/inf group
    assert _rows(run)[-1]["groups_refilled"] == counts["groups_refilled"]
    assert run["ledger"].finite                                  # no half-scored group is in the bank


def test_corrupt_and_pickled_bank_entries_are_skipped_and_counted(run):
    assert "spoiled" in run
    stats = run["stats"]
    assert stats["corrupt"] >= 2                                 # both read back, both rejected
    banked = {e for ids in run["driver"].bank.snapshot()["banked"].values() for e in ids}
    assert not banked & set(run["spoiled"])                      # and evicted
    assert _rows(run)[-1]["bank/corrupt"] >= 1


def test_redis_password_never_logged_saved_or_exported(run):
    secret = run["password"]
    assert len(secret) >= 16
    hits = [p for p in run["run_dir"].path.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert not hits
    assert not [r for r in run["records"] if secret in r]
    assert any("redis" in r.lower() or "bank" in r.lower() for r in run["records"])  # logs were captured
    assert secret not in repr(run["driver"].bank) and secret not in repr(run["cfg"])
    # nor in what Ray stores for the actors: their config and their bank reference
    driver = run["driver"]
    assert secret.encode() not in cloudpickle.dumps((driver.actor_cfg, driver.bank_ref))
