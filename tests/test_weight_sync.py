"""Weight publishing to two real rollout actors with both transports, and a peer that never joins."""

from __future__ import annotations

import time

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

from common.config import RunConfig, WeightSyncConfig
from common.weight_group import WeightSyncTimeout
from common.weights import checksum
from learner.weight_sync import WeightPublisher
from rollout_worker.actor import create_rollout_actors
from rollout_worker.models.tiny import tiny_wan_components

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def rollout(ray_session, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-wan-sync")
    comps = tiny_wan_components("t2v")
    WanPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), **comps).save_pretrained(path)
    cfg = RunConfig.model_validate({
        "model": {"family": "wan", "path": str(path), "num_frames": 5, "height": 16, "width": 16,
                  "max_sequence_length": 16},
        "optim": {"finetune": "full"},  # full weights travel here (LoRA runs send only the adapter)
        "pools": {"rollout": {"num_actors": 2, "num_cpus": 0.5, "torch_threads": 1, "max_restarts": 0}}})
    actors = create_rollout_actors(cfg, count=2)
    state = {k: v.clone() for k, v in comps["transformer"].state_dict().items()}
    yield actors, state
    for a in actors:
        ray_session.kill(a)


def _perturbed(state: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
            for k, v in state.items()}


def _held(ray, actors) -> list[tuple[int, str]]:
    """(version, checksum of the transformer's weights) each actor holds."""
    probe = [a.__ray_call__.remote(lambda self: (self.version(), checksum(
        self.model.trainable_module().state_dict()))) for a in actors]
    return ray.get(probe, timeout=30)


@pytest.mark.parametrize("transport", ["object_store", "collective"])
def test_both_actors_get_bit_identical_weights_and_ignore_stale(ray_session, rollout, transport):
    ray, (actors, state) = ray_session, rollout
    base = ray.get(actors[0].version.remote())
    cfg = WeightSyncConfig(transport=transport, checksum=True, timeout_s=30, bucket_mb=1)
    pub = WeightPublisher(cfg, actors)
    new = _perturbed(state, seed=base + 1)
    rep = pub.publish(new, version=base + 1)
    assert rep.answers == [True, True] and rep.version == base + 1 and rep.nbytes > 0
    assert _held(ray, actors) == [(base + 1, checksum(new))] * 2
    # a second push over the same group (collective: no new rendezvous)
    newer = _perturbed(state, seed=base + 2)
    assert pub.publish(newer, version=base + 2).answers == [True, True]
    # a stale push is ignored on the receiving side
    assert pub.publish(_perturbed(state, seed=99), version=base + 1).answers == [False, False]
    assert _held(ray, actors) == [(base + 2, checksum(newer))] * 2
    pub.close()


def test_collective_peer_that_never_joins_times_out_naming_it(ray_session, rollout):
    ray, (actors, state) = ray_session, rollout

    @ray.remote(num_cpus=0)
    class Deaf:
        def join_weight_group(self, *args) -> int:
            return -1  # answers the call but never joins the group

    deaf = Deaf.remote()
    cfg = WeightSyncConfig(transport="collective", timeout_s=3.0)
    pub = WeightPublisher(cfg, [actors[0], deaf], names=["rollout 0", "rollout 1 (deaf)"])
    t0 = time.monotonic()
    with pytest.raises(WeightSyncTimeout, match=r"rollout 1 \(deaf\) did not join within 3.0 s") as e:
        pub.publish(_perturbed(state, seed=5), version=1000)
    assert "rollout 0," not in str(e.value)
    assert time.monotonic() - t0 < 15
    ray.kill(deaf)
    # the live actor's half-built group timed out on its side too: it never loaded version 1000,
    # and it joins a fresh group and takes the next version (its join call returned; a hung
    # join would hold every later call, and this publish would time out)
    assert ray.get(actors[0].version.remote(), timeout=30) < 1000
    pub = WeightPublisher(WeightSyncConfig(transport="collective", timeout_s=30), [actors[0]])
    new = _perturbed(state, seed=6)
    assert pub.publish(new, version=1001).answers == [True]
    assert _held(ray, actors[:1]) == [(1001, checksum(new))]
    pub.close()
