"""Checkpoint and resume through the storage layer, on a local path, on fsspec's in-process
object store (`memory://`: no rename, objects only) and on a real S3 endpoint on loopback (moto's
server mode, reached through s3fs)."""

from __future__ import annotations

import uuid

import pytest
import torch
from helpers_tiny import TinyVideoModel, sample_group

from common import storage
from common.config import RunConfig
from common.types import Condition, TrainBatch
from learner import checkpoint
from learner.trainer import Trainer


@pytest.fixture(params=["local", "memory", "s3"])
def location(request, tmp_path):
    if request.param == "local":
        yield str(tmp_path / "ckpt")
        return
    if request.param == "s3":  # a real S3 endpoint on loopback (moto's server), through s3fs
        yield request.getfixturevalue("s3_root") + "/ckpt"
        return
    import fsspec

    uri = f"memory://vgrpo-test-{uuid.uuid4().hex[:8]}/runs/ckpt"
    yield uri
    fs, path = storage.filesystem(uri)
    if fs.exists(path):
        fs.rm(path, recursive=True)
    assert isinstance(fs, fsspec.implementations.memory.MemoryFileSystem)


def _batch(model, seed: int) -> TrainBatch:
    fresh = []
    for c in range(2):
        g = sample_group(model, Condition(f"c{c}", f"prompt {c}"), group_size=3, seed=seed + c, version=0)
        g.composite = torch.stack([t.final_latents[0].mean() for t in g.members])
        fresh.append(g)
    return TrainBatch(fresh)


def test_is_uri():
    assert storage.is_uri("s3://b/runs") and storage.is_uri("memory://x") and storage.is_uri("gs://b")
    assert not storage.is_uri("/var/lib/vgrpo/runs") and not storage.is_uri("runs/x")
    assert not storage.is_uri("file:///tmp/x")


def test_checkpoint_and_resume_through_the_storage_layer(location):
    cfg = RunConfig.model_validate({"optim": {"micro_batch": 6, "lr": 1e-2, "lora_rank": 4},
                                    "train": {"keep_checkpoints": 2}})
    data_model = TinyVideoModel(seed=7)
    batches = [_batch(data_model, seed=s) for s in range(3)]
    a = Trainer(cfg, TinyVideoModel(seed=0)).setup()
    saved = []
    for b in batches[:2]:
        a.train_step(b)
        saved.append(a.save_checkpoint(location, extra={"cursor": a.version, "bank": None}))
    a.save_checkpoint(location, extra={"cursor": 99})  # re-save of step 2: replaced whole
    want = a.train_step(batches[2])
    a.save_checkpoint(location, extra={"cursor": 3})   # retention: steps 2 and 3 remain
    steps = [str(p).rstrip("/").rsplit("/", 1)[-1] for p in checkpoint.list_checkpoints(location)]
    assert steps == ["step_00000002", "step_00000003"]
    if storage.is_uri(location):
        assert all(isinstance(p, storage.Uri) and p.startswith(location) for p in saved)

    b = Trainer(cfg, TinyVideoModel(seed=0)).setup()
    extra = b.load_checkpoint(str(saved[1]))
    assert extra == {"cursor": 99} and b.version == 2
    got = b.train_step(batches[2])
    for k in ("loss", "loss/policy", "grad_norm", "kl/lambda"):
        assert got[k] == want[k], k
    for n, p in a.policy.params.items():
        assert torch.equal(p, b.policy.params[n]), n
    # a root resolves to its newest complete checkpoint
    c = Trainer(cfg, TinyVideoModel(seed=0)).setup()
    assert c.load_checkpoint(location) == {"cursor": 3} and c.version == 3


def test_a_half_written_step_is_never_listed_or_loaded():
    root = f"memory://vgrpo-test-{uuid.uuid4().hex[:8]}/ckpt"
    done = checkpoint.save(root, 1, {"w": torch.ones(2)}, {"cursor": 1}, keep=3)
    # a writer that died after extra.json, before the marker (trainer.pt)
    storage.write(storage.join(root, "step_00000002", checkpoint.EXTRA_FILE), b"{}")
    assert checkpoint.list_checkpoints(root) == [done]
    state, extra, d = checkpoint.load(root)
    assert d == done and extra == {"cursor": 1} and torch.equal(state["w"], torch.ones(2))
    with pytest.raises(FileNotFoundError, match="no checkpoint here"):
        checkpoint.load(storage.join(root, "step_00000002"))
    fs, path = storage.filesystem(root)
    fs.rm(path, recursive=True)
