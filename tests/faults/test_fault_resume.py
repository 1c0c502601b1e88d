"""Redis restarted under a run (AOF on), then the learner killed and the run resumed from its
checkpoint; a weight sync that times out; through the real CLI, a server the user runs killed
mid-run, then back, and `vgrpo resume`. Each is bounded in time."""

from __future__ import annotations

import json
import time

import pytest
import torch
from fault_helpers import ROOT, Ledger, in_thread, tiny_cfg, when

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


def test_an_external_server_killed_mid_run_stops_vgrpo_train_with_a_checkpoint_and_resume_finishes(
        ray_address, tmp_path):
    """Through the real CLI: `vgrpo train` on a server the user runs (bank.redis_url_file), the server
    killed mid-run. The run stops within bank.outage_s plus its backoff, in one line naming Redis,
    with a checkpoint at the step it reached (no bank watermark: Redis was gone) and metrics with
    no gap. The server comes back on its append-only file and `vgrpo resume` trains to the end."""
    import os
    import signal
    import subprocess
    import sys

    from memory_bank.embedded import EmbeddedRedis

    steps = 5
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red square moving right\na red square moving up\n")
    server = EmbeddedRedis(data_dir=tmp_path / "redis", aof=True, fsync="always").start()
    secret = tmp_path / "redis-url"            # as a mounted secret: every actor on the node reads it
    secret.write_text(server.url.get_secret_value())
    secret.chmod(0o600)
    env = {**os.environ, "RAY_ADDRESS": ray_address, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "COLUMNS": "400"}
    cli = [sys.executable, "-m", "cluster.cli"]
    run = tmp_path / "ext"
    try:
        proc = subprocess.Popen(
            [*cli, "train", "-c", "configs/quickstart.yaml", "--no-eval", "bank.outage_s=4", f"bank.redis_url_file={secret}",
             "train.mode=sync", f"train.steps={steps}", "train.groups_per_step=2", "train.checkpoint_every=2",
             "sampler.group_size=4", "schedule.steps=6", "bank.capacity=64", f"train.prompts={prompts}",
             f"run.root={tmp_path}", "run.name=ext"],
            cwd=ROOT, env=env, stdout=(tmp_path / "out").open("w"), stderr=(tmp_path / "err").open("w"))
        try:
            assert when(lambda: (run / "metrics.jsonl").is_file() and _steps_in(run) >= 1 or proc.poll() is not None,
                        300) and proc.poll() is None, (tmp_path / "err").read_text()[-3000:]
            os.kill(server.pid, signal.SIGKILL)                 # the user's server dies under the run
            gone = time.monotonic()
            proc.wait(timeout=120)
            stopped = time.monotonic()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        out, err = (tmp_path / "out").read_text(), (tmp_path / "err").read_text()
        assert stopped - gone < 60                              # bounded backoff, no hang
        assert proc.returncode == 1 and "Traceback" not in out + err, (out + err)[-3000:]
        status = json.loads((run / "status.json").read_text())
        reason = status["reason"]
        assert status["state"] == "stopped" and "unreachable for 4s" in reason and "redis" in reason.lower()
        assert "vgrpo resume" in out + err
        ckpts = sorted((run / "checkpoints").glob("step_*"))
        stopped_at = _steps_in(run)
        assert stopped_at < steps and ckpts and ckpts[-1].name == f"step_{stopped_at:08d}"
        assert json.loads((ckpts[-1] / "extra.json").read_text())["bank"] is None
        assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == \
            list(range(1, stopped_at + 1))

        server.restart()                                        # same port and password, AOF reloads
        res = subprocess.run([*cli, "resume", str(run), "--no-eval"], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=300)
        assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
        assert f"at step {stopped_at}" in res.stdout, res.stdout[-3000:]
        assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == \
            list(range(1, steps + 1))
        assert json.loads((run / "status.json").read_text())["state"] == "finished"
    finally:
        server.stop()


def _steps_in(run) -> int:
    lines = [x for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return json.loads(lines[-1])["step"] if lines else 0
