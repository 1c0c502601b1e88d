"""The reward pool: `pools.reward.num_actors` replicas per model, load-balanced, and a slow or
dead replica's call retried on another one (real local Ray, small test-only scorers)."""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

from common.config import PoolConfig, RewardModelConfig
from reward_worker.actor import RewardClient, create_reward_actor, create_reward_actors
from reward_worker.base import RewardModel

POOL = PoolConfig(num_cpus=0, torch_threads=1, max_restarts=0)


class Pid(RewardModel):
    """One head: the scoring process's pid (so a test sees which replica answered)."""

    heads = ("pid",)

    def __init__(self, cfg: RewardModelConfig, hang_s: float = 0.0, head: str = "pid"):
        self.hang_s, self.head = hang_s, head

    def head_names(self) -> list[str]:
        return [self.head]

    def score(self, frames, prompts, images=None):
        time.sleep(self.hang_s)
        return torch.full((len(prompts), 1), float(os.getpid()))


@pytest.fixture(scope="module")
def ray_mod(ray_session):
    ray_session.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return ray_session


def _frames(b: int = 2) -> torch.Tensor:
    return torch.zeros(b, 2, 4, 4, 3, dtype=torch.uint8)


def _pids(ray, actors) -> list[float]:
    return [float(p) for p in ray.get([a.__ray_call__.remote(lambda self: os.getpid()) for a in actors])]


def test_num_actors_replicas_per_model_and_calls_spread_over_them(ray_mod):
    ray = ray_mod
    cfgs = {"toy": RewardModelConfig(name="toy"), "hpsv3": RewardModelConfig(name="hpsv3")}
    pool = create_reward_actors(list(cfgs.values()), POOL.model_copy(update={"num_actors": 3}),
                                lambda c: Pid(c, head=f"pid_{c.name}"))
    try:
        assert sorted(pool) == ["hpsv3", "toy"] and all(len(a) == 3 for a in pool.values())
        client = RewardClient(pool, cfgs)
        seen = [client.score(_frames(), ["a", "b"]).values[0, 0].item() for _ in range(6)]
        # sequential calls rotate over the three replicas of toy (head "pid_toy")
        assert sorted(set(seen)) == sorted(_pids(ray, pool["toy"]))
        # a second caller with another offset starts on another replica
        other = RewardClient(pool, cfgs, offset=1)
        assert other.score(_frames(), ["a", "b"]).values[0, 0].item() == _pids(ray, pool["toy"])[1]
    finally:
        for acts in pool.values():
            for a in acts:
                ray.kill(a)


def test_a_slow_replica_is_retried_on_another(ray_mod):
    ray = ray_mod
    cfg = RewardModelConfig(name="toy", timeout_s=1.0, retries=1)
    slow = create_reward_actor(cfg, POOL, lambda c: Pid(c, hang_s=60.0))
    fast = create_reward_actor(cfg, POOL, lambda c: Pid(c))
    try:
        ray.get([slow.heads.remote(), fast.heads.remote()])
        client = RewardClient({"toy": [slow, fast]}, {"toy": cfg})  # the first call goes to `slow`
        t0 = time.monotonic()
        s = client.score(_frames(), ["a", "b"])
        assert s.values[0, 0].item() == _pids(ray, [fast])[0]
        assert client.timeouts["toy"] == 1 and time.monotonic() - t0 < 10
    finally:
        ray.kill(slow)
        ray.kill(fast)


def test_a_dead_replica_is_retried_on_another(ray_mod):
    ray = ray_mod
    cfg = RewardModelConfig(name="toy", retries=1)
    dead = create_reward_actor(cfg, POOL, lambda c: Pid(c))
    live = create_reward_actor(cfg, POOL, lambda c: Pid(c))
    try:
        client = RewardClient({"toy": [dead, live]}, {"toy": cfg})
        ray.kill(dead, no_restart=True)
        s = client.score(_frames(), ["a", "b"])
        assert s.values[0, 0].item() == _pids(ray, [live])[0] and client.failures["toy"] == 1
    finally:
        ray.kill(live)
