"""Shared fixtures: one Ray instance per test session (each start costs seconds)."""

from __future__ import annotations

import os

import pytest
import torch

# Tests share 2 cores: keep every torch process to one thread unless a test says otherwise.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

ROLE_RESOURCES = {"rollout": 8, "reward": 8, "learner": 8}


@pytest.fixture(scope="session")
def ray_session():
    """A real local Ray cluster (token authentication left on), shared by the whole session.

    It declares the three role resources so actors placed by pool find a home.
    """
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=4, resources=dict(ROLE_RESOURCES), include_dashboard=False,
                 log_to_driver=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    yield ray
    ray.shutdown()


class _ExternalRedis:
    """A Redis named by $REDIS_URL (e.g. Debian's redis-server), shaped like EmbeddedRedis."""

    def __init__(self, url: str):
        from pydantic import SecretStr

        self.url = SecretStr(url)

    def client(self, **kw):
        import redis

        return redis.Redis.from_url(self.url.get_secret_value(), **kw)


@pytest.fixture(scope="session")
def redis_server():
    """One real redis-server for the session: $REDIS_URL when set, else an EmbeddedRedis
    (loopback, generated password). Yields an object with `url` (SecretStr) and `client()`."""
    url = os.environ.get("REDIS_URL")
    if url:
        yield _ExternalRedis(url)
        return
    from memory_bank.embedded import EmbeddedRedis

    with EmbeddedRedis() as server:
        yield server


@pytest.fixture
def bank(redis_server, request):
    """A MemoryBank on a fresh namespace (capacity 8, fifo), deleted after the test.
    Parametrize indirectly with a dict of BankConfig overrides to change it."""
    import uuid

    from common.config import BankConfig
    from memory_bank.bank import MemoryBank

    overrides = getattr(request, "param", {}) or {}
    cfg = BankConfig(namespace=f"t{uuid.uuid4().hex[:12]}", **overrides)
    client = redis_server.client()
    b = MemoryBank(client, cfg)
    yield b
    b.clear()
    client.close()
