"""How an actor in another process reaches the bank: by reference, never with the password.

A `BankRef` holds the bank config with `redis_url` removed, plus where the URL lives: the
name of an environment variable every worker has (a KubeRay pod gets it from a Secret), or a
0600 file in a 0700 directory on the driver's node. Ray pickles actor arguments into its
control store, so the URL itself never goes into them.

On a cluster of several nodes that file is on one node only. A worker elsewhere asks a
`UrlServer`: a zero-CPU actor pinned to the driver's node that reads the file there and returns
the URL as the answer of a call. The answer goes straight back to the asking worker over Ray's
token-authenticated RPC (a small return is carried in the reply, not kept in the control store,
unlike arguments), so the URL is held only by the file and by the processes that connect. This
is as safe as the file alone: whoever can call that actor holds the cluster's Ray token, and
with it can already run a task on the driver's node as the same user and read the file.

It also carries the run's fence (its lease value, not a secret): the actor's bank passes it to
every script that moves a group, so an actor of a run that lost its lease is refused too.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.config import BankConfig
from memory_bank.bank import MemoryBank
from memory_bank.connect import client_from_url
from memory_bank.ownership import held_fence
from memory_bank.url_server import UrlServer

URL_FETCH_TIMEOUT_S = 120.0  # a UrlServer answers at once; this bounds a dead driver node


@dataclass(frozen=True)
class BankRef:
    cfg: BankConfig                # redis_url is always None here
    env: str | None = None         # read the URL from this environment variable
    file: str | None = None        # or from this file (mode 0600)...
    node: str | None = None        # ...on this Ray node (None: on every reader's own node)
    server: Any = None             # readers on other nodes ask this UrlServer actor on `node`
    fence: str | None = None       # the run's lease value (memory_bank.ownership)

    def url(self) -> str:
        if self.env:
            url = os.environ.get(self.env)
            if not url:
                raise RuntimeError(f"bank: ${self.env} is not set on this worker; set it on every node "
                                   "(bank.redis_url_env), as the driver has it")
            return url
        if self.file and (self.node is None or self.node == _this_node()):
            try:
                return Path(self.file).read_text().strip()
            except OSError as e:
                raise RuntimeError(f"bank: cannot read the Redis URL file {self.file} ({e.strerror}); "
                                   "with an embedded Redis every actor must run on the driver's node, "
                                   "otherwise set bank.redis_url_env on every node") from None
        fix = f"set ${self.cfg.redis_url_env} on every node to the URL of a Redis every node reaches"
        if self.server is not None:
            return _ask(self.server, f"the driver's node ({self.node}) did not give the Redis URL", fix)
        if self.file:
            raise RuntimeError(f"bank: the Redis URL file is on Ray node {self.node}, not on this one; {fix}")
        raise RuntimeError("bank reference names neither an environment variable nor a file")

    def open(self):
        """A MemoryBank on its own connection (one per actor process)."""
        return MemoryBank(client_from_url(self.url(), self.cfg.allow_no_password), self.cfg,
                          fence=self.fence)


def make_ref(cfg: BankConfig, url: str, secret_dir: str | Path | None = None,
             other_nodes: bool = False, fence: str | None = None) -> tuple[BankRef, Path | None]:
    """A reference for `url`: the env variable when that is where the URL came from, else a
    0600 file in a fresh 0700 directory (returned, for the caller to delete at teardown).
    other_nodes: readers may run on other Ray nodes, so a UrlServer pinned to this node serves
    them the file (`ref.server`: the caller ends it at teardown). The fence defaults to the
    lease this process holds on the namespace (claim_namespace first)."""
    bare = cfg.model_copy(update={"redis_url": None})
    fence = fence if fence is not None else held_fence(cfg.namespace)
    if cfg.redis_url is None and os.environ.get(cfg.redis_url_env) == url:
        return BankRef(bare, env=cfg.redis_url_env, fence=fence), None
    folder = Path(tempfile.mkdtemp(prefix="vgrpo-bank-", dir=secret_dir))
    os.chmod(folder, 0o700)
    path = folder / "redis_url"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(url)
    if not other_nodes:
        return BankRef(bare, file=str(path), fence=fence), folder
    node, server = _serve(str(path))
    return BankRef(bare, file=str(path), node=node, server=server, fence=fence), folder


def _serve(path: str) -> tuple[str, Any]:
    """A UrlServer on this node (the caller's), for `path`."""
    # heavy: ray
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    server = ray.remote(UrlServer).options(
        num_cpus=0, max_restarts=-1, max_task_retries=-1,  # a crash is restarted on the same node
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(path)
    return node, server


def _this_node() -> str | None:
    import ray  # heavy: ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


def _ask(server, what: str, fix: str) -> str:
    import ray  # heavy: ray

    try:
        return ray.get(server.url.remote(), timeout=URL_FETCH_TIMEOUT_S)
    except (ray.exceptions.RayError, OSError) as e:
        raise RuntimeError(f"bank: {what} ({type(e).__name__}); {fix}") from None
