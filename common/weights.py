"""The weight-sync wire format shared by the learner (sender) and rollout actors (receivers).

Tensors travel in 1-D, dtype-homogeneous buckets of at most `bucket_bytes` each (a tensor
larger than that travels alone). A `Manifest` is planned from names, shapes and dtypes only,
no data, with the tensors in (dtype, name) order, so that bucket i is complete before bucket
i + 1 starts: the sender walks the tensors one at a time (gathers one, copies it into the open
bucket, sends the bucket once full: `fill`) and the receiver loads each bucket as it arrives.
Neither side holds more than two buckets. A manifest is plain data (`to_dict` / `from_dict`).

Checksums are per tensor, then combined over (name, dtype, shape, digest) in sorted name order
into `"<alg>:<hex>"`: the result does not depend on the bucketing, so a plain state dict and a
bucketed stream of it hash the same, and a receiver checks each bucket before loading it.
Algorithms (`weight_sync.checksum`, see `alg_for`):
- `xxh3`: xxh3-128 of the bytes, in host memory (≈ 12 GiB/s on one core, faster than a copy);
- `sums`: two position-weighted byte sums mod 2^64 (row- and column-weighted over a W-wide
  grid), in torch on whatever device holds the bytes: any changed byte moves the row sum, and
  any swap of two bytes moves one of the two; integer sums are exact, so CPU and GPU agree;
- `blake2b`: blake2b-128 of the bytes, on the CPU (≈ 1 GiB/s): the strong check on request.

What travels (a version's record, the object store's payload of it) is plain data in
common/weights_record.py.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import torch
import xxhash
from torch import Tensor

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64, "int64": torch.int64, "int32": torch.int32,
    "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

DigestAlg = Literal["xxh3", "sums", "blake2b"]
DIGEST_ALGS: tuple[str, ...] = ("xxh3", "sums", "blake2b")
SUMS_WIDTH = 4096  # the `sums` grid's row length in bytes


class WeightFormatError(ValueError):
    """A manifest or bucket does not match what the format expects; the message says which."""


class ChecksumMismatch(WeightFormatError):
    """The received weights hash differently from what the sender published."""


class TensorSpec(NamedTuple):
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]
    dtype: str
    bucket: int
    offset: int                     # in elements, within the bucket

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class BucketSpec:
    dtype: str
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPES[self.dtype].itemsize


@dataclass
class Manifest:
    version: int
    entries: list[TensorEntry] = field(default_factory=list)
    buckets: list[BucketSpec] = field(default_factory=list)
    checksum: str | None = None     # the combined "<alg>:<hex>" (known once every bucket is out)
    digest: str | None = None       # the per-tensor algorithm; None: no checksum
    digests: list[list[int]] | None = None  # per entry (entry order), when known up front

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def members(self, i: int) -> list[TensorEntry]:
        """The entries of bucket i (consecutive: the plan fills buckets in entry order)."""
        if not hasattr(self, "_members"):
            self._members: list[list[TensorEntry]] = [[] for _ in self.buckets]
            for e in self.entries:
                self._members[e.bucket].append(e)
        return self._members[i]

    def to_dict(self) -> dict[str, Any]:
        """Plain data (built by hand: dataclasses.asdict deep-copies, 50 ms for 1k tensors)."""
        return {"version": self.version,
                "entries": [{"name": e.name, "shape": list(e.shape), "dtype": e.dtype, "bucket": e.bucket,
                             "offset": e.offset} for e in self.entries],
                "buckets": [{"dtype": b.dtype, "numel": b.numel} for b in self.buckets],
                "checksum": self.checksum, "digest": self.digest, "digests": self.digests}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Manifest:
        """Validate plain data (as it came over the wire) and build a Manifest."""
        try:
            buckets = [BucketSpec(str(b["dtype"]), int(b["numel"])) for b in d["buckets"]]
            entries = [TensorEntry(str(e["name"]), tuple(int(s) for s in e["shape"]), str(e["dtype"]),
                                   int(e["bucket"]), int(e["offset"])) for e in d["entries"]]
            digests = d.get("digests")
            digests = None if digests is None else [[int(x) for x in row] for row in digests]
            m = Manifest(int(d["version"]), entries, buckets, d.get("checksum"), d.get("digest"), digests)
        except (KeyError, TypeError, ValueError) as e:
            raise WeightFormatError(f"weights manifest is malformed: {e!r}") from None
        m.validate()
        return m

    def validate(self) -> None:
        if self.digest is not None and self.digest not in DIGEST_ALGS:
            raise WeightFormatError(f"manifest digest {self.digest!r} is not one of {', '.join(DIGEST_ALGS)}")
        if self.digests is not None and (len(self.digests) != len(self.entries)
                                         or any(len(r) != 2 for r in self.digests)):
            raise WeightFormatError(f"manifest digests: {len(self.digests)} rows for {len(self.entries)} "
                                    "tensors (two words each expected)")
        for i, b in enumerate(self.buckets):
            if b.dtype not in DTYPES:
                raise WeightFormatError(f"manifest bucket {i}: unsupported dtype {b.dtype!r}")
            if b.numel < 0:
                raise WeightFormatError(f"manifest bucket {i}: negative numel {b.numel}")
        seen: set[str] = set()
        for e in self.entries:
            if e.name in seen:
                raise WeightFormatError(f"manifest tensor {e.name!r} appears twice")
            seen.add(e.name)
            if not 0 <= e.bucket < len(self.buckets):
                raise WeightFormatError(f"manifest tensor {e.name!r}: bucket {e.bucket} does not exist")
            b = self.buckets[e.bucket]
            if e.dtype != b.dtype:
                raise WeightFormatError(f"manifest tensor {e.name!r}: dtype {e.dtype} in a {b.dtype} bucket")
            if any(s < 0 for s in e.shape) or e.offset < 0 or e.offset + e.numel > b.numel:
                raise WeightFormatError(f"manifest tensor {e.name!r}: shape {e.shape} at offset "
                                        f"{e.offset} does not fit bucket {e.bucket} ({b.numel} elements)")


def _dtype_name(name: str, dtype: torch.dtype) -> str:
    if dtype not in DTYPE_NAMES:
        raise WeightFormatError(f"tensor {name!r}: dtype {dtype} is not supported by the weight format")
    return DTYPE_NAMES[dtype]


def specs_of(state: dict[str, Tensor]) -> list[TensorSpec]:
    return [TensorSpec(k, tuple(v.shape), v.dtype) for k, v in state.items()]


# --- planning and filling ----------------------------------------------------------------


def plan(specs: dict[str, Tensor] | Iterable[TensorSpec], bucket_bytes: int, version: int) -> Manifest:
    """Assign every tensor a bucket and an offset, in (dtype, name) order: metadata only."""
    if bucket_bytes <= 0:
        raise WeightFormatError(f"bucket_bytes must be positive, got {bucket_bytes}")
    if isinstance(specs, dict):
        specs = specs_of(specs)
    named = sorted(((_dtype_name(s.name, s.dtype), s) for s in specs), key=lambda p: (p[0], p[1].name))
    m = Manifest(version=version)
    for dt, s in named:
        numel = 1
        for d in s.shape:
            numel *= int(d)
        size = numel * DTYPES[dt].itemsize
        last = m.buckets[-1] if m.buckets else None
        if last is None or last.dtype != dt or (last.nbytes + size > bucket_bytes and last.numel > 0):
            m.buckets.append(BucketSpec(dt, 0))
        i = len(m.buckets) - 1
        m.entries.append(TensorEntry(s.name, tuple(int(d) for d in s.shape), dt, i, m.buckets[i].numel))
        m.buckets[i] = BucketSpec(dt, m.buckets[i].numel + numel)
    return m


def empty_bucket(spec: BucketSpec, device: torch.device | str = "cpu") -> Tensor:
    """One bucket's buffer (the one place buckets are allocated)."""
    return torch.empty(spec.numel, dtype=DTYPES[spec.dtype], device=device)


