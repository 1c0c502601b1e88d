"""Shared fixtures: one Ray instance per test session (each start costs seconds)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
import torch
from suite_groups import SESSION_RAY, Entry, groups

# Tests share 2 cores: keep every torch process to one thread unless a test says otherwise.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

ROLE_RESOURCES = {"rollout": 8, "reward": 8, "learner": 8}


GROUPS_ENV = "VGRPO_SUITE_GROUPS"  # the file the workers write their {nodeid: group} to


def pytest_configure(config):
    config.addinivalue_line("markers", "session_ray: the test joins the session's Ray through request.getfixturevalue "
                                       "(tests/suite_groups.py)")
    if config.getoption("dist", "no") == "loadgroup" and not hasattr(config, "workerinput"):
        # the controller: its workers start after this and inherit the variable
        fd, path = tempfile.mkstemp(prefix="vgrpo-suite-groups-", suffix=".json")
        os.close(fd)
        os.environ[GROUPS_ENV] = path


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput") and os.environ.get(GROUPS_ENV):
        Path(os.environ.pop(GROUPS_ENV)).unlink(missing_ok=True)


def pytest_collection_modifyitems(config, items):
    """A worker of `make test` (pytest-xdist, --dist loadgroup) writes which unit of work each test
    is in (tests/suite_groups.py) for the controller's scheduler below."""
    path = os.environ.get(GROUPS_ENV)
    if not path or not hasattr(config, "workerinput"):
        return

    def described(it) -> Entry:
        defs = getattr(it, "_fixtureinfo", None)
        defs = defs.name2fixturedefs if defs is not None else {}
        shared = {name for name, fds in defs.items() if fds and fds[-1].scope in ("module", "class", "package")}
        return Entry(it.nodeid, frozenset(getattr(it, "fixturenames", ())), frozenset(shared),
                     it.get_closest_marker("session_ray") is not None)

    tmp = f"{path}.{config.workerinput['workerid']}"
    with open(tmp, "w") as f:
        json.dump(groups(described(it) for it in items), f)
    os.replace(tmp, path)  # both workers collect the same tests: either file is the whole answer


def pytest_xdist_make_scheduler(config, log):
    """xdist's loadgroup reads groups from a nodeid suffix that pytest 9.2 no longer lets it set;
    the same scheduling (one unit of work per group, in collection order), from the workers' file."""
    if config.getoption("dist", "no") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SuiteGroups(LoadScopeScheduling):
        _groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self._groups is None:
                with open(os.environ[GROUPS_ENV]) as f:
                    self._groups = json.load(f)
            return self._groups[nodeid]

    return SuiteGroups(config, log)


def _hold_the_session_ray(tmp_path_factory) -> None:
    """Under xdist only one worker may start the session's Ray (tests/suite_groups.py): a second
    one means a test asked for it outside the session-ray group, and would pay a second Ray."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker:
        return
    owner = tmp_path_factory.getbasetemp().parent / "session-ray.worker"
    try:
        fd = os.open(owner, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        pytest.fail(f"xdist worker {worker} asked for the session's Ray, which worker {owner.read_text()} holds: "
                    f"its test is outside the {SESSION_RAY!r} group; mark it "
                    "`pytest.mark.session_ray` (tests/suite_groups.py)", pytrace=False)
    os.write(fd, worker.encode())
    os.close(fd)


@pytest.fixture(scope="session")
def ray_session(tmp_path_factory):
    """A real local Ray cluster (token authentication left on), shared by the whole session.

    It declares the three role resources so actors placed by pool find a home, and one GPU
    (simulated on a machine without one: Ray's resource only), which no test asks for but the
    one-GPU recipe's toy twin (tests/test_entry_twin.py, pools.simulated_gpus): its three roles
    share it by fractions, as on the recipe's real device.
    """
    import ray

    _hold_the_session_ray(tmp_path_factory)
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
