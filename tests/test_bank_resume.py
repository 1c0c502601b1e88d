"""A resume restores the bank from its checkpoint with the default config (embedded Redis,
`bank.aof: false`, so the new server starts empty), through the real driver."""

from __future__ import annotations

import json
from pathlib import Path

from cluster.driver.driver import Driver
from cluster.runs.run_dir import RunDir
from common.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def _cfg(tmp: Path):
    prompts = tmp / "prompts.txt"
    prompts.write_text("a red square moving right\na red square moving up\n")
    return load_config(ROOT / "configs/quickstart.yaml", [
        "train.mode=sync", "train.steps=2", "train.groups_per_step=2", "train.checkpoint_every=2",
        "sampler.group_size=4", "schedule.steps=6", "bank.capacity=64", f"train.prompts={prompts}",
        f"run.root={tmp}", "run.name=resume"])


def test_resume_restores_the_banked_entries_without_aof(ray_session, tmp_path):
    cfg = _cfg(tmp_path)
    assert cfg.bank.aof is False and cfg.bank.redis_url is None   # the defaults under test
    run_dir = RunDir.create(cfg)
    first = Driver(cfg, run_dir)
    try:
        first.setup()
        first.run()                         # 2 steps; checkpoint_every=2 writes step 2
        banked = first.bank.snapshot()["banked"]
        entries = {c: [(e.id, e.trajectory.x) for e in first.bank.entries(c)] for c in banked}
    finally:
        first.teardown()                    # the embedded redis-server goes, with its data
    ckpt = run_dir.checkpoints / "step_00000002"
    assert json.loads((ckpt / "extra.json").read_text())["bank"]["banked"] == banked
    assert sum(map(len, banked.values())) == 16                     # 2 steps x 2 groups x 4
    second = Driver(_cfg(tmp_path), RunDir(run_dir.path))
    notes: list[str] = []
    second.note = notes.append
    try:
        second.setup(resume=run_dir.checkpoints)
        assert second.bank.snapshot()["banked"] == banked
        for c, want in entries.items():
            got = [(e.id, e.trajectory.x) for e in second.bank.entries(c)]
            assert [i for i, _ in got] == [i for i, _ in want]
            assert all(a.equal(b) for (_, a), (_, b) in zip(got, want, strict=True))
    finally:
        second.teardown()
    assert any(n.startswith("bank: restored 16 banked entries") for n in notes), notes
