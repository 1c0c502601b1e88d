"""A published weights version as plain data: the record every publisher, registry and receiver
passes (`WeightsRecord`), and the object store's payload of it (`StreamedWeights`: a manifest and
one ref per bucket). Neither imports torch, so the run's weight registry, a zero-CPU actor that
only holds the newest record, starts without it; the wire format itself is common/weights.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class WeightsRecord:
    """One published weights version, the one shape every publisher, registry and receiver uses.

    `weights` is the payload ({name: Tensor}, or a `StreamedWeights` of buckets in the object
    store), or an ObjectRef of it: refs inside a record travel as refs, so a registry hands out
    where the bytes are, never the bytes. `checksum` is what the receiver verifies
    (`"<alg>:<hex>"`, see common/weights.py; None: off)."""

    version: int
    weights: Any
    checksum: str | None = None


@dataclass
class StreamedWeights:
    """The object-store payload: the manifest (with each tensor's digest) and one ref per
    bucket, each a list of the bucket's tensors as numpy buffers (Ray maps them without a copy,
    and the sender copies nothing into a bucket). The receiver gets the refs one at a time, so
    it never holds more than two buckets."""

    manifest: dict[str, Any]
    refs: list[Any]

    def nbytes(self) -> int:
        from common.weights import DTYPES  # heavy: torch (the registry never asks for a size)

        return sum(int(b["numel"]) * DTYPES[b["dtype"]].itemsize for b in self.manifest["buckets"])
