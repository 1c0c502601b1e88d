"""Publishing a new policy version to the rollout actors.

Two transports (cfg.weight_sync.transport):
- `object_store`: one `ray.put` of the payload; each actor gets the ref and calls
  `set_weights(payload, version, checksum)`. The default on one node.
- `collective`: a bucketed broadcast (common.weights) over a process group of this process
  (rank 0) and the actors (ranks 1..n): gloo on CPU, NCCL on GPU. Each actor is told the
  manifest with `receive_weights(version, manifest)` and then takes part in the broadcasts.

Every step is bounded: the group's own timeout on each collective and a bounded `ray.get` on
the actors' answers. A peer that does not answer is named in a WeightSyncTimeout. The
receiving side ignores a version older than the one it holds (but still drains the
broadcast, so the group stays in step).
"""

from __future__ import annotations

import socket
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import ray
import torch
import torch.distributed as dist
from torch import Tensor

from common import weights as W
from common.config import WeightSyncConfig
from common.weight_group import WeightSyncTimeout, backend_for, join_key, make_process_group


@dataclass
class PublishReport:
    version: int
    transport: str
    seconds: float
    nbytes: int
    answers: list[Any] = field(default_factory=list)   # what each actor's set/receive call returned


def _host_ip() -> str:
    if ray.is_initialized():
        return ray.util.get_node_ip_address()
    return socket.gethostbyname(socket.gethostname())


class WeightPublisher:
    """Pushes versioned weights from this process to a fixed list of rollout actors."""

    def __init__(self, cfg: WeightSyncConfig, actors: list, names: list[str] | None = None,
                 device: torch.device | str = "cpu"):
        if names is not None and len(names) != len(actors):
            raise ValueError(f"names has {len(names)} entries for {len(actors)} actors")
        self.cfg = cfg
        self.actors = list(actors)
        self.names = names or [f"rollout actor {i}" for i in range(len(actors))]
        self.device = torch.device(device)
        self._pg: dist.ProcessGroup | None = None
        self._store: dist.Store | None = None

    # --- the one verb ------------------------------------------------------------------

    def publish(self, payload: dict[str, Tensor], version: int) -> PublishReport:
        t0 = time.perf_counter()
        if self.cfg.transport == "object_store":
            answers = self._publish_object_store(payload, version)
        else:
            answers = self._publish_collective(payload, version)
        return PublishReport(version, self.cfg.transport, time.perf_counter() - t0,
                             W.nbytes(payload), answers)

    def close(self) -> None:
        """Forget the weight group; a later collective publish builds a fresh one."""
        self._pg = self._store = None

    # --- object store ------------------------------------------------------------------

    def _publish_object_store(self, payload: dict[str, Tensor], version: int) -> list[Any]:
        cpu = {k: v.detach().cpu() for k, v in payload.items()}
        from rollout_worker.weight_receiver import pack

        ref = ray.put(pack(cpu))  # numpy buffers: one copy in, every actor maps them without a copy
        digest = W.checksum(cpu) if self.cfg.checksum else None
        calls = [a.set_weights.remote(ref, version, digest) for a in self.actors]
        return self._answers(calls, "set_weights")

    # --- collective --------------------------------------------------------------------

    def _publish_collective(self, payload: dict[str, Tensor], version: int) -> list[Any]:
        if self._pg is None:
            self._connect()
        manifest, buckets = W.flatten(payload, self.cfg.bucket_mb << 20, version,
                                      with_checksum=self.cfg.checksum)
        calls = [a.receive_weights.remote(version, manifest.to_dict()) for a in self.actors]
        try:
            for b in buckets:
                self._pg.broadcast(b.to(self.device), 0).wait()  # the group's timeout bounds it
        except RuntimeError as e:
            self.close()  # a broken group is rebuilt on the next publish
            late = self._who_failed(calls)
            raise WeightSyncTimeout(f"weight broadcast of version {version} failed: {late} ({e})") from None
        return self._answers(calls, "receive_weights")

    def _connect(self) -> None:
        # 1. A store served here, on a free port, with a fresh prefix for this group's keys.
        world = len(self.actors) + 1
        host, timeout = _host_ip(), self.cfg.timeout_s
        base = dist.TCPStore(host, 0, world, True, timedelta(seconds=timeout), wait_for_workers=False)
        prefix = f"vgrpo-weights/{uuid.uuid4().hex}"
        store = dist.PrefixStore(prefix, base)
        backend = backend_for(self.device)
        # 2. Ask every actor to join; their calls return once the group is built.
        joins = [a.join_weight_group.remote(host, base.port, prefix, i + 1, world, backend, timeout)
                 for i, a in enumerate(self.actors)]
        # 3. Wait for the join keys, naming whoever did not come.
        keys = [join_key(r) for r in range(1, world)]
        try:
            store.wait(keys, timedelta(seconds=timeout))
        except Exception:
            missing = [self.names[r - 1] for r in range(1, world) if not store.check([join_key(r)])]
            for ref in joins:
                ray.cancel(ref, force=False)
            raise WeightSyncTimeout(f"weight group at {host}:{base.port}: {', '.join(missing)} did not "
                                    f"join within {timeout} s") from None
        # 4. Our side of the group, then the actors' acknowledgements.
        self._pg = make_process_group(store, 0, world, backend, timeout)
        self._store = base
        self._answers(joins, "join_weight_group")

    # --- bounded waits -----------------------------------------------------------------

    def _answers(self, calls: list, verb: str) -> list[Any]:
        ready, pending = ray.wait(calls, num_returns=len(calls), timeout=self.cfg.timeout_s)
        if pending:
            late = [self.names[i] for i, c in enumerate(calls) if c in pending]
            if verb != "set_weights":
                self.close()
            raise WeightSyncTimeout(f"{verb}: {', '.join(late)} did not answer within "
                                    f"{self.cfg.timeout_s} s")
        return ray.get(calls)  # all ready: re-raises an actor's own error unchanged

    def _who_failed(self, calls: list) -> str:
        ready, _ = ray.wait(calls, num_returns=len(calls), timeout=1.0)
        parts = []
        for i, c in enumerate(calls):
            if c not in ready:
                parts.append(f"{self.names[i]} did not answer")
                continue
            try:
                ray.get(c)
            except Exception as e:
                parts.append(f"{self.names[i]} failed: {type(e).__name__}")
        return "; ".join(parts) or "no peer reported an error"
