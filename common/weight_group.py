"""Rendezvous for the weight-sync process group shared by learner rank 0 and rollout actors.

That group is not the learner's default torch.distributed group (a process has only one, and
the rollout actors are not in the learner's), so it is built directly: a TCPStore served by
the publisher, a fresh key prefix per group, and a Gloo (CPU) or NCCL (GPU) process group
object. Each peer writes a `joined/<rank>` key first, so the publisher can name the peers
that never came instead of waiting in an anonymous rendezvous.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

Backend = Literal["gloo", "nccl"]


class WeightSyncTimeout(TimeoutError):
    """A weight-group peer did not join or answer in time; the message names it."""


def join_key(rank: int) -> str:
    return f"joined/{rank}"


def backend_for(device: torch.device | str) -> Backend:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def make_process_group(store: dist.Store, rank: int, world_size: int, backend: Backend,
                       timeout_s: float) -> dist.ProcessGroup:
    """A process-group object on `store`; every collective on it times out after timeout_s."""
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)
    raise ValueError(f"weight group backend {backend!r} is not one of gloo, nccl")


def join_as_peer(host: str, port: int, prefix: str, rank: int, world_size: int,
                 backend: Backend, timeout_s: float) -> dist.ProcessGroup:
    """Connect to the publisher's store, announce this rank, and build the group (blocks until all joined)."""
    if not 1 <= rank < world_size:
        raise ValueError(f"weight group rank {rank} is outside 1..{world_size - 1} (rank 0 is the publisher)")
    timeout = timedelta(seconds=timeout_s)
    try:
        base = dist.TCPStore(host, port, world_size, False, timeout)
    except Exception as e:
        raise WeightSyncTimeout(f"weight group rank {rank}: cannot reach the publisher's store at "
                                f"{host}:{port} within {timeout_s} s ({e})") from None
    store = dist.PrefixStore(prefix, base)
    store.set(join_key(rank), "1")
    return make_process_group(store, rank, world_size, backend, timeout_s)
