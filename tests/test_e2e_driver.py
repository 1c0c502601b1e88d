"""End to end: the driver with every role as its own Ray actor, against a real embedded Redis.

A few steps in each mode on the toy model: versions advance, the bank fills and trims,
metrics.jsonl and the reward-curve PNG are written, and the run stops cleanly. The data plane stays
off the driver: group tensors never reach the driver process while it trains (on the design where
the driver fetched each Group and pulled each TrainBatch this fails at once).
"""

from __future__ import annotations

import json

import pytest
from dataplane_helpers import DATA_TYPES, DriverIngress

from cluster.driver.driver import Driver
from cluster.evaluation.evaluate import paired
from cluster.runs.run_dir import RunDir
from common.config import load_config

STEPS = 3


def _cfg(tmp_path, mode: str):
    # two prompts, so conditions repeat within three steps and the bank is used
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red square moving left\na blue square moving up\n")
    return load_config("configs/quickstart.yaml", [f"train.prompts={prompts}",
        f"train.mode={mode}", f"train.steps={STEPS}", "train.groups_per_step=2", "train.eval_seeds=1",
        "train.checkpoint_every=2", "sampler.group_size=4", "schedule.steps=6", "bank.capacity=4",
        "optim.micro_batch=4",  # the first micro-batch holds only fresh rows: its log-ratio must be 0
        f"run.root={tmp_path}", f"run.name={mode}",
    ])


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_driver_trains_with_all_roles_as_actors(ray_session, tmp_path, monkeypatch, mode):
    import ray

    cfg = _cfg(tmp_path, mode)
    run_dir = RunDir.create(cfg)
    driver = Driver(cfg, run_dir)
    try:
        driver.setup()
        before = driver.evaluate("before", gifs=1)
        ingress = DriverIngress(monkeypatch, driver)  # what the driver takes out of Ray while it trains
        try:
            driver.run()
            receipts, run_stats = [r for r in driver.receipts if r.ok], driver.bank.stats()
        finally:
            monkeypatch.undo()
        # 0. the data plane stays off the driver: group tensors never pass through it
        assert driver.stop_reason is None and driver.step == STEPS
        moved = sum(r.latent_bytes + r.frame_bytes for r in receipts)
        assert len(receipts) >= 6 and moved > 1_000_000          # the groups really were made and stored
        assert run_stats["pushed"] >= 6 and run_stats["committed"] == 6
        assert ingress.calls > 0                                  # the spy saw the driver's Ray traffic
        assert not ingress.types & set(DATA_TYPES), ingress.types
        assert ingress.bytes < 0.01 * moved, (ingress.bytes, moved)
        assert ingress.bank_data_calls == []                      # no push, pull or commit on the driver
        driver.checkpoint()
        after = driver.evaluate("after", gifs=1)
        # 1. versions advance, one per optimizer step, and every actor holds the newest one
        rows = [json.loads(line) for line in run_dir.metrics_file.read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
        assert ray.get([a.version.remote() for a in driver.rollouts]) == [STEPS] * len(driver.rollouts)
        # 2. every produced group was trained once, by the bank's own ledger (commit appends each
        #    group id it moves out of pending to `done`); what was pushed but not trained yet (async:
        #    made ahead of the learner) waits in the fresh queue; staleness stays within the bound
        bank, k = driver.bank, driver.bank.keys
        done = [g.decode() for g in bank.r.lrange(k.done, 0, -1)]
        pushed = [r.group_id for r in driver.receipts if r.ok]
        assert len(done) == len(set(done)) == STEPS * 2 == rows[-1]["groups_trained"]
        assert len(set(pushed)) == len(pushed) and set(done) <= set(pushed)
        assert sorted(set(pushed) - set(done)) == sorted(bank.queued_ids())
        assert all(r["staleness_max"] <= max(cfg.train.max_staleness, 0 if mode == "sync" else 1) for r in rows)
        # 3. the bank fills and trims to capacity per condition
        stats = driver.bank.stats()
        assert stats["entries"] > 0 and stats["fresh"] <= 2 * cfg.train.max_staleness + 2
        conds = [c.id for c in driver.conditions]
        assert all(len(driver.bank.entries(c)) <= cfg.bank.capacity for c in conds)
        assert any(r["bank_entries_used"] > 0 for r in rows[1:])
        # 4. learner stats are real numbers; rows sampled by the learner's current weights replay
        #    to log r ≈ 0 (an ulp of the velocity: the micro-batch's GEMM shape differs from the
        #    sampler's), and such rows exist, so this cannot pass vacuously
        on_policy = [r for r in rows if r["onpolicy_rows"] > 0]
        assert sum(r["onpolicy_rows"] for r in rows) > 0 and on_policy
        assert all(r["logratio_onpolicy_absmax"] < 1e-6 for r in on_policy), \
            [r["logratio_onpolicy_absmax"] for r in on_policy]
        assert all(r["reward_mean"] == r["reward_mean"] for r in rows)
        # 5. the run directory: metrics, reward curve, GIFs, a checkpoint
        assert run_dir.curve_file.read_bytes()[:4] == b"\x89PNG"
        assert len(list(run_dir.samples.glob("*.gif"))) == 2
        assert any(run_dir.checkpoints.glob("step_*"))
        assert before.values.shape == after.values.shape
        # 6. every pool is placed one way: each actor of each role sits in its role's placement group
        groups = {p.role: p.group.id.hex() for p in driver.started.placements}
        assert sorted(groups) == ["learner", "reward", "rollout"]
        members = {"rollout": driver.rollouts, "learner": driver.learner.ranks,
                   "reward": list(driver.rewards.actors.values())}
        where = lambda self: ray.util.get_current_placement_group().id.hex()  # noqa: E731 (asked inside the actor)
        for role, actors in members.items():
            assert actors and ray.get([a.__ray_call__.remote(where) for a in actors]) == [groups[role]] * len(actors)
    finally:
        driver.teardown()
    # the placement groups went with the run
    from ray.util import placement_group_table

    assert not [g for g in placement_group_table().values() if g["state"] != "REMOVED"
                and g["name"].startswith("vgrpo-")]
    # 7. a clean stop: the embedded Redis is gone, and so are the actors
    assert not driver.redis.running
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(driver.rollouts[0].ping.remote(), timeout=30)
    # 8. the trained policy loads outside Ray: `vgrpo eval RUN_DIR` reproduces the driver's evaluation
    if mode == "sync":
        from cluster.cli import main

        assert main(["eval", str(run_dir.path), "--seeds", "1", "--out", str(tmp_path / "ev")]) == 0
        assert (tmp_path / "ev" / "grid.png").read_bytes()[:4] == b"\x89PNG"
        offline = json.loads((tmp_path / "ev" / "eval.json").read_text())
        assert offline["composite_mean"] == pytest.approx(after.to_dict()["composite_mean"], abs=1e-5)
        # 8. `--curve`: the base and each kept checkpoint on the same pairs; the newest checkpoint's
        #    row is the driver's own after − before (evaluated by the actors, not by this process)
        assert main(["eval", str(run_dir.path), "--curve", "--seeds", "1", "--out", str(tmp_path / "cv")]) == 0
        curve = json.loads((tmp_path / "cv" / "curve.json").read_text())
        assert [r["step"] for r in curve["rows"]] == [2, STEPS]
        want = {d.key: d.diff for d in paired(before, after)}
        assert {k: curve["rows"][-1][k]["gain"] for k in want} == pytest.approx(want, abs=1e-5)
        assert (tmp_path / "cv" / "curve.png").read_bytes()[:4] == b"\x89PNG"
