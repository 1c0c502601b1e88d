"""The rollout side of weight sync: buckets in, one at a time, checked, then loaded.

Both transports end in a `sink(views)` that copies one bucket's tensors into the model
(`RolloutWorker` builds it from `VideoModel.weight_targets`), after `check_bucket` compared
each tensor's digest with the published one:
- `load_streamed`: the object store's `StreamedWeights`, each bucket's ref (its tensors' numpy
  buffers) mapped in turn, no copy, the next one fetched to this node while this one loads;
- `WeightReceiver`: the `collective` transport. `join` connects to the publisher's group as
  rank 1..n; `receive` posts the broadcast of bucket i + 1 (into the other of two
  buffers) before it checks and loads bucket i. It never blocks inside a broadcast: it polls
  (common/weight_group.WeightGroup.wait), so when another member gives the group up (the
  publisher, on seeing a member die) it returns within a poll, its group dropped, and joins the
  group the next publish builds; when it gives up itself, it tells the others the same way.

So a receiver holds two buckets at most; `BucketGauge` counts the bytes of the live ones (each
tracked until its memory can be freed: a view keeps its base alive) for tests and benchmarks.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable

import torch
from torch import Tensor

from common import weights as W
from common.weight_group import Backend, WeightGroup, WeightSyncTimeout, join_as_peer
from common.weights_record import StreamedWeights

Sink = Callable[[dict[str, Tensor]], None]


class BucketGauge:
    """Bytes of the receive buckets alive now, and the most alive at once since `reset`."""

    def __init__(self) -> None:
        self.live = self.peak = self.count = self.peak_count = 0

    def track(self, objs: list, nbytes: int) -> None:
        """One bucket of `nbytes`, alive until every object in `objs` (its buffers) is freed."""
        self.live += nbytes
        self.count += 1
        self.peak, self.peak_count = max(self.peak, self.live), max(self.peak_count, self.count)
        left = [len(objs)]

        def freed_one() -> None:
            left[0] -= 1
            if left[0] == 0:
                self._freed(nbytes)

        for o in objs:
            weakref.finalize(o, freed_one)

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes
        self.count -= 1

    def reset(self) -> None:
        self.peak, self.peak_count = self.live, self.count


def _rows(m: W.Manifest) -> list[int]:
    """Index of each bucket's first entry (entries are in bucket order)."""
    first, seen = [], -1
    for j, e in enumerate(m.entries):
        if e.bucket != seen:
            first.append(j)
            seen = e.bucket
    return [*first, len(m.entries)]


def check_manifest(m: W.Manifest, checksum: str | None, who: str) -> None:
    """The manifest's per-tensor digests combine to the published checksum (the record's own,
    which the registry keeps apart from the payload), or there is nothing to check."""
    if checksum is None:
        m.digest = None
        return
    if m.digests is None or m.digest is None:
        raise W.ChecksumMismatch(f"{who}: the payload carries no digests for the published checksum")
    got = W.combine(m.digest, [(e.name, e.dtype, e.shape) for e in m.entries], m.digests)
    if got != checksum:
        raise W.ChecksumMismatch(f"{who}: the manifest's digests give checksum {got}, "
                                 f"not the published {checksum}")


def _from_host(arr, dtype: str) -> Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable array": we only read it
        t = torch.from_numpy(arr)
    want = W.DTYPES[dtype]
    return t if t.dtype == want else t.view(want)


def load_streamed(sw: StreamedWeights, checksum: str | None, sink: Sink, device: torch.device,
                  who: str, gauge: BucketGauge | None = None, timeout_s: float = 120.0) -> W.Manifest:
    """Check and load an object-store payload bucket by bucket (two mapped at most)."""
    import ray  # heavy: ray

    m = W.Manifest.from_dict(sw.manifest)
    if len(sw.refs) != len(m.buckets):
        raise W.WeightFormatError(f"{who}: {len(sw.refs)} bucket refs for {len(m.buckets)} buckets")
    check_manifest(m, checksum, who)
    rows = _rows(m)
    for i, ref in enumerate(sw.refs):
        if i + 1 < len(sw.refs):  # start pulling the next bucket to this node while this one loads
            ray.wait([sw.refs[i + 1]], timeout=0, fetch_local=True)
        arrays = ray.get(ref, timeout=timeout_s)  # the bucket's tensors, mapped (no copy)
        if len(arrays) != len(m.members(i)):
            raise W.WeightFormatError(f"{who}: bucket {i} holds {len(arrays)} tensors, "
                                      f"the manifest says {len(m.members(i))}")
        if gauge is not None:
            gauge.track(arrays, sum(a.nbytes for a in arrays))
        views = {e.name: _from_host(a, e.dtype).view(e.shape) for e, a in zip(m.members(i), arrays, strict=True)}
        del arrays
        if m.digest == "sums" and device.type == "cuda":  # checked where it is cheap: on the GPU
            views = {k: v.to(device) for k, v in views.items()}
        if m.digest is not None:
            W.check_bucket(m, i, views, m.digests[rows[i]:rows[i + 1]], who)
        sink(views)
        del views
    return m


