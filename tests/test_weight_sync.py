"""Weight publishing to two real rollout actors with both transports, and a peer that never joins."""

from __future__ import annotations

import time

import pytest
from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline
from weight_sync_helpers import AlteredInFlight, perturbed

from common.config import RunConfig, WeightSyncConfig
from common.weight_group import WeightSyncTimeout
from common.weights import ChecksumMismatch, checksum, nbytes, plan
from common.weights_record import StreamedWeights
from learner.weight_sync import WeightPublisher, put_stream, stream_state
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
    new = perturbed(state, seed=base + 1)
    rep = pub.publish(new, version=base + 1)
    assert rep.answers == [True, True] and rep.version == base + 1 and rep.nbytes > 0
    assert _held(ray, actors) == [(base + 1, checksum(new))] * 2
    # a second push over the same group (collective: no new rendezvous)
    newer = perturbed(state, seed=base + 2)
    assert pub.publish(newer, version=base + 2).answers == [True, True]
    # a stale push is ignored on the receiving side
    assert pub.publish(perturbed(state, seed=99), version=base + 1).answers == [False, False]
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
        pub.publish(perturbed(state, seed=5), version=1000)
    assert "rollout 0," not in str(e.value)
    assert time.monotonic() - t0 < 15
    ray.kill(deaf)
    # the live actor's half-built group timed out on its side too: it never loaded version 1000,
    # and it joins a fresh group and takes the next version (its join call returned; a hung
    # join would hold every later call, and this publish would time out)
    assert ray.get(actors[0].version.remote(), timeout=30) < 1000
    pub = WeightPublisher(WeightSyncConfig(transport="collective", timeout_s=30), [actors[0]])
    new = perturbed(state, seed=6)
    assert pub.publish(new, version=1001).answers == [True]
    assert _held(ray, actors[:1]) == [(1001, checksum(new))]
    pub.close()


def _two_buckets(state: dict, bucket_bytes: int) -> int:
    """Two of the plan's largest bucket (a tensor larger than bucket_mb travels alone)."""
    return 2 * max(b.nbytes for b in plan(state, bucket_bytes, 0).buckets)


@pytest.mark.parametrize("transport", ["object_store", "collective"])
def test_receivers_load_bucket_by_bucket_holding_two_at_most(ray_session, rollout, transport):
    ray, (actors, state) = ray_session, rollout
    cfg = WeightSyncConfig(transport=transport, timeout_s=30, bucket_mb=nbytes(state) / 16 / 2**20)
    assert len(plan(state, cfg.bucket_bytes, 0).buckets) >= 10  # many buckets, so two is a bound
    assert _two_buckets(state, cfg.bucket_bytes) < nbytes(state) / 2
    base = max(ray.get([a.version.remote() for a in actors]))
    ray.get([a.weight_buckets.remote(reset=True) for a in actors])
    pub = WeightPublisher(cfg, actors)
    new = perturbed(state, seed=base + 7)
    assert pub.publish(new, version=base + 7).answers == [True, True]
    pub.close()
    assert _held(ray, actors) == [(base + 7, checksum(new))] * 2
    for g in ray.get([a.weight_buckets.remote() for a in actors]):
        # the receive buckets alive at once (a bucket counts until its memory can be freed)
        assert 1 <= g["peak"] <= 2 and g["peak_bytes"] <= _two_buckets(state, cfg.bucket_bytes), g
        assert g["live"] == 0 and g["live_bytes"] == 0


def _generates(ray, actor) -> bool:
    from common.types import Condition

    try:
        ray.get(actor.generate.remote(Condition(id="c", prompt="a cat"), 0), timeout=60)
        return True
    except ray.exceptions.RayTaskError as e:
        assert "stopped part-way" in str(e)
        return False


def test_collective_bytes_altered_in_flight_are_refused(ray_session, rollout):
    ray, (actors, state) = ray_session, rollout
    cfg = WeightSyncConfig(transport="collective", timeout_s=30, bucket_mb=nbytes(state) / 8 / 2**20)
    base = max(ray.get([a.version.remote() for a in actors]))
    pub = AlteredInFlight(cfg, actors)
    with pytest.raises(ChecksumMismatch, match="bytes changed on the way"):
        pub.publish(perturbed(state, seed=base + 1), version=base + 1)
    # both actors kept their version; two buckets were loaded, so they refuse to generate
    assert [v for v, _ in _held(ray, actors)] == [base, base]
    assert not _generates(ray, actors[0])
    # the group stayed in step: the next (intact) publish loads, and generation resumes
    good = perturbed(state, seed=base + 2)
    assert WeightPublisher.publish(pub, good, version=base + 2).answers == [True, True]  # count past 5
    assert _held(ray, actors) == [(base + 2, checksum(good))] * 2
    assert _generates(ray, actors[1])
    pub.close()


def test_object_store_bytes_altered_in_store_are_refused(ray_session, rollout):
    import numpy as np

    ray, (actors, state) = ray_session, rollout
    base = max(ray.get([a.version.remote() for a in actors]))
    new = perturbed(state, seed=base + 1)
    record = put_stream(stream_state(new, nbytes(state) // 8, base + 1), "fast")
    assert record.checksum.startswith("xxh3:") and len(record.weights.refs) >= 6
    refs = list(record.weights.refs)
    arrays = [np.array(a) for a in ray.get(refs[-1])]  # writable copies of the last bucket's tensors
    arrays[-1].view(np.uint8).reshape(-1)[arrays[-1].nbytes // 3] ^= 1  # one bit flipped
    refs[-1] = ray.put(arrays)
    altered = StreamedWeights(record.weights.manifest, refs)
    with pytest.raises(ChecksumMismatch, match="bytes changed on the way"):
        ray.get(actors[0].set_weights.remote(altered, base + 1, record.checksum), timeout=60)
    assert not _generates(ray, actors[0])  # the buckets before the last one were loaded
    # a manifest whose digests were rewritten to match the altered bytes does not give the checksum
    forged = dict(record.weights.manifest, digests=[[0, 0]] * len(record.weights.manifest["entries"]))
    with pytest.raises(ChecksumMismatch, match="not the published"):
        ray.get(actors[1].set_weights.remote(StreamedWeights(forged, refs), base + 1, record.checksum))
    assert _generates(ray, actors[1])  # refused before any bucket loaded: it still holds v{base}
    assert ray.get([a.set_weights.remote(record.weights, base + 1, record.checksum) for a in actors]) == [True, True]
    assert _held(ray, actors) == [(base + 1, checksum(new))] * 2
