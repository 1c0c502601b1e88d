"""Publishing a new policy version to the rollout actors, bucket by bucket.

A publish is a `WeightStream`: the manifest (planned from names, shapes and the wire dtypes,
no data) and the buckets, filled one at a time as they are sent, each tensor gathered (FSDP2)
only when its bucket is being filled. Neither side holds more than two buckets.

Two transports (cfg.weight_sync.transport):
- `object_store`: each bucket is one `ray.put` of its tensors' numpy buffers (`put_stream`); the record
  (manifest with each tensor's digest, the refs, the checksum) goes to the actors'
  `set_weights`, which map and load one bucket at a time. The default on one node.
- `collective`: a broadcast per bucket (and of its digests) over a process group of this process
  (rank 0) and the actors (ranks 1..n): gloo on CPU, NCCL on GPU. Each actor is told the
  manifest with `receive_weights(version, manifest)` and then takes part in the broadcasts.
  The group is built on the first publish and rebuilt after a failure (`close`); a stream
  only starts once the group is up, so a rebuild never meets a half-sent version.

Every step is bounded: the store's and the group's timeouts on the rendezvous, a bounded poll
on each broadcast (common/weight_group.WeightGroup.wait), a bounded `ray.wait` on the actors'
answers. A peer that does not answer is named in a WeightSyncTimeout. A member that dies (its
`receive_weights` call fails) or gives up mid-broadcast makes the publisher abort the group at
once: the other members, polling the group's abort key, return within a poll instead of at
their timeout, and the next publish builds a new group. The receiving side ignores a version
older than the one it holds (but still drains the broadcast, so the group stays in step), and
refuses a bucket whose digest differs.
"""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import ray
import torch
import torch.distributed as dist
from torch import Tensor

from common import weights as W
from common.config import WeightSyncConfig
from common.weight_group import (
    WeightGroup,
    WeightGroupAborted,
    WeightSyncTimeout,
    backend_for,
    join_key,
    make_process_group,
)
from common.weights_record import StreamedWeights, WeightsRecord
from learner.fsdp import full_tensors

WHO_FAILED_S = 5.0  # how long a failed collective publish waits for its members' calls to say why


class WeightStream:
    """One version on its way out: `manifest` and `buckets`, filled from `tensors` (the full
    tensors in manifest order, each produced when asked: a gather under FSDP2)."""

    def __init__(self, manifest: W.Manifest, tensors: Iterator[Tensor]):
        self.manifest, self.tensors = manifest, iter(tensors)
        # two buffers in turn: a bucket stays valid while the next one is filled (two in flight)
        self.buckets = W.fill(manifest, self.tensors, ring=2)

    def drain(self) -> None:
        """Produce every tensor not yet produced (the learner's other ranks gather them all)."""
        for _ in self.tensors:
            pass


def stream_tensors(tensors: dict[str, Tensor], wire: dict[str, torch.dtype], bucket_bytes: int,
                   version: int) -> WeightStream:
    """A stream of `tensors` (plain or DTensor shards) in their wire dtypes: each is cast on its
    shard and gathered only when its bucket is filled (learner.fsdp.full_tensors)."""
    m = W.plan([W.TensorSpec(k, tuple(v.shape), wire[k]) for k, v in tensors.items()], bucket_bytes, version)
    return WeightStream(m, full_tensors((tensors[e.name], wire[e.name]) for e in m.entries))


def stream_state(state: dict[str, Tensor], bucket_bytes: int, version: int) -> WeightStream:
    """A stream of a plain state dict, as it is (its dtypes are the wire's)."""
    m = W.plan(state, bucket_bytes, version)
    return WeightStream(m, (state[e.name] for e in m.entries))


def host_array(bucket: Tensor):
    """A CPU bucket as numpy (dtypes numpy lacks, such as bf16, as same-size ints): Ray stores
    numpy buffers out of band, one copy in and none out."""
    b = bucket.detach().cpu().contiguous()
    try:
        return b.numpy()
    except TypeError:
        return b.view(_SAME_SIZE[b.element_size()]).numpy()


