"""The data plane stays off the driver: a real run with every role as its own Ray actor.

A corrupt fresh group that the bank drops is not left counted as queued: its condition is drawn
again at the same cursor and every step still trains a full batch. (That group tensors never
reach the driver process is asserted in the run of tests/test_e2e_driver.py, sync and async,
with tests/dataplane_helpers.py.)
"""

from __future__ import annotations

import json

from cluster.driver.driver import Driver
from cluster.driver.state import cursor_of
from cluster.runs.run_dir import RunDir
from common.config import load_config


def _cfg(tmp_path, name: str, *extra: str):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red square moving left\na blue square moving up\n")
    return load_config("configs/quickstart.yaml", [
        f"train.prompts={prompts}", "train.steps=3", "train.groups_per_step=2", "train.eval_seeds=1",
        "train.checkpoint_every=100", "sampler.group_size=4", "schedule.steps=6", "bank.capacity=4",
        f"run.root={tmp_path}", f"run.name={name}", *extra])


def test_a_corrupt_fresh_group_is_drawn_again_and_not_counted(ray_session, tmp_path):
    cfg = _cfg(tmp_path, "corrupt", "train.mode=sync")
    run_dir = RunDir.create(cfg)
    driver = Driver(cfg, run_dir)
    spoiled: list[str] = []
    try:
        driver.setup()
        bank, k = driver.bank, driver.bank.keys
        pull = driver.learner.pull

        def pull_after_spoiling(n, version):
            if not spoiled:  # before the first pull: overwrite every blob of the first queued group
                gid = bank.queued_ids()[0]
                for eid in bank.r.hget(k.group(gid), "eids").decode().split():
                    bank.r.set(k.blob(eid), b"\x00not a tensor file")
                spoiled.append(gid)
            return pull(n, version)

        driver.learner.pull = pull_after_spoiling
        driver.run()
        done = [g.decode() for g in bank.r.lrange(k.done, 0, -1)][::-1]
        dead = [g.decode() for g in bank.r.lrange(k.dead, 0, -1)]
        stats, counts = bank.stats(), dict(driver.counts)
        pushed = [r.group_id for r in driver.receipts if r.ok]
    finally:
        driver.teardown()
    rows = [json.loads(x) for x in run_dir.metrics_file.read_text().splitlines()]
    assert driver.stop_reason is None and [r["step"] for r in rows] == [1, 2, 3]
    assert [r["groups_trained"] for r in rows] == [2, 4, 6]          # every step a full batch
    assert dead == spoiled and counts["groups_dropped"] == 1
    assert stats["dropped"] == 1 and stats["fresh"] == stats["pending"] == 0
    assert counts["groups_produced"] == counts["groups_trained"] == 6   # the dropped one is not counted
    # the bank's ledger: everything pushed was trained once, except the dropped group, whose
    # cursor (and so its condition) was drawn again and trained under a new id
    assert sorted(done) == sorted(g for g in pushed if g not in spoiled) and len(set(done)) == 6
    redo = [g for g in done if cursor_of(g) == cursor_of(spoiled[0])]
    assert len(redo) == 1 and redo[0] != spoiled[0]
    assert sorted(cursor_of(g) for g in done) == list(range(6))      # the prompt stream, unchanged
    assert not driver.open
