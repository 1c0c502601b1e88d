"""Weight publishing to an SP rollout actor (sp 2: a leader and its follower) on both transports.

The object store: the follower loads the leader's payload itself, from the store. The collective
transport: only the leader is in the weight group, and it forwards every bucket it received to
its follower. Either way both ranks must end on the published weights bit for bit (a rank left
on other weights would split one forward over two different models), and a load that stops
part-way leaves the whole SP group refusing to generate until the next full load.
"""

from __future__ import annotations

import pytest
from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline
from weight_sync_helpers import AlteredInFlight, perturbed

from common.config import RunConfig, WeightSyncConfig
from common.types import Condition
from common.weights import ChecksumMismatch, checksum, nbytes
from learner.weight_sync import WeightPublisher
from rollout_worker.actor import create_rollout_actors
from rollout_worker.models.tiny import tiny_wan_components

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def sp_rollout(ray_session, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-wan-sp-sync")
    comps = tiny_wan_components("t2v", layers=2)
    WanPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), **comps).save_pretrained(path)
    pool = {"num_actors": 1, "num_cpus": 0.25, "torch_threads": 1, "max_restarts": 0, "parallel": {"sp": 2}}
    cfg = RunConfig.model_validate({
        "model": {"family": "wan", "path": str(path), "num_frames": 5, "height": 32, "width": 32,
                  "max_sequence_length": 8},
        "schedule": {"steps": 2}, "sampler": {"group_size": 2},
        "optim": {"finetune": "full"},  # the whole transformer travels
        "pools": {"rollout": pool}})
    (leader,) = create_rollout_actors(cfg, count=1)
    state = {k: v.clone() for k, v in comps["transformer"].state_dict().items()}
    yield leader, state
    ray_session.kill(leader)


def _ranks(ray, leader) -> list[tuple[int, bool, str]]:
    """(version, torn, checksum of the transformer) on the leader and on its follower."""
    def probe(self):  # closures only: Ray pickles them by value (this module is not importable there)
        import ray

        from common.weights import checksum

        def here(w):
            return w.version(), w._torn is not None, checksum(w.model.trainable_module().state_dict())

        return [here(self)] + ray.get([f.__ray_call__.remote(here) for f in self._followers.actors])

    return ray.get(leader.__ray_call__.remote(probe), timeout=120)


def _generates(ray, leader) -> bool:
    try:
        ray.get(leader.generate.remote(Condition(id="c", prompt="a cat"), 0), timeout=300)
        return True
    except ray.exceptions.RayTaskError as e:
        assert "stopped part-way" in str(e)
        return False


@pytest.mark.parametrize("transport", ["object_store", "collective"])
def test_both_sp_ranks_load_the_published_weights(ray_session, sp_rollout, transport):
    ray, (leader, state) = ray_session, sp_rollout
    base = ray.get(leader.version.remote(), timeout=300)
    cfg = WeightSyncConfig(transport=transport, timeout_s=60, bucket_mb=nbytes(state) / 8 / 2**20)
    pub = WeightPublisher(cfg, [leader])
    new = perturbed(state, seed=base + 1)
    assert pub.publish(new, version=base + 1).answers == [True]
    assert _ranks(ray, leader) == [(base + 1, False, checksum(new))] * 2
    assert pub.publish(perturbed(state, seed=99), version=base + 1).answers == [False]  # stale: ignored
    pub.close()
    assert _ranks(ray, leader) == [(base + 1, False, checksum(new))] * 2
    assert _generates(ray, leader)  # the follower's digest equals the leader's


def test_a_collective_load_refused_part_way_leaves_the_sp_group_not_generating(ray_session, sp_rollout):
    ray, (leader, state) = ray_session, sp_rollout
    base = ray.get(leader.version.remote(), timeout=300)
    cfg = WeightSyncConfig(transport="collective", timeout_s=60, bucket_mb=nbytes(state) / 8 / 2**20)
    pub = AlteredInFlight(cfg, [leader])
    with pytest.raises(ChecksumMismatch, match="bytes changed on the way"):
        pub.publish(perturbed(state, seed=base + 3), version=base + 3)
    # the leader stopped after two buckets, the follower got them and no end: neither is whole
    assert [(v, torn) for v, torn, _ in _ranks(ray, leader)] == [(base, True)] * 2
    assert not _generates(ray, leader)
    # the next (intact) publish over the same group loads on both ranks, and generation resumes
    new = perturbed(state, seed=base + 4)
    assert WeightPublisher.publish(pub, new, version=base + 4).answers == [True]  # count past 5
    pub.close()
    assert _ranks(ray, leader) == [(base + 4, False, checksum(new))] * 2
    assert _generates(ray, leader)