def take(m: Manifest, i: int, tensors: Iterator[Tensor]) -> list[Tensor]:
    """Bucket i's tensors from `tensors` (the stream in manifest entry order), each checked
    against its entry."""
    out = []
    for e in m.members(i):
        t = next(tensors, None)
        if t is None:
            raise WeightFormatError(f"the weight stream ended before tensor {e.name!r}")
        if tuple(t.shape) != e.shape or t.dtype != DTYPES[e.dtype]:
            raise WeightFormatError(f"tensor {e.name!r}: got {t.dtype} {tuple(t.shape)}, "
                                    f"manifest says {e.dtype} {e.shape}")
        out.append(t.detach())
    return out


def fill(m: Manifest, tensors: Iterable[Tensor], ring: int = 0) -> Iterator[Tensor]:
    """The buckets in order, from `tensors` in the manifest's entry order, each taken only when
    its bucket is being filled (so a gather per tensor runs just in time). A tensor alone in its
    bucket travels as itself (a flat view, no copy).

    ring=k: buckets are filled into k buffers in turn, so a bucket is valid until k more have
    been yielded (for a consumer that holds at most k, as a sender with two in flight does).
    Fresh memory for each bucket costs its page faults: on the CPU a 64 MB bucket filled into
    memory already touched took 4 ms here, into fresh pages 30 to 50 ms (glibc maps every
    allocation over 32 MB anew). 0: each bucket its own memory."""
    it = iter(tensors)
    buffers: list[Tensor] = []
    filled = 0
    size = max((b.nbytes for i, b in enumerate(m.buckets) if len(m.members(i)) > 1), default=0)
    for i, spec in enumerate(m.buckets):
        ts = take(m, i, it)
        if len(ts) == 1:
            yield ts[0].reshape(-1)
            continue
        if ring > 0:
            if len(buffers) < ring:
                buffers.append(torch.empty(size, dtype=torch.uint8, device=ts[0].device))
            buf = buffers[filled % ring]     # the one that held the bucket `ring` fills ago
            filled += 1
            bucket = buf[:spec.nbytes].view(DTYPES[spec.dtype])
        else:
            bucket = empty_bucket(spec, ts[0].device)
        for e, t in zip(m.members(i), ts, strict=True):
            bucket[e.offset:e.offset + e.numel].copy_(t.reshape(-1))
        yield bucket


