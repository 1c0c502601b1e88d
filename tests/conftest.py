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

    It declares the three role resources so actors placed by pool find a home, and one GPU
    (simulated on a machine without one: Ray's resource only), which no test asks for but the
    one-GPU recipe's toy twin (tests/test_entry_twin.py, pools.simulated_gpus): its three roles
    share it by fractions, as on the recipe's real device.
    """
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=4, num_gpus=1, resources=dict(ROLE_RESOURCES), include_dashboard=False,
                 log_to_driver=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def ray_address(ray_session) -> str:
    """The session cluster's address, for a `vgrpo` subprocess to join (RAY_ADDRESS) where the
    test is not about the cluster the command starts: it saves that command a Ray start. Build
    the subprocess's environment after asking for it: starting the cluster sets RAY_AUTH_MODE=token
    in os.environ, which a client joining it needs."""
    return ray_session.get_runtime_context().gcs_address


class _ExternalRedis:
    """A Redis named by $REDIS_URL (e.g. Debian's redis-server), shaped like EmbeddedRedis."""

    def __init__(self, url: str):
        from pydantic import SecretStr

        self.url = SecretStr(url)

    def client(self, **kw):
        import redis

        return redis.Redis.from_url(self.url.get_secret_value(), **kw)

    def admin_client(self, **kw):
        """The same user: an external server's owner is whoever holds its URL."""
        return self.client(**kw)


@pytest.fixture(scope="session")
def redis_server():
    """One real redis-server for the session: $REDIS_URL when set, else an EmbeddedRedis
    (loopback, generated passwords). Yields an object with `url` (SecretStr), `client()` (the
    actors' user: the bank's commands and scripts only) and `admin_client()` (its owner's)."""
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


# What points s3fs (in this process and in every process it starts: `vgrpo` subprocesses, gloo
# ranks, a Ray cluster they start) at the loopback S3 endpoint. moto takes any credentials.
S3_ENV = {"AWS_ACCESS_KEY_ID": "vgrpo-test", "AWS_SECRET_ACCESS_KEY": "vgrpo-test",
          "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="session")
def s3_server():
    """A real S3 endpoint on 127.0.0.1 (moto's server mode in a thread, a free port), for the
    session; the AWS_* variables above plus AWS_ENDPOINT_URL are set while it runs. Yields the URL."""
    import logging
    import socket

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    url = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in (*S3_ENV, "AWS_ENDPOINT_URL")}
    os.environ.update({**S3_ENV, "AWS_ENDPOINT_URL": url})
    try:
        yield url
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def s3_root(s3_server, tmp_path, monkeypatch):
    """`s3://<a fresh bucket>/runs` on the loopback endpoint, the bucket deleted afterwards; run
    staging folders ($VGRPO_CACHE_DIR) go under the test's tmp_path."""
    import uuid

    from common import storage

    monkeypatch.setenv("VGRPO_CACHE_DIR", str(tmp_path / "cache"))
    bucket = f"vgrpo-test-{uuid.uuid4().hex[:10]}"
    fs, _ = storage.filesystem(f"s3://{bucket}")
    fs.mkdir(bucket)
    yield f"s3://{bucket}/runs"
    fs.invalidate_cache()
    fs.rm(bucket, recursive=True)
