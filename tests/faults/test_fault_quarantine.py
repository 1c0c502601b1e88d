"""Entries that decode but cannot be trained, on a real run (Ray, the real redis-server, the toy
model): each is quarantined with its reason, its group's condition drawn again, the run goes on,
and the prompt stream is unchanged. A resume with other SDE settings evicts the old run's banked
entries instead of crashing on them. On main before learner/admit.py, each of these ended the run
in a traceback at the first step that met the entry (and every resume met it again)."""

from __future__ import annotations

import json

import pytest
from fault_helpers import Lines, tiny_cfg

from cluster.driver.driver import Driver
from cluster.driver.drops import TRAIN_FAILURES
from cluster.driver.state import cursor_of
from cluster.runs.run_dir import RunDir

pytestmark = pytest.mark.timeout(900)
FUTURE = str(10 ** 38)   # a 39-digit policy version: the codec reads it, no learner has reached it


def _set_version(bank, eid: str, version: str) -> None:
    bank.r.hset(bank.keys.meta(eid), "version", version)


def _arm_failures(driver, times: int, rank: int = 0) -> None:
    """The learner's next `times` steps raise inside the rank, as a step the data breaks would."""
    import ray

    def arm(self):
        real, left = self.trainer.train_step, [times]

        def failing(batch, **kw):
            if left[0] > 0:
                left[0] -= 1
                raise ValueError("mat1 and mat2 shapes cannot be multiplied (armed by the test)")
            return real(batch, **kw)
        self.trainer.train_step = failing

    ray.get(driver.learner.ranks[rank].__ray_call__.remote(arm), timeout=60)


def test_a_step_that_fails_on_one_learner_rank_stops_the_run_in_seconds_naming_it(ray_session, tmp_path):
    """Rank 1's step raises while rank 0 is in the step's collectives, waiting for it. Before
    learner.rank_failure_grace_s the driver quarantined the batch through rank 0, a call that
    waited behind that collective for learner.collective_timeout_s (here 300 s), and went on
    with a group out of step; now the run stops within the grace, as for a lost learner."""
    import time

    cfg = tiny_cfg(tmp_path, "rank1", "pools.learner.num_actors=2", "learner.rank_failure_grace_s=2",
                   "learner.collective_timeout_s=300", steps=4)
    driver = Driver(cfg, RunDir.create(cfg))
    try:
        driver.setup()
        _arm_failures(driver, 100, rank=1)
        t0 = time.monotonic()
        driver.run()
        took, step, stop = time.monotonic() - t0, driver.step, driver.stop_reason
    finally:
        driver.teardown()
    assert step == 0 and took < 120, (step, took)
    assert stop.startswith("the learner died (rank 1 failed (ValueError: mat1 and mat2 shapes cannot be "
                           "multiplied (armed by the test)) while rank 0 was still in the call 2 s later"), stop
    assert "vgrpo resume" in stop


def _done(bank) -> list[str]:
    return [g.decode() for g in bank.r.lrange(bank.keys.done, 0, -1)][::-1]