_SAME_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def put_stream(stream: WeightStream, mode: str | bool | None) -> WeightsRecord:
    """Put each bucket into the object store as its tensors arrive (one `ray.put` of the list of
    their numpy buffers: no copy into a bucket), and return the record of the refs, with each
    tensor's digest in the manifest and the combined checksum (`weight_sync.checksum` = mode)."""
    m, refs, words, alg = stream.manifest, [], [], W.alg_for(mode)
    for i in range(len(m.buckets)):
        ts = W.take(m, i, stream.tensors)
        if i == 0:
            alg = W.alg_for(mode, ts[0].device)  # on the device the bytes are on (GPU: sums)
        if alg is not None:
            words += W.digests(ts, alg).tolist()
        refs.append(ray.put([host_array(t) for t in ts]))
        del ts  # the next bucket is gathered after this one is in the object store
    if alg is not None:
        m.digest, m.digests = alg, words
        m.checksum = W.combine(alg, [(e.name, e.dtype, e.shape) for e in m.entries], words)
    return WeightsRecord(m.version, StreamedWeights(m.to_dict(), refs), m.checksum)


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
        self._group: WeightGroup | None = None

    # --- the one verb ------------------------------------------------------------------

    def publish(self, payload: dict[str, Tensor] | WeightStream, version: int) -> PublishReport:
        """Send `payload` (a state dict, or a stream from the learner) as `version`. The stream is
        walked to its end even when sending fails: the learner's other ranks gather every tensor."""
        t0 = time.perf_counter()
        stream = payload if isinstance(payload, WeightStream) else \
            stream_state(payload, self.cfg.bucket_bytes, version)
        try:
            if self.cfg.transport == "object_store":
                answers = self._publish_object_store(stream, version)
            else:
                answers = self._publish_collective(stream, version)
        finally:
            stream.drain()
        return PublishReport(version, self.cfg.transport, time.perf_counter() - t0,
                             stream.manifest.nbytes, answers)

    def close(self) -> None:
        """Leave the weight group (without waiting on it); a later collective publish builds a fresh one."""
        if self._group is not None:
            self._group.close()
        self._group = None

    # --- object store ------------------------------------------------------------------

    def _publish_object_store(self, stream: WeightStream, version: int) -> list[Any]:
        record = put_stream(stream, self.cfg.checksum)
        calls = [a.set_weights.remote(record.weights, version, record.checksum) for a in self.actors]
        return self._answers(calls, "set_weights")

    # --- collective --------------------------------------------------------------------

    def _publish_collective(self, stream: WeightStream, version: int) -> list[Any]:
        if self._group is not None and self._group.aborted_by() is not None:
            self.close()  # a member gave the group up after our last wait: build a new one
        if self._group is None:
            self._connect()
        group = self._group
        m = stream.manifest
        m.digest = W.alg_for(self.cfg.checksum, self.device)
        calls = [a.receive_weights.remote(version, m.to_dict()) for a in self.actors]
        gone = _Departures(calls, self.names)
        try:
            pending: tuple[list, list] = ([], [])  # the previous bucket's (works, tensors): two buckets live
            for i, bucket in enumerate(stream.buckets):
                data = bucket.to(self.device)
                sent = [data]
                if m.digest is not None:  # taken before the bytes leave; sent right after them
                    sent.append(W.digests(W.bucket_views(m, i, data).values(), m.digest).to(self.device))
                works = [self._broadcast(t) for t in sent]
                gone.all_sent = i == len(m.buckets) - 1
                group.wait(pending[0], f"bucket {i - 1} of version {version}", gone)
                pending = (works, sent)
            group.wait(pending[0], f"the last bucket of version {version}", gone)
        except (RuntimeError, WeightSyncTimeout) as e:
            # the group is given up (a wait did, or this does): the members still in it return at
            # once, and the next publish builds a new one
            group.abort(f"rank 0 (the publisher): version {version}: {e}")
            self._group = None
            late = self._who_failed(calls)
            raise WeightSyncTimeout(f"weight broadcast of version {version} failed: {late} ({e})") from None
        except BaseException as e:
            group.abort(f"rank 0 (the publisher) stopped sending version {version}: {type(e).__name__}")
            self._group = None
            raise
        try:
            return self._answers(calls, "receive_weights")
        except ray.exceptions.RayActorError:
            self.close()  # a member died after the last bucket: the group is not whole any more
            raise

    def _broadcast(self, t: Tensor):
        return self._group.broadcast(t)

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
        self._group = WeightGroup(make_process_group(store, 0, world, backend, timeout), store, 0, backend,
                                  timeout, server=base)
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
        """Each member's part in a failed broadcast: died, failed (how), or did not answer; a
        member that only left because the group was aborted is named last. Waits a few seconds
        at most: the members still in the group leave within a poll of the abort, and Ray reports
        a dead one within a second or two."""
        ready, _ = ray.wait(calls, num_returns=len(calls), timeout=min(self.cfg.timeout_s, WHO_FAILED_S))
        parts, followed = [], []
        for i, c in enumerate(calls):
            if c not in ready:
                parts.append(f"{self.names[i]} did not answer")
                continue
            try:
                ray.get(c)
            except Exception as e:
                why = _why(e)
                if why == "aborted":
                    followed.append(self.names[i])
                else:
                    parts.append(f"{self.names[i]} {why}")
        if followed:
            parts.append(f"{', '.join(followed)} (left with the group)")
        return "; ".join(parts) or "no peer reported an error"


def _why(e: BaseException) -> str:
    """How a member's call ended: `died`, `aborted` (it left a group another member gave up),
    or `failed: <its error>`."""
    if isinstance(e, ray.exceptions.RayActorError):
        return "died"
    cause = getattr(e, "cause", None) or e
    if isinstance(cause, WeightGroupAborted):
        return "aborted"
    text = str(cause).strip()
    return f"failed: {type(cause).__name__}" + (f": {text.splitlines()[0]}" if text else "")


class _Departures:
    """The check a publisher's waits make between polls: a member whose `receive_weights` call
    ended while the broadcast still runs has left the group; its reason. Before the last bucket
    is sent, any end is one (no member can have taken every bucket yet: it died, or raised);
    after, only a death is: a member may take the last bucket, then raise its own error (a
    digest that differs) before rank 0 sees its sends to the others complete, and those still
    take the version."""

    def __init__(self, calls: list, names: list[str]):
        self.calls, self.names, self.ended = calls, names, set()
        self.all_sent = False

    def __call__(self) -> str | None:
        ready, _ = ray.wait(self.calls, num_returns=len(self.calls), timeout=0)
        for c in ready:
            i = self.calls.index(c)
            if i in self.ended:
                continue
            try:
                ray.get(c, timeout=0)
            except Exception as e:  # noqa: BLE001 - any way out of the call may be a departure
                if not self.all_sent or isinstance(e, ray.exceptions.RayActorError):
                    return f"{self.names[i]} {_why(e)}"
            self.ended.add(i)
        return None