def flatten(state: dict[str, Tensor], bucket_bytes: int, version: int,
            with_checksum: bool = False) -> tuple[Manifest, list[Tensor]]:
    """State dict → (manifest, 1-D buckets on the tensors' device)."""
    m = plan(state, bucket_bytes, version)
    buckets = list(fill(m, (state[e.name] for e in m.entries)))
    if with_checksum:
        m.checksum = checksum(state)
    return m, buckets


def bucket_views(m: Manifest, i: int, bucket: Tensor) -> dict[str, Tensor]:
    """Bucket i's tensors as views into it (no copy)."""
    spec = m.buckets[i]
    if bucket.dim() != 1 or bucket.numel() != spec.numel or bucket.dtype != DTYPES[spec.dtype]:
        raise WeightFormatError(f"bucket {i}: got {bucket.dtype} {tuple(bucket.shape)}, "
                                f"manifest says {spec.dtype} [{spec.numel}]")
    return {e.name: bucket[e.offset:e.offset + e.numel].view(e.shape) for e in m.members(i)}


def unflatten(m: Manifest, buckets: list[Tensor]) -> dict[str, Tensor]:
    """Buckets → state dict. The tensors are views into the buckets (no copy)."""
    if len(buckets) != len(m.buckets):
        raise WeightFormatError(f"expected {len(m.buckets)} buckets, got {len(buckets)}")
    out: dict[str, Tensor] = {}
    for i, b in enumerate(buckets):
        out.update(bucket_views(m, i, b))
    return out


# --- checksums ---------------------------------------------------------------------------


def alg_for(mode: str | bool | None, device: torch.device | str = "cpu") -> str | None:
    """The digest algorithm for `weight_sync.checksum` on bytes held on `device`."""
    if mode is True or mode == "fast":
        return "sums" if torch.device(device).type == "cuda" else "xxh3"
    if mode == "strong":
        return "blake2b"
    if mode in (None, False, "off"):
        return None
    raise WeightFormatError(f"weight_sync.checksum = {mode!r} is not one of fast, strong, off")