@pytest.fixture(scope="module")
def poisoned(ray_session, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("quarantine")
    cfg = tiny_cfg(tmp, "q", "train.checkpoint_every=4", steps=4)
    run_dir = RunDir.create(cfg)
    console, out = Lines(), {"run_dir": run_dir, "tmp": tmp}
    driver = Driver(cfg, run_dir, console=console)
    try:
        driver.setup()
        bank, pull, pulls = driver.bank, driver.learner.pull, [0]

        def poisoning_pull(n, version):
            pulls[0] += 1
            if pulls[0] == 1:   # a fresh group with a member from the future
                gid = bank.queued_ids()[0]
                eids = bank.r.hget(bank.keys.group(gid), "eids").decode().split()
                _set_version(bank, eids[1], FUTURE)
                out["fresh"] = (gid, eids)
            elif "banked" not in out and (banked := bank.entries(_a_banked_condition(bank))):
                eid = banked[0].id       # a banked entry from the future
                _set_version(bank, eid, FUTURE)
                out["banked"] = eid
            elif "banked" in out and "failed" not in out:
                out["failed"] = pulls[0]
                _arm_failures(driver, 1)  # this pull's step raises in the learner
            return pull(n, version)

        driver.learner.pull = poisoning_pull
        driver.run()
        out.update(step=driver.step, stop=driver.stop_reason, counts=dict(driver.counts),
                   quarantined=bank.quarantined(), stats=bank.stats(), done=_done(bank), open=dict(driver.open),
                   pushed=[r.group_id for r in driver.receipts if r.ok], lines=list(console.lines))
    finally:
        driver.teardown()
    return out


def _a_banked_condition(bank) -> str | None:
    conds = sorted(c.decode() for c in bank.r.smembers(bank.keys.conds))
    return next((c for c in conds if bank.r.llen(bank.keys.cond(c))), None) or "-"


def test_untrainable_entries_are_quarantined_with_their_reason_and_the_run_goes_on(poisoned):
    p = poisoned
    assert p["stop"] is None and p["step"] == 4
    gid, eids = p["fresh"]
    reasons = {r["id"]: r["reason"] for r in p["quarantined"]}
    assert reasons[eids[1]].startswith("policy version 10000000…(39 digits) is outside 0..0")
    assert reasons[p["banked"]].startswith("policy version 10000000…(39 digits) is outside")
    failed = [r for r in reasons.values() if r.startswith("the step failed on it: ValueError: mat1 and mat2")]
    assert len(failed) >= 2 * 4        # the failed step's two groups of 4 members (and any banked entries)
    assert p["stats"]["quarantined"] == len(p["quarantined"])
    rows = [json.loads(x) for x in p["run_dir"].metrics_file.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[-1]["groups_quarantined"] == 1 + 2 and rows[-1]["bank/quarantined"] == len(p["quarantined"])
    assert any("dropped 1 fresh group(s) (quarantined: policy version" in line and gid in line for line in p["lines"])
    assert any("bank: quarantined banked entry " + p["banked"] in line for line in p["lines"])


def test_quarantined_groups_are_drawn_again_and_the_prompt_stream_is_unchanged(poisoned):
    p = poisoned
    done, counts = p["done"], p["counts"]
    assert len(done) == len(set(done)) == 8                  # 4 steps × 2 groups, each trained once
    assert sorted(cursor_of(g) for g in done) == list(range(8))
    assert p["fresh"][0] not in done and not p["open"]
    assert counts["groups_produced"] == counts["groups_trained"] == 8
    assert counts["groups_quarantined"] == 3 and p["stats"]["fresh"] == p["stats"]["pending"] == 0


def test_a_resume_with_another_eta_evicts_the_old_banked_entries_and_trains(poisoned, tmp_path):
    p = poisoned
    cfg = tiny_cfg(p["tmp"], "q", "train.checkpoint_every=4", "sde.eta=0.9", steps=5)
    console = Lines()
    driver = Driver(cfg, RunDir(p["run_dir"].path), console=console)
    try:
        driver.setup(resume=p["run_dir"].checkpoints)
        before = driver.bank.stats()["banked"]
        driver.run()
        step, stop, stats = driver.step, driver.stop_reason, driver.bank.stats()
    finally:
        driver.teardown()
    assert before > 0 and stop is None and step == 5
    evicted = [line for line in console.lines if "sampled with other settings" in line]
    assert evicted and "this run samples with sage(eta=0.9" in evicted[0], console.lines
    assert stats["quarantined"] == p["stats"]["quarantined"]   # other settings are not poison


def test_a_learner_that_fails_every_step_stops_the_run_in_one_line(ray_session, tmp_path):
    cfg = tiny_cfg(tmp_path, "always", steps=6)
    driver = Driver(cfg, RunDir.create(cfg))
    try:
        driver.setup()
        _arm_failures(driver, 100)
        driver.run()
        step, stop, counts = driver.step, driver.stop_reason, dict(driver.counts)
    finally:
        driver.teardown()
    assert step == 0 and stop == (f"{TRAIN_FAILURES} steps in a row failed in the learner, the last with: "
                                  "ValueError: mat1 and mat2 shapes cannot be multiplied (armed by the test)")
    assert counts["groups_quarantined"] == TRAIN_FAILURES * 2