class WeightReceiver:
    def __init__(self) -> None:
        self._group: WeightGroup | None = None
        self.rank: int | None = None
        self.gauge = BucketGauge()

    @property
    def joined(self) -> bool:
        return self._group is not None and self._group.live

    def join(self, host: str, port: int, prefix: str, rank: int, world_size: int,
             backend: Backend, timeout_s: float) -> None:
        """Join (or re-join: the old group is dropped, without waiting on it) the publisher's weight group."""
        self.leave()
        self._group = join_as_peer(host, port, prefix, rank, world_size, backend, timeout_s)
        self.rank = rank

    def leave(self) -> None:
        if self._group is not None:
            self._group.close()
        self._group = None

    def receive(self, manifest: dict, sink: Sink | None, device: torch.device | str = "cpu") -> W.Manifest:
        """Take part in every broadcast of one version. Each bucket is checked against the digests
        broadcast after it, then given to `sink` (None: drained, e.g. a stale version). A failed
        check or load is raised after the last bucket: the group stays in step. A broadcast that
        fails, times out or is aborted by another member raises WeightSyncTimeout (the group is
        dropped: the publisher builds a new one); leaving for any other reason aborts the group,
        so the others do not wait for this member."""
        group = self._group
        if group is None or not group.live:
            raise RuntimeError("receive_weights called before join_weight_group (or after its group was given up)")
        m = W.Manifest.from_dict(manifest)
        who, failure = f"weight group rank {self.rank}, version {m.version}", None
        n = len(m.buckets)
        try:
            # two receive buffers, used in turn: bucket i + 1 arrives in one while bucket i loads from
            # the other (the broadcast that reuses a buffer is posted after its last bucket was loaded)
            size = max((b.nbytes for b in m.buckets), default=0)
            buffers = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(min(n, 2))]
            for b in buffers:
                self.gauge.track([b], size)
            nxt = self._post(group, m, 0, buffers[0]) if n else None
            for i in range(n):
                bucket, digest, works = nxt
                try:
                    group.wait(works, f"bucket {i} of version {m.version}")
                except WeightSyncTimeout as e:  # or WeightGroupAborted: kept, so the publisher tells them apart
                    self._group = None  # given up (by the wait): the publisher builds a new group
                    raise type(e)(f"{who}: broadcast from the publisher failed ({e})") from None
                nxt = self._post(group, m, i + 1, buffers[(i + 1) % 2]) if i + 1 < n else None
                if failure is None and sink is not None:
                    try:
                        views = W.bucket_views(m, i, bucket)
                        W.check_bucket(m, i, views, digest, who)
                        sink(views)
                    except Exception as e:  # noqa: BLE001 - raised below, once the stream is drained
                        failure = e
                views = bucket = digest = works = None
            nxt = buffers = None
        except BaseException as e:
            if group.live:  # left mid-stream for another reason: the others must not wait for us
                group.abort(f"rank {self.rank} left version {m.version}: {type(e).__name__}")
                self._group = None
            raise
        if failure is not None:
            raise failure
        return m

    @staticmethod
    def _post(group: WeightGroup, m: W.Manifest, i: int, buffer: Tensor) -> tuple[Tensor, Tensor | None, list]:
        spec = m.buckets[i]
        bucket = buffer[:spec.nbytes].view(W.DTYPES[spec.dtype])
        works = [group.broadcast(bucket)]
        digest = None
        if m.digest is not None:
            digest = torch.empty(len(m.members(i)), 2, dtype=torch.int64, device=buffer.device)
            works.append(group.broadcast(digest))
        return bucket, digest, works
