"""The data plane stays off the driver: a real run with every role as its own Ray actor.

1. Group tensors never reach the driver process. Every object the driver process takes out of
   Ray (`ray.get`, from any of its threads) is walked and its tensor/array/bytes payload is
   summed; the driver's own bank connection must never push, pull or commit. On the design
   where the driver fetched each Group and pulled each TrainBatch this fails at once.
2. A corrupt fresh group that the bank drops is not left counted as queued: its condition is
   drawn again at the same cursor and every step still trains a full batch.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from cluster.driver.driver import Driver
from cluster.driver.state import cursor_of
from cluster.runs.run_dir import RunDir
from common.config import load_config

DATA_TYPES = ("Group", "Trajectory", "TrainBatch", "Scores")


def _cfg(tmp_path, name: str, *extra: str):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red square moving left\na blue square moving up\n")
    return load_config("configs/quickstart.yaml", [
        f"train.prompts={prompts}", "train.steps=3", "train.groups_per_step=2", "train.eval_seeds=1",
        "train.checkpoint_every=100", "sampler.group_size=4", "schedule.steps=6", "bank.capacity=4",
        f"run.root={tmp_path}", f"run.name={name}", *extra])


def payload_bytes(obj, seen: set | None = None) -> tuple[int, set[str]]:
    """(bytes of tensors, arrays and byte strings inside obj, names of the classes met)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0, set()
    seen.add(id(obj))
    names = {type(obj).__name__}
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size(), names
    if isinstance(obj, np.ndarray):
        return obj.nbytes, names
    if isinstance(obj, bytes | bytearray | memoryview):
        return len(obj), names
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    elif isinstance(obj, dict):
        items = [*obj.keys(), *obj.values()]
    elif isinstance(obj, list | tuple | set):
        items = list(obj)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        items = list(vars(obj).values())
    else:
        items = []
    total = 0
    for x in items:
        n, more = payload_bytes(x, seen)
        total += n
        names |= more
    return total, names


class DriverIngress:
    """Counts what the driver process takes out of Ray, and its own bank's data calls."""

    def __init__(self, monkeypatch, driver):
        import ray

        self.bytes, self.types, self.calls = 0, set(), 0
        self.bank_data_calls: list[str] = []
        real_get = ray.get

        def get(refs, *a, **kw):
            out = real_get(refs, *a, **kw)
            n, names = payload_bytes(out)
            self.bytes += n
            self.types |= names
            self.calls += 1
            return out

        monkeypatch.setattr(ray, "get", get)
        for verb in ("push_group", "pull", "commit"):
            def spy(*a, _verb=verb, _real=getattr(driver.bank, verb), **kw):
                self.bank_data_calls.append(_verb)
                return _real(*a, **kw)
            monkeypatch.setattr(driver.bank, verb, spy)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_group_tensors_never_pass_through_the_driver(ray_session, tmp_path, monkeypatch, mode):
    cfg = _cfg(tmp_path, mode, f"train.mode={mode}")
    driver = Driver(cfg, RunDir.create(cfg))
    try:
        driver.setup()
        ingress = DriverIngress(monkeypatch, driver)
        driver.run()
        receipts = [r for r in driver.receipts if r.ok]
        stats = driver.bank.stats()
    finally:
        monkeypatch.undo()
        driver.teardown()
    assert driver.stop_reason is None and driver.step == 3
    moved = sum(r.latent_bytes + r.frame_bytes for r in receipts)
    assert len(receipts) >= 6 and moved > 1_000_000          # the groups really were made and stored
    assert stats["pushed"] >= 6 and stats["committed"] == 6
    assert ingress.calls > 0                                  # the spy saw the driver's Ray traffic
    assert not ingress.types & set(DATA_TYPES), ingress.types
    assert ingress.bytes < 0.01 * moved, (ingress.bytes, moved)
    assert ingress.bank_data_calls == []                      # no push, pull or commit on the driver


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
