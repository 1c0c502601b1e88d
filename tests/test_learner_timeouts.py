"""The learner's process group has a timeout of its own (learner.collective_timeout_s), and the
waits that are long by nature are barriers with theirs: a rank that loads its model seconds
after its peer does not kill a group whose collectives time out after one second (gloo on CPU,
real Ray actors). And a rank that fails mid-step does not hold its peers in a collective until
that timeout: the group stops within learner.rank_failure_grace_s."""

from __future__ import annotations

import functools
import sys
import time
from datetime import timedelta

import helpers_tiny
import pytest
import torch
import torch.distributed as dist
from helpers_tiny import TinyVideoModel, sample_group
from ray import cloudpickle

from common.config import load_config
from common.dispatch import RankFailed
from common.types import Condition, TrainBatch
from learner.actor import LearnerGroup, LearnerRank

cloudpickle.register_pickle_by_value(helpers_tiny)
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the slow factory below, by value
pytestmark = pytest.mark.timeout(240)

DELAY_S = 3.0  # rank 1 reads its model this much later than rank 0
SHORT_S = 1.0  # every collective of the group times out after this


def _cfg(*overrides: str):
    return load_config(overrides=[
        "model.family=wan", "optim.finetune=full", "kl.strategy=none", "align.enabled=false",
        "pools.learner.num_cpus=0.5", "pools.learner.torch_threads=1",
        f"learner.collective_timeout_s={SHORT_S}", *overrides])


def _slow_on_rank_1(delay_s: float) -> TinyVideoModel:
    """The model factory of a rank whose storage is slow: rank 1 loads delay_s later."""
    if dist.get_rank() == 1:
        time.sleep(delay_s)
    return TinyVideoModel(seed=0, layers=1)


class _Stop(Exception):
    pass


def test_the_collective_timeout_field_reaches_init_process_group(monkeypatch):
    seen = {}

    def spy(*args, **kw):  # records what the learner asks for, then stops before any network use
        seen.update(kw)
        raise _Stop

    monkeypatch.setattr(dist, "init_process_group", spy)
    cfg = _cfg("learner.collective_timeout_s=1234", "weight_sync.timeout_s=77")
    rank = LearnerRank(cfg.model_dump(mode="python"), rank=0, world_size=2,
                       model_factory=functools.partial(TinyVideoModel, seed=0))
    with pytest.raises(_Stop):
        rank.setup("127.0.0.1", 1)
    assert seen["timeout"] == timedelta(seconds=1234)  # its own field, not weight_sync.timeout_s
    assert (seen["rank"], seen["world_size"]) == (0, 2)


def test_a_rank_that_loads_later_than_the_collective_timeout_still_forms_the_group(ray_session):
    cfg = _cfg("learner.load_timeout_s=60")
    t0 = time.monotonic()
    group = LearnerGroup(cfg, model_factory=functools.partial(_slow_on_rank_1, DELAY_S), num_ranks=2)
    try:
        assert time.monotonic() - t0 > DELAY_S  # rank 0 did wait for its peer's load
        assert group.version() == 0
        # the group works after the wait: a gather of every shard (a collective on it)
        payload = group.weights_payload()
        assert payload and all(v.numel() > 0 for v in payload.values())
    finally:
        group.shutdown()


def test_the_load_barrier_names_its_field_when_the_load_is_slower_than_it(ray_session):
    """The control: the same late rank with a load timeout below its delay is refused, naming
    learner.load_timeout_s (the wait happens at that barrier, under that timeout)."""
    cfg = _cfg("learner.load_timeout_s=1")
    with pytest.raises(Exception, match=r"learner\.load_timeout_s"):
        LearnerGroup(cfg, model_factory=functools.partial(_slow_on_rank_1, DELAY_S), num_ranks=2)


def _run_save(tmp_path, timeout_s: float | None) -> list[str]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from helpers_dist import save_on_two_ranks

    out = str(tmp_path / "result")
    mp.start_processes(save_on_two_ranks, args=(port, str(tmp_path / "ckpt"), timeout_s, out, SHORT_S, DELAY_S),
                       nprocs=2,
                       start_method="spawn", join=True)
    return [open(f"{out}.{r}", encoding="utf-8").read() for r in range(2)]


def test_the_checkpoint_barrier_waits_for_a_slow_shard_write(tmp_path):
    results = _run_save(tmp_path / "sized", timeout_s=60.0)
    assert results == ["saved", "saved"]
    assert sorted(p.name for p in (tmp_path / "sized" / "ckpt" / "step_00000003").iterdir()) == [
        "extra.json", "meta.json", "rank00000.pt", "rank00001.pt"]
    # the control: the group's own one-second timeout would not have allowed for that write
    fast = _run_save(tmp_path / "unsized", timeout_s=None)
    assert "saved" != fast[0] and "Timed out" in fast[0], fast


class _OutOfMemoryOnRank1(TinyVideoModel):
    """Rank 1's forward raises in the step (a GPU out of memory, say) while rank 0 is already in
    the step's collectives (FSDP's gathers), where it waits for rank 1."""

    def velocity(self, *args, **kw):
        if dist.get_rank() == 1:
            raise RuntimeError("out of memory on this rank (a stand-in)")
        return super().velocity(*args, **kw)


def test_a_rank_that_fails_mid_step_stops_the_group_in_seconds_not_at_the_collective_timeout(ray_session):
    cfg = _cfg("learner.collective_timeout_s=150", "learner.rank_failure_grace_s=2",
               "sde.scheme=sage", "schedule.steps=4", "schedule.shift=1.0")
    model = TinyVideoModel(seed=0, layers=1)
    batch = TrainBatch(fresh=[sample_group(model, Condition(id="c0", prompt="p"), group_size=4, seed=1,
                                           steps=4, shift=1.0)], version=0)
    batch.fresh[0].composite = torch.tensor([1.0, -1.0, 0.5, -0.5])
    group = LearnerGroup(cfg, model_factory=functools.partial(_OutOfMemoryOnRank1, seed=0, layers=1), num_ranks=2)
    ranks = list(group.ranks)
    t0 = time.monotonic()
    with pytest.raises(RankFailed) as err:
        group.train_step(batch)
    took = time.monotonic() - t0
    assert took < 60, took  # rank 0 would have waited 150 s in the collective
    assert err.value.rank == 1 and err.value.waiting == [0]
    assert "out of memory on this rank" in str(err.value)
    for r in ranks:  # stopped: no rank is left in the collective on its GPU
        with pytest.raises(ray_session.exceptions.RayActorError):
            ray_session.get(r.version.remote(), timeout=30)
    group.shutdown()  # after the kill: nothing to wait for
