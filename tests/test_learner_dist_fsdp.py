"""FSDP2 learner ranks on CPU (gloo) against the single-process reference path."""

from __future__ import annotations

import functools
import time

import helpers_tiny
import pytest
import torch
from helpers_tiny import TinyVideoModel, sample_group
from ray import cloudpickle

from common.config import load_config
from common.types import Condition, TrainBatch
from learner.actor import LearnerGroup
from learner.trainer import Trainer

# tests/ is not a package the Ray workers can import: ship the tiny model by value.
cloudpickle.register_pickle_by_value(helpers_tiny)

pytestmark = pytest.mark.timeout(180)

LAYERS = 2


def _cfg(finetune: str = "lora"):
    return load_config(overrides=[
        "model.family=wan", "sde.scheme=sage", "schedule.steps=4", "schedule.shift=1.0",
        f"optim.finetune={finetune}", "optim.lora_rank=4", "optim.lr=0.01", "optim.micro_batch=4",
        "kl.strategy=dual", "kl.schedule=constant", "kl.lam=0.1", "align.enabled=true",
        "pools.learner.num_cpus=0.5", "pools.learner.torch_threads=1",
        "optim.ema_decay=0.9",  # the exported average is gathered from the shards too
    ])


def _batches() -> list[TrainBatch]:
    model = TinyVideoModel(seed=0, layers=LAYERS)
    out = []
    for step in range(2):
        groups = []
        for c in range(2):
            cond = Condition(id=f"c{c}", prompt=f"prompt {c}")
            g = sample_group(model, cond, group_size=4, seed=10 * step + c, steps=4, shift=1.0)
            g.composite = torch.randn(4, generator=torch.Generator().manual_seed(100 + 10 * step + c))
            groups.append(g)
        out.append(TrainBatch(fresh=groups, version=step))
    return out


def _run(cfg, ranks: int, batches, tmp_path=None):
    factory = functools.partial(TinyVideoModel, seed=0, layers=LAYERS)
    group = LearnerGroup(cfg, model_factory=factory, num_ranks=ranks)
    try:
        stats = [group.train_step(b) for b in batches]
        payload, ema = group.weights_payload(), group.weights_payload(ema=True)
        ckpt = group.save_checkpoint(tmp_path, {"cursor": 7}) if tmp_path is not None else None
        return stats, payload, ema, group.version(), ckpt, group
    except BaseException:
        group.shutdown()
        raise


def test_two_fsdp_ranks_match_one_rank(ray_session, tmp_path):
    cfg, batches = _cfg(), _batches()
    t0 = time.time()
    # the single-process reference path, in this process
    ref = Trainer(cfg, TinyVideoModel(seed=0, layers=LAYERS), device="cpu").setup()
    ref_stats = [ref.train_step(b).values for b in batches]
    ref_w, ref_v = ref.weights_payload(), ref.version
    stats, w, ema, v, ckpt, g2 = _run(cfg, 2, batches, tmp_path / "ckpt")
    try:
        assert v == ref_v == 2
        for a, b in zip(ref_stats, stats, strict=True):
            for k in ("loss", "loss/policy", "loss/kl", "loss/align", "ratio_mean", "clipfrac"):
                assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
            for k in ("onpolicy_rows", "clipfrac_onpolicy", "approx_kl_onpolicy", "logratio_onpolicy_absmax"):
                assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6, nan_ok=True), k  # health's on-policy stats
        assert set(w) == set(ref_w) and all(".lora_" in k for k in w)
        moved = 0
        for k in ref_w:
            torch.testing.assert_close(w[k], ref_w[k], rtol=1e-4, atol=1e-6)
            moved += int(ref_w[k].abs().max() > 0)
        assert moved > 0  # the LoRA weights did change, so the comparison is not of zeros
        ref_ema = ref.weights_payload(ema=True)
        assert set(ema) == set(ref_ema) and any(not torch.equal(ref_ema[k], ref_w[k]) for k in ref_w)
        for k in ref_ema:
            torch.testing.assert_close(ema[k], ref_ema[k], rtol=1e-4, atol=1e-6)

        # a sharded checkpoint resumes: the next loss equals the uninterrupted run's
        nxt = _batches()[0]
        after = g2.train_step(nxt)
        g2.load_checkpoint(ckpt)
        assert g2.version() == 2
        again = g2.train_step(nxt)
        assert again["loss"] == pytest.approx(after["loss"], rel=1e-6)
        assert sorted(p.name for p in ckpt.iterdir()) == [
            "extra.json", "meta.json", "rank00000.pt", "rank00001.pt"]
    finally:
        ranks = list(g2.ranks)
        g2.shutdown()
    # teardown: barrier, then the rank processes end without destroy_process_group
    for r in ranks:
        with pytest.raises(ray_session.exceptions.RayActorError):
            ray_session.get(r.version.remote(), timeout=30)
    assert time.time() - t0 < 150


def test_lora_publish_gathers_the_adapters_only(ray_session):
    """A LoRA publish all-gathers the adapter weights and never a base weight: a spy on DTensor's
    redistribute (what every full-tensor gather goes through) records each gather on each rank;
    torch's own full-state gather, under the same spy, gathers every weight (the spy sees gathers)."""
    from common.weights import Manifest

    def spy(rank):
        from torch.distributed.tensor import DTensor

        seen, orig = [], DTensor.redistribute
        rank._gathered = seen

        def redistribute(self, *args, **kwargs):
            seen.append((tuple(self.shape), str(self.dtype)))
            return orig(self, *args, **kwargs)

        DTensor.redistribute = redistribute
        mod = rank.trainer.policy.module
        return {"adapters": sorted((tuple(v.shape), str(v.dtype)) for k, v in mod.state_dict().items()
                                   if ".lora_" in k),
                "all": len(mod.state_dict())}

    def take(rank):
        out = list(rank._gathered)
        rank._gathered.clear()
        return out

    def torch_gather(rank):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        get_model_state_dict(rank.trainer.policy.module, options=StateDictOptions(full_state_dict=True))

    ray = ray_session
    group = LearnerGroup(_cfg("lora"), model_factory=functools.partial(TinyVideoModel, seed=0, layers=LAYERS),
                         num_ranks=2)
    try:
        info = ray.get([r.__ray_call__.remote(spy) for r in group.ranks])[0]
        record = group.weights_record(1)
        gathered = ray.get([r.__ray_call__.remote(take) for r in group.ranks])
        names = [e["name"] for e in record.weights.manifest["entries"]]
        assert names and all(".lora_" in n for n in names)
        assert sorted(gathered[0]) == sorted(gathered[1]) == info["adapters"]  # each adapter once
        assert group.weights_payload().keys() == set(names)
        ray.get([r.__ray_call__.remote(take) for r in group.ranks])
        ray.get([r.__ray_call__.remote(torch_gather) for r in group.ranks])
        everything = ray.get([r.__ray_call__.remote(take) for r in group.ranks])[0]
        assert len(everything) > 2 * len(info["adapters"])  # base weights too: the spy sees them
        assert Manifest.from_dict(record.weights.manifest).nbytes < 0.2 * sum(
            4 * _numel(s) for s, _ in everything)
    finally:
        group.shutdown()


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
