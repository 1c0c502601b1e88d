"""The finite-update guard (learner/finite_guard.py): a non-finite loss or gradient skips the
optimizer step with the weights, AdamW's moments and λ_KL untouched, names the groups it came
from and counts; `numerics` stops the run after health.nonfinite_max in a row; non-finite
weights are never saved. A real Trainer on a tiny real diffusers transformer."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers_tiny import TinyVideoModel, sample_group

from cluster.health.checks import HealthMonitor
from common.config import RunConfig, load_config
from common.types import Condition, TrainBatch
from learner import checkpoint
from learner.finite_guard import GROUPS, SKIPPED, NonFiniteWeights
from learner.trainer import Trainer


def _cfg() -> RunConfig:
    return RunConfig.model_validate({"optim": {"micro_batch": 4, "lr": 1e-2, "lora_rank": 4},
                                     "kl": {"strategy": "moving", "lam": 0.1}})


def _batch(model, seed: int, version: int, groups: int = 3) -> TrainBatch:
    fresh = []
    for c in range(groups):
        g = sample_group(model, Condition(f"c{c}", f"prompt {c}"), group_size=3, seed=seed + c, version=version)
        g.composite = torch.stack([t.final_latents[0].mean() + 0.1 * i for i, t in enumerate(g.members)])
        fresh.append(g)
    return TrainBatch(fresh, version=version)


def _snapshot(tr: Trainer) -> dict:
    return copy.deepcopy({"params": {n: p.detach().clone() for n, p in tr.policy.params.items()},
                          "opt": tr.optimizer.state_dict(), "kl": tr.kl.state_dict()})


def _same(a: dict, b: dict) -> bool:
    if a["params"].keys() != b["params"].keys() or a["kl"] != b["kl"]:
        return False
    if not all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"]):
        return False
    sa, sb = a["opt"]["state"], b["opt"]["state"]
    return sa.keys() == sb.keys() and all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])


@pytest.mark.parametrize("poison", ["inf in a latent", "nan in logp_old", "overflowing weights"])
def test_a_non_finite_update_is_skipped_named_and_the_next_step_trains(poison):
    model = TinyVideoModel(seed=0)
    tr = Trainer(_cfg(), model).setup()
    data = TinyVideoModel(seed=3)
    tr.train_step(_batch(data, seed=0, version=0))   # AdamW has moments to keep
    before = _snapshot(tr)
    bad = _batch(data, seed=10, version=1)
    victim = bad.fresh[1]
    if poison == "inf in a latent":
        victim.members[2].x[0].view(-1)[5] = float("inf")
    elif poison == "nan in logp_old":
        victim.members[0].logp_old[0] = float("nan")
    else:  # the forward overflows though no tensor of the batch holds a non-finite value
        with torch.no_grad():
            for p in tr.policy.params.values():
                p.mul_(1e30)
        before = _snapshot(tr)
    stats = tr.train_step(bad)
    assert stats[SKIPPED] == 1.0
    assert _same(before, _snapshot(tr))  # weights, optimizer moments, λ_KL: untouched
    assert all(torch.isfinite(p).all() for p in tr.policy.params.values())
    assert stats["grad_norm"] != stats["grad_norm"] or abs(stats["grad_norm"]) == float("inf") \
        or stats["loss"] != stats["loss"] or abs(stats["loss"]) == float("inf")
    tensors_bad = poison != "overflowing weights"
    want = [victim.group_id] if tensors_bad else [g.group_id for g in bad.fresh]
    assert stats[GROUPS].split() == want
    assert tr.version == 2  # the version counts steps: the driver's step follows it
    if not tensors_bad:
        return
    nxt = tr.train_step(_batch(data, seed=20, version=2))
    assert nxt[SKIPPED] == 0.0 and GROUPS not in nxt.values
    assert not _same(before, _snapshot(tr))  # a finite step trains again
    assert all(torch.isfinite(p).all() for p in tr.policy.params.values())


def test_non_finite_weights_are_never_saved(tmp_path):
    tr = Trainer(_cfg(), TinyVideoModel(seed=0)).setup()
    name, p = next(iter(tr.policy.params.items()))
    with torch.no_grad():
        p.view(-1)[0] = float("nan")
    with pytest.raises(NonFiniteWeights, match=f"weight '{name}' holds NaN/inf"):
        tr.save_checkpoint(tmp_path / "ckpt")
    assert checkpoint.list_checkpoints(tmp_path / "ckpt") == []
    with pytest.raises(NonFiniteWeights, match="holds NaN/inf"):
        checkpoint.write_policy(tmp_path / "policy", tr.weights_payload(), ema=False, version=1,
                                decay=0.0)
    assert not (tmp_path / "policy").exists()   # refused before any shard file is made


def _row(step: int, skipped: bool) -> dict:
    row = {"step": step, "reward_mean": 0.0, SKIPPED: 1.0 if skipped else 0.0}
    return row | ({GROUPS: f"g{step:07d}-v{step}"} if skipped else {})


def test_numerics_stops_the_run_after_nonfinite_max_skipped_steps_in_a_row():
    cfg = load_config(None, ["health.nonfinite_max=3"])
    mon = HealthMonitor(cfg)
    pattern = [True, True, False, True, True]  # a finite step in between resets the count
    for step, skipped in enumerate(pattern, 1):
        assert mon.observe(_row(step, skipped)) == []
    assert mon.stop_reason is None
    found = mon.observe(_row(6, True))          # the third in a row
    assert [f.check for f in found] == ["numerics"] and found[0].level == "stop"
    assert "3 optimizer steps in a row" in found[0].message and "g0000006-v6" in found[0].message
    assert "health.nonfinite_max = 3" in mon.stop_reason
    warn = HealthMonitor(load_config(None, ["health.nonfinite_max=1", "health.stop_on=[]"]))
    assert [f.level for f in warn.observe(_row(1, True))] == ["warn"]


def test_the_skipped_in_a_row_count_goes_on_across_a_checkpoint_and_resume(tmp_path, bank):
    """N-1 skipped in a row, a checkpoint, a resume, one more skipped: `numerics` stops the run
    (the count is in extra.json's DriverState, not only in the stopped driver's monitor). The
    driver's own _skipped and health hook, the checkpoint's JSON and the real resume.restore
    on a real bank; a checkpoint written before the field existed still loads, counting from 0."""
    import json

    from cluster.driver.driver import Driver
    from cluster.driver.resume import restore
    from cluster.driver.state import DriverState
    from cluster.runs.run_dir import RunDir

    cfg = load_config("configs/quickstart.yaml", [f"run.root={tmp_path}", "run.name=r", "health.nonfinite_max=3"])
    first = Driver(cfg, RunDir.create(cfg))

    def step(driver: Driver, n: int, skipped: bool) -> None:  # what train() and _after_step do with the row
        driver._skipped(_row(n, skipped))
        driver.state.step = n
        driver.health.on_step(_row(n, skipped))

    for n, skipped in enumerate([True, False, True, True], 1):  # a finite step resets the count
        step(first, n, skipped)
    assert first.health.monitor.stop_reason is None and first.state.skipped_in_a_row == 2
    extra = json.loads(json.dumps(first.state.saved()))   # what the checkpoint's extra.json holds
    assert extra["skipped_in_a_row"] == 2

    second = Driver(cfg, RunDir.open(tmp_path / "r"))
    restore(second.state, extra, tmp_path / "r/checkpoints/step_4", bank, lambda gids, s: 0, lambda line: None)
    step(second, 5, True)
    assert second.health.monitor.stop_reason is not None
    assert "3 optimizer steps in a row" in second.health.monitor.stop_reason

    old = {k: v for k, v in extra.items() if k != "skipped_in_a_row"}  # written before it was kept
    assert DriverState.from_saved(old, "extra.json").skipped_in_a_row == 0
    with pytest.raises(checkpoint.CheckpointError, match="'skipped_in_a_row'"):
        DriverState.from_saved({**extra, "skipped_in_a_row": -1}, "extra.json")