def _raw(t: Tensor) -> Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def _sums(raw: Tensor) -> Tensor:
    """[row-weighted, column-weighted] byte sums mod 2^64 (see the module doc). int64 [2]"""
    n, w = raw.numel(), SUMS_WIDTH
    k = n // w
    body = raw[:k * w].view(k, w)
    rows, cols = body.sum(1, dtype=torch.int64), body.sum(0, dtype=torch.int64)
    tail = raw[k * w:].to(torch.int64)
    rows = torch.cat([rows, tail.sum().view(1)])
    cols[:tail.numel()] += tail
    r = torch.arange(1, k + 2, dtype=torch.int64, device=raw.device)
    c = torch.arange(1, w + 1, dtype=torch.int64, device=raw.device)
    return torch.stack([(rows * r).sum(), (cols * c).sum()])


def digests(tensors: Iterable[Tensor], alg: str) -> Tensor:
    """Each tensor's digest as two int64 words: [n, 2], on the tensors' device for `sums`
    (no host sync), on the CPU otherwise."""
    if alg == "sums":
        rows = [_sums(_raw(t)) for t in tensors]
        return torch.stack(rows) if rows else torch.zeros(0, 2, dtype=torch.int64)
    out = []
    for t in tensors:
        raw = _raw(t).cpu().numpy()
        if alg == "xxh3":
            d = xxhash.xxh3_128_intdigest(raw)
        elif alg == "blake2b":
            d = int.from_bytes(hashlib.blake2b(raw, digest_size=16).digest(), "big")
        else:
            raise WeightFormatError(f"digest algorithm {alg!r} is not one of {', '.join(DIGEST_ALGS)}")
        out.append([_signed(d >> 64), _signed(d & ((1 << 64) - 1))])
    return torch.tensor(out, dtype=torch.int64).view(-1, 2)


def combine(alg: str, entries: Iterable[tuple[str, str, tuple[int, ...]]], words: list[list[int]]) -> str:
    """The checksum of a whole payload from its per-tensor digests: "<alg>:<hex>"."""
    h = hashlib.blake2b(digest_size=16)
    rows = sorted(zip(entries, words, strict=True), key=lambda r: r[0][0])
    for (name, dtype, shape), (a, b) in rows:
        h.update(f"{name}|{dtype}|{tuple(shape)}|{a}|{b}\n".encode())
    return f"{alg}:{h.hexdigest()}"


def checksum(state: dict[str, Tensor], alg: str = "xxh3") -> str:
    """The checksum of a state dict (any device; `alg` as in the module doc)."""
    names = sorted(state)
    words = digests([state[n] for n in names], alg).tolist()
    return combine(alg, [(n, _dtype_name(n, state[n].dtype), tuple(state[n].shape)) for n in names], words)


def alg_of(expected: str) -> str:
    alg = expected.split(":", 1)[0]
    if alg not in DIGEST_ALGS or ":" not in expected:
        raise ChecksumMismatch(f"checksum {expected!r} does not name its algorithm "
                                f"(expected '<alg>:<hex>' with alg one of {', '.join(DIGEST_ALGS)})")
    return alg


def verify(state: dict[str, Tensor], expected: str | None, who: str = "weights") -> None:
    """Raise ChecksumMismatch when `expected` is set and the state hashes differently."""
    if expected is None:
        return
    got = checksum(state, alg_of(expected))
    if got != expected:
        raise ChecksumMismatch(f"{who}: checksum {got} does not match the published {expected}")


def check_bucket(m: Manifest, i: int, views: dict[str, Tensor], expected: Tensor | list[list[int]],
                 who: str = "weights") -> None:
    """Raise ChecksumMismatch naming the first tensor of bucket i whose digest differs."""
    if m.digest is None:
        return
    got = digests(views.values(), m.digest)
    want = torch.as_tensor(expected, dtype=torch.int64).to(got.device).view(-1, 2)
    if got.shape != want.shape or not torch.equal(got, want):
        bad = [n for n, g, w in zip(views, got.tolist(), want.tolist(), strict=False) if g != w]
        raise ChecksumMismatch(f"{who}: tensor {(bad or list(views))[0]!r} (bucket {i}) does not match "
                               f"the published {m.digest} digest: the bytes changed on the way")


def nbytes(state: dict[str, Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())
