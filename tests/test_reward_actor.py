"""Reward actor mechanics on a real local Ray: batching, invalid rows, timeouts, retries, merging.

The models here are small test-only RewardModels (the real scorers are tested without Ray in
test_reward_models.py), so the actors start fast.
"""

from __future__ import annotations

import functools
import sys
import time

import pytest
import torch

from common.config import ConfigError, PoolConfig, RewardModelConfig
from reward_worker.actor import (
    RewardClient,
    RewardFailed,
    RewardTimeout,
    actor_names,
    create_reward_actor,
)
from reward_worker.base import RewardModel

POOL = PoolConfig(num_cpus=0.25, torch_threads=1, max_restarts=0)


class MeanColour(RewardModel):
    """Heads = mean channel values in [0, 1]; a prompt with 'nan' / 'inf' poisons one head."""

    name = "colour"

    def __init__(self, cfg: RewardModelConfig, heads: tuple[str, ...] = ("R", "G")):
        self.heads, self.max_batch = heads, cfg.batch_size

    def score(self, frames, prompts, images=None):
        if len(prompts) > self.max_batch:
            raise AssertionError(f"got {len(prompts)} > batch_size {self.max_batch}")
        out = frames.float().mean(dim=(1, 2, 3))[:, : len(self.heads)] / 255.0     # [B, H]
        for i, p in enumerate(prompts):
            if "nan" in p:
                out[i, 0] = float("nan")
            if "inf" in p:
                out[i, -1] = float("inf")
        return out


class Sleepy(RewardModel):
    """Sleeps `seconds` on its first `times` calls, then answers at once."""

    heads = ("S",)

    def __init__(self, cfg: RewardModelConfig, seconds: float, times: int):
        self.seconds, self.left = seconds, times

    def score(self, frames, prompts, images=None):
        if self.left > 0:
            self.left -= 1
            time.sleep(self.seconds)
        return torch.ones(len(prompts), 1)


class Broken(RewardModel):
    heads = ("X",)

    def __init__(self, cfg: RewardModelConfig):
        pass

    def score(self, frames, prompts, images=None):
        raise RuntimeError("scorer exploded")


@pytest.fixture(scope="module")
def ray_mod(ray_session):
    # Ray workers cannot import this test module by name: ship its classes by value.
    ray_session.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    actors = []

    def make(cfg, factory):
        a = create_reward_actor(cfg, POOL, factory)
        actors.append(a)
        return a

    yield ray_session, make
    for a in actors:
        ray_session.kill(a)


def frames(b: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, 3, 8, 8, 3), dtype=torch.uint8, generator=g)


@pytest.fixture(scope="module")
def colour(ray_mod):
    """One MeanColour actor (batch_size 3) shared by the tests that need a plain scorer."""
    cfg = RewardModelConfig(name="toy", batch_size=3, weights={"R": 0.5, "G": 2.0})
    return ray_mod[1](cfg, MeanColour), cfg


def test_batch_of_4_equals_one_by_one(ray_mod, colour):
    ray, _ = ray_mod
    actor, _ = colour
    v, prompts = frames(4), ["a", "b", "c", "d"]
    batch = ray.get(actor.score.remote(v, prompts))                 # split 3 + 1 inside the actor
    one = [ray.get(actor.score.remote(v[i:i + 1], prompts[i:i + 1])) for i in range(4)]
    assert batch.heads == ["R", "G"]
    torch.testing.assert_close(batch.values, torch.cat([s.values for s in one]))
    torch.testing.assert_close(batch.values, v.float().mean(dim=(1, 2, 3))[:, :2] / 255.0)
    assert ray.get(actor.heads.remote()) == ["R", "G"]


def test_non_finite_rows_become_nan_and_are_counted(ray_mod, colour):
    ray, _ = ray_mod
    actor, _ = colour
    before = ray.get(actor.invalid_count.remote())
    s = ray.get(actor.score.remote(frames(4), ["ok", "nan here", "inf here", "ok"]))
    assert s.valid.tolist() == [True, False, False, True]
    assert torch.isnan(s.values[1:3]).all()                          # the whole row, not just the head
    assert torch.isfinite(s.values[[0, 3]]).all()
    assert ray.get(actor.invalid_count.remote()) == before + 2
    ray.get(actor.score.remote(frames(1), ["nan"]))
    assert ray.get(actor.invalid_count.remote()) == before + 3


