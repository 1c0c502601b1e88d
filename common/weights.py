"""The weight-sync wire format shared by the learner (sender) and rollout actors (receivers).

A state dict is flattened into dtype-homogeneous 1-D buckets of at most `bucket_bytes`
each (a single tensor larger than that travels alone in its own bucket). A `Manifest`
records, for every tensor, its name, shape, dtype, bucket and element offset, plus the
policy version; it is plain data (`to_dict` / `from_dict`), so it never needs pickling.

The checksum is blake2b over each tensor's name, dtype, shape and raw bytes in sorted
name order. It depends only on the state dict, not on the bucketing, so both transports
(object store and collective) verify with the same function.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64, "int64": torch.int64, "int32": torch.int32,
    "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class WeightsRecord:
    """One published weights version, the one shape every publisher, registry and receiver uses.

    `weights` is the payload ({name: Tensor} or a packed payload), or an ObjectRef of it: a ref
    inside a record travels as a ref, so a registry hands out where the bytes are, never the
    bytes. `checksum` is the digest the receiver verifies (`checksum()` below; None: off)."""

    version: int
    weights: Any
    checksum: str | None = None


class WeightFormatError(ValueError):
    """A manifest or bucket does not match what the format expects; the message says which."""


class ChecksumMismatch(WeightFormatError):
    """The received weights hash differently from what the sender published."""


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
    checksum: str | None = None

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["entries"] = [{**e, "shape": list(e["shape"])} for e in d["entries"]]
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Manifest:
        """Validate plain data (as it came over the wire) and build a Manifest."""
        try:
            buckets = [BucketSpec(str(b["dtype"]), int(b["numel"])) for b in d["buckets"]]
            entries = [TensorEntry(str(e["name"]), tuple(int(s) for s in e["shape"]), str(e["dtype"]),
                                   int(e["bucket"]), int(e["offset"])) for e in d["entries"]]
            m = Manifest(int(d["version"]), entries, buckets, d.get("checksum"))
        except (KeyError, TypeError, ValueError) as e:
            raise WeightFormatError(f"weights manifest is malformed: {e!r}") from None
        m.validate()
        return m

    def validate(self) -> None:
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


def _dtype_name(name: str, t: Tensor) -> str:
    if t.dtype not in DTYPE_NAMES:
        raise WeightFormatError(f"tensor {name!r}: dtype {t.dtype} is not supported by the weight format")
    return DTYPE_NAMES[t.dtype]


def plan(state: dict[str, Tensor], bucket_bytes: int, version: int) -> Manifest:
    """Assign every tensor a bucket and an offset (grouped by dtype, names in sorted order)."""
    if bucket_bytes <= 0:
        raise WeightFormatError(f"bucket_bytes must be positive, got {bucket_bytes}")
    m = Manifest(version=version)
    open_bucket: dict[str, int] = {}  # dtype → index of the bucket being filled
    for name in sorted(state):
        t = state[name]
        dt = _dtype_name(name, t)
        size = t.numel() * t.element_size()
        i = open_bucket.get(dt)
        if i is None or (m.buckets[i].nbytes + size > bucket_bytes and m.buckets[i].numel > 0):
            m.buckets.append(BucketSpec(dt, 0))
            i = open_bucket[dt] = len(m.buckets) - 1
        b = m.buckets[i]
        m.entries.append(TensorEntry(name, tuple(t.shape), dt, i, b.numel))
        m.buckets[i] = BucketSpec(dt, b.numel + t.numel())
    return m


def flatten(state: dict[str, Tensor], bucket_bytes: int, version: int,
            with_checksum: bool = False) -> tuple[Manifest, list[Tensor]]:
    """State dict → (manifest, 1-D buckets on the tensors' device)."""
    m = plan(state, bucket_bytes, version)
    device = next(iter(state.values())).device if state else torch.device("cpu")
    buckets = [torch.empty(b.numel, dtype=DTYPES[b.dtype], device=device) for b in m.buckets]
    for e in m.entries:
        buckets[e.bucket][e.offset:e.offset + e.numel].copy_(state[e.name].detach().reshape(-1))
    if with_checksum:
        m.checksum = checksum(state)
    return m, buckets


def empty_buckets(m: Manifest, device: torch.device | str = "cpu") -> list[Tensor]:
    """Receive buffers for a manifest's buckets."""
    return [torch.empty(b.numel, dtype=DTYPES[b.dtype], device=device) for b in m.buckets]


def unflatten(m: Manifest, buckets: list[Tensor]) -> dict[str, Tensor]:
    """Buckets → state dict. The tensors are views into the buckets (no copy)."""
    if len(buckets) != len(m.buckets):
        raise WeightFormatError(f"expected {len(m.buckets)} buckets, got {len(buckets)}")
    for i, (spec, b) in enumerate(zip(m.buckets, buckets, strict=True)):
        if b.dim() != 1 or b.numel() != spec.numel or b.dtype != DTYPES[spec.dtype]:
            raise WeightFormatError(f"bucket {i}: got {b.dtype} {tuple(b.shape)}, "
                                    f"manifest says {spec.dtype} [{spec.numel}]")
    return {e.name: buckets[e.bucket][e.offset:e.offset + e.numel].view(e.shape) for e in m.entries}


def checksum(state: dict[str, Tensor]) -> str:
    """blake2b over (name, dtype, shape, bytes) of every tensor in sorted name order."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(state):
        t = state[name].detach()
        h.update(f"{name}|{_dtype_name(name, t)}|{tuple(t.shape)}\n".encode())
        raw = t.reshape(-1).cpu().contiguous().view(torch.uint8)  # bytes, any dtype (bf16 too)
        h.update(raw.numpy())  # buffer protocol: no extra copy
    return h.hexdigest()


def verify(state: dict[str, Tensor], expected: str | None, who: str = "weights") -> None:
    """Raise ChecksumMismatch when `expected` is set and the state hashes differently."""
    if expected is None:
        return
    got = checksum(state)
    if got != expected:
        raise ChecksumMismatch(f"{who}: checksum {got} does not match the published {expected}")


def nbytes(state: dict[str, Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())
