"""Two rollout actors with a tiny Wan checkpoint on the shared local Ray cluster."""

from __future__ import annotations

import time

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

from common.config import RunConfig
from common.types import Condition
from common.weights import ChecksumMismatch, checksum
from common.weights_record import WeightsRecord
from rollout_worker.actor import RolloutWorker, create_rollout_actors
from rollout_worker.models.tiny import tiny_wan_components

COND = Condition(id="c0", prompt="a red cat")
REGISTRY = "test-rollout-latest-weights"


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-wan")
    comps = tiny_wan_components("t2v")
    WanPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), **comps).save_pretrained(path)
    return path, {k: v.clone() for k, v in comps["transformer"].state_dict().items()}


def make_cfg(path) -> RunConfig:
    return RunConfig.model_validate({
        "model": {"family": "wan", "path": str(path), "num_frames": 5, "height": 16, "width": 16,
                  "guidance_scale": 2.0, "max_sequence_length": 16},
        "schedule": {"steps": 4}, "sde": {"scheme": "sage"},
        "sampler": {"group_size": 2, "train_steps": "all"},
        "pools": {"rollout": {"num_actors": 2, "num_cpus": 0.5, "torch_threads": 1, "max_restarts": 1}}})


def perturbed(state: dict, scale: float = 0.05) -> dict:
    g = torch.Generator().manual_seed(1)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in state.items()}


def test_two_actors_shapes_versions_determinism(ray_session, wan_dir):
    ray = ray_session
    path, state = wan_dir

    @ray.remote(num_cpus=0)
    class Registry:
        def __init__(self, record):
            self.record = record

        def latest(self):
            return self.record

    cfg = make_cfg(path)
    registry = Registry.options(name=REGISTRY).remote(WeightsRecord(7, state, checksum(state)))
    plain = create_rollout_actors(cfg, count=1)[0]
    restored = create_rollout_actors(cfg, count=1, latest_weights=REGISTRY)[0]
    try:
        assert ray.get(plain.ping.remote())["family"] == "wan"
        assert ray.get([plain.version.remote(), restored.version.remote()]) == [0, 7]

        # same weights and seed on two actors → the same group; shapes and stamps as configured
        g0, g1 = ray.get([plain.generate.remote(COND, 3, "g"), restored.generate.remote(COND, 3, "g")])
        assert (g0.policy_version, g1.policy_version, g0.group_id) == (0, 7, "g")
        assert g0.size == 2 and g0.frames().shape == (2, 5, 16, 16, 3)
        assert all(m.x.shape == (4, 4, 2, 2, 2) for m in g0.members)  # every step sampled and recorded
        assert all(torch.equal(a.frames, b.frames) and torch.equal(a.logp_old, b.logp_old)
                   for a, b in zip(g0.members, g1.members, strict=True))

        # a newer push loads and changes the output; a stale or equal one is ignored
        new = perturbed(state)
        assert ray.get(plain.set_weights.remote(new, 2, checksum(new))) is True
        assert ray.get(plain.set_weights.remote(state, 1)) is False
        assert ray.get(plain.set_weights.remote(state, 2)) is False
        assert ray.get(plain.version.remote()) == 2
        g2 = ray.get(plain.generate.remote(COND, 3, "g"))
        assert g2.policy_version == 2
        assert not torch.equal(g2.members[0].final_latents, g0.members[0].final_latents)
        with pytest.raises(ray.exceptions.RayTaskError, match="checksum"):
            ray.get(plain.set_weights.remote(state, 3, "0" * 32))

        # a restarted actor reloads the latest published weights before generating
        ray.kill(restored, no_restart=False)
        deadline = time.time() + 60
        while True:
            try:
                assert ray.get(restored.version.remote(), timeout=60) == 7
                break
            except ray.exceptions.RayActorError:
                if time.time() > deadline:
                    raise
                time.sleep(0.5)
    finally:
        for a in (plain, restored, registry):
            ray.kill(a)


def test_worker_without_ray_verifies_checksum(wan_dir):
    path, state = wan_dir
    w = RolloutWorker(make_cfg(path).model_dump(), 0, weights_ref=WeightsRecord(1, state, checksum(state)))
    assert w.version() == 1
    with pytest.raises(ChecksumMismatch):
        w.set_weights(perturbed(state), 2, checksum(state))
    assert w.version() == 1
    assert torch.get_num_threads() == 1


def test_restarted_worker_verifies_the_registry_checksum(wan_dir):
    """The driver's registry keeps the checksum: weights altered after publishing are refused
    by an actor that restarts and loads them from the registry."""
    from cluster.driver.weight_registry import WeightRegistry

    path, state = wan_dir
    registry = WeightRegistry()
    registry.set(WeightsRecord(3, perturbed(state), checksum(state)))
    assert registry.latest().checksum == checksum(state)
    with pytest.raises(ChecksumMismatch):
        RolloutWorker(make_cfg(path).model_dump(), 0, latest_weights=registry.latest)
    registry.set(WeightsRecord(3, state, checksum(state)))
    assert RolloutWorker(make_cfg(path).model_dump(), 0, latest_weights=registry.latest).version() == 3


def test_restarted_worker_checks_a_streamed_record_bucket_by_bucket(ray_session, wan_dir):
    """The object-store record a restarted actor reads from the registry is checked too: a bucket
    altered in the store is refused, and the intact record loads."""
    import numpy as np

    from cluster.driver.weight_registry import WeightRegistry
    from common.weights import nbytes
    from common.weights_record import StreamedWeights
    from learner.weight_sync import put_stream, stream_state

    ray = ray_session
    path, state = wan_dir
    new = perturbed(state)
    record = put_stream(stream_state(new, nbytes(new) // 6, 4), "fast")
    refs = list(record.weights.refs)
    arrays = [np.array(a) for a in ray.get(refs[2])]
    arrays[0].view(np.uint8).reshape(-1)[-1] ^= 0x80
    refs[2] = ray.put(arrays)
    registry = WeightRegistry()
    registry.set(WeightsRecord(4, StreamedWeights(record.weights.manifest, refs), record.checksum))
    with pytest.raises(ChecksumMismatch, match="bucket 2"):
        RolloutWorker(make_cfg(path).model_dump(), 0, latest_weights=registry.latest)
    registry.set(record)
    w = RolloutWorker(make_cfg(path).model_dump(), 0, latest_weights=registry.latest)
    held = w.model.weight_targets(new)  # (the config's LoRA wrapper keeps them as base_layer)
    assert w.version() == 4 and all(torch.equal(held[k], v) for k, v in new.items())