def test_bad_request_is_a_clear_error(ray_mod, colour):
    ray, _ = ray_mod
    actor, _ = colour
    with pytest.raises(ray.exceptions.RayTaskError, match="uint8"):
        ray.get(actor.score.remote(frames(2).float(), ["a", "b"]))
    with pytest.raises(ray.exceptions.RayTaskError, match="2 videos but 1 prompts"):
        ray.get(actor.score.remote(frames(2), ["a"]))


def test_timeout_is_retried_then_raised_in_bounded_time(ray_mod):
    ray, make = ray_mod
    cfg = RewardModelConfig(name="toy", timeout_s=0.4, retries=2)
    actor = make(cfg, functools.partial(Sleepy, seconds=30.0, times=99))
    client = RewardClient({"sleepy": actor}, {"sleepy": cfg})
    t0 = time.monotonic()
    with pytest.raises(RewardTimeout, match="'sleepy'.*0.4s.*3 tries"):
        client.score(frames(2), ["a", "b"])
    elapsed = time.monotonic() - t0
    assert client.timeouts["sleepy"] == 3                           # 1 try + 2 retries
    assert 1.1 < elapsed < 6.0                                       # 3 × 0.4 s, far below the 30 s sleep


def test_a_slow_first_try_recovers_on_retry(ray_mod):
    ray, make = ray_mod
    cfg = RewardModelConfig(name="toy", timeout_s=0.8, retries=1)
    actor = make(cfg, functools.partial(Sleepy, seconds=1.2, times=1))
    ray.get(actor.heads.remote())                                    # started before the clock runs
    client = RewardClient({"slow": actor}, {"slow": cfg})
    s = client.score(frames(2), ["a", "b"])
    assert s.values.tolist() == [[1.0], [1.0]] and client.timeouts["slow"] == 1


def test_a_failing_model_raises_after_retries(ray_mod):
    ray, make = ray_mod
    cfg = RewardModelConfig(name="toy", retries=1)
    client = RewardClient({"broken": make(cfg, Broken)}, {"broken": cfg})
    with pytest.raises(RewardFailed, match="'broken'.*2 tries: RuntimeError: scorer exploded"):
        client.score(frames(1), ["a"])
    assert client.failures["broken"] == 2


def test_two_models_side_by_side_merge_heads(ray_mod, colour):
    ray, make = ray_mod
    a, cfg_a = colour
    cfg_b = RewardModelConfig(name="toy", weights={"B": 3.0})
    b = make(cfg_b, functools.partial(MeanColour, heads=("B", "B2", "R2")))
    client = RewardClient({"a": a, "b": b}, {"a": cfg_a, "b": cfg_b})
    v = frames(3, seed=4)
    s = client.score(v, ["x", "y", "z"])
    assert s.heads == ["R", "G", "B", "B2", "R2"] and list(client.heads.names) == s.heads
    mean = v.float().mean(dim=(1, 2, 3)) / 255.0                   # [3, 3] per channel
    torch.testing.assert_close(s.values, torch.cat([mean[:, :2], mean], dim=1))
    assert client.heads.weights == (0.5, 2.0, 3.0, 1.0, 1.0)
    expected = 0.5 * mean[:, 0] + 2.0 * mean[:, 1] + 3.0 * mean[:, 0] + mean[:, 1] + mean[:, 2]
    torch.testing.assert_close(client.heads.composite(s), expected)
    assert client.invalid_counts()["b"] == 0


def test_two_models_reporting_one_head_name_are_refused_in_one_line(ray_mod, colour):
    """Per-head advantages and the composite could not tell the two heads apart."""
    ray, make = ray_mod
    a, cfg_a = colour
    cfg_b = RewardModelConfig(name="toy")
    b = make(cfg_b, functools.partial(MeanColour, heads=("B", "G")))
    with pytest.raises(ConfigError) as e:
        RewardClient({"a": a, "b": b}, {"a": cfg_a, "b": cfg_b})
    assert str(e.value) == ("rewards.models[0] (a) and rewards.models[1] (b) both report a head named 'G'; "
                            "head names must be unique across reward models: drop one of the two models")


def test_actor_names_number_repeated_models():
    cfgs = [RewardModelConfig(name="videoalign"), RewardModelConfig(name="toy"), RewardModelConfig(name="toy")]
    assert actor_names(cfgs) == ["videoalign", "toy0", "toy1"]
