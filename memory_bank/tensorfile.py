"""The safetensors format, written and read with at most one copy each way, every blob
carrying a checksum.

`safetensors.torch.save/load` copy each tensor two or three times, which cost the bank
about half its throughput on 16 MB entries. The format is simple (8-byte little-endian
header length, a JSON header padded to 8 bytes, then the raw little-endian data), so it is
written here; blobs stay readable by the safetensors library and vice versa (tested).

Integrity: the header's `__metadata__` (the format's own string map) holds an XXH3-64 digest
of the tensor table and the data, so a flipped bit anywhere but in the digest itself is found
at read time (XXH3 runs at memory speed: a 200 MB trajectory costs milliseconds, where crc32
would cost tens). Reading also refuses a non-finite float in any tensor: the bank stores
latents and log-probs, and one +inf in a latent turns every weight NaN a step later.
Reading validates everything and raises ValueError; it never unpickles.
"""

from __future__ import annotations

import json
import math
import warnings

import torch
import xxhash
from torch import Tensor

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
CODES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 1 << 20   # our headers are a few hundred bytes
DIGEST = "xxh3_64"     # the __metadata__ key of the digest (16 hex digits)


class Blob:
    """A blob as the buffers it is made of (header, then each tensor's own memory in name
    order), so it is sent without being joined (memory_bank.wire) and read back from its parts
    (`loads`); `bytes(blob)` joins it (one copy)."""

    def __init__(self, parts: list[memoryview], names: list[str]):
        self.parts, self.names = parts, names
        self.nbytes = sum(len(p) for p in parts)

    def __len__(self) -> int:
        return self.nbytes

    def __bytes__(self) -> bytes:
        return b"".join(self.parts)


def pack(tensors: dict[str, Tensor]) -> Blob:
    """The blob of `tensors`, viewing their memory (keep them alive and unchanged until sent)."""
    table: dict[str, dict] = {}
    parts = []
    off = 0
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        if t.dtype not in CODES:
            raise ValueError(f"tensor {name!r}: dtype {t.dtype} cannot be stored")
        raw = memoryview(t.reshape(-1).view(torch.uint8).numpy())   # zero-copy byte view
        table[name] = {"dtype": CODES[t.dtype], "shape": list(t.shape),
                       "data_offsets": [off, off + raw.nbytes]}
        off += raw.nbytes
        parts.append(raw)
    h = xxhash.xxh3_64(_canonical(table))
    for p in parts:
        h.update(p)
    header = {"__metadata__": {DIGEST: h.hexdigest()}, **table}
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)                      # keeps the data 8-byte aligned
    return Blob([memoryview(len(head).to_bytes(8, "little") + head), *parts], sorted(tensors))


def dumps(tensors: dict[str, Tensor]) -> bytes:
    return bytes(pack(tensors))


def _canonical(table: dict[str, dict]) -> bytes:
    """The tensor table as the digest covers it: names sorted, no spaces."""
    return json.dumps({n: table[n] for n in sorted(table)}, separators=(",", ":")).encode()


def loads(blob: bytes | bytearray | memoryview | Blob, copy: bool = True, verify: bool = True
          ) -> dict[str, Tensor]:
    """The tensors of a blob. With copy=False and an immutable blob (`bytes`, or a read-only
    memoryview nothing else writes to) they view its memory (and keep it alive): for a caller
    that owns the blob and only reads the tensors. A `Blob` is read from its parts, never
    joined (the tensors view them; its digest is not recomputed). verify=False skips the digest and the finite check (to read
    a file the safetensors library wrote)."""
    head = memoryview(blob.parts[0] if isinstance(blob, Blob) else blob).cast("B")
    total = blob.nbytes if isinstance(blob, Blob) else len(head)
    if len(head) < 8:
        raise ValueError(f"blob of {len(head)} bytes is shorter than the 8-byte header length")
    n = int.from_bytes(head[:8], "little")
    if n > min(MAX_HEADER, len(head) - 8):
        raise ValueError(f"header length {n} exceeds the blob ({total} bytes)")
    try:
        header = json.loads(bytes(head[8:8 + n]))
    except (ValueError, RecursionError):
        raise ValueError("header is not JSON") from None
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    meta = header.pop("__metadata__", None)
    specs = _specs(header, total - 8 - n)
    if isinstance(blob, Blob):
        if len(head) != 8 + n or sorted(header) != blob.names:
            raise ValueError("Blob parts do not match its header")
        bufs = dict(zip(blob.names, blob.parts[1:], strict=True))
        if any(len(bufs[name]) != stop - begin for begin, stop, name, _, _ in specs):
            raise ValueError("Blob parts do not match its header")
        data = joined = None
    else:
        data = head[8 + n:]
        if not copy and (isinstance(blob, bytes) or (isinstance(blob, memoryview) and blob.readonly)):
            buf = data
        else:
            buf = bytearray(data)    # the one copy: writable memory the tensors own
        joined = memoryview(buf)
        bufs = {name: joined[begin:stop] for begin, stop, name, _, _ in specs}
    if verify and data is not None:   # a Blob's digest was just computed from these very parts
        _verify_digest(meta, header, data)
    out = {}
    with warnings.catch_warnings():  # "not writable": copy=False is read-only by contract
        warnings.simplefilter("ignore", UserWarning)
        for begin, stop, name, dtype, shape in specs:
            out[name] = torch.empty(shape, dtype=dtype) if stop == begin else torch.frombuffer(
                bufs[name], dtype=dtype, count=math.prod(shape)).reshape(shape)
        if verify:
            _check_finite(specs, out, joined)
    return out


def _check_finite(specs: list[tuple], out: dict[str, Tensor], joined: memoryview | None) -> None:
    """Refuse a non-finite float in any tensor. Tensors of one dtype that lie back to back in
    the data (`joined`; None for a Blob, whose parts lie apart) are checked as one: the check
    costs a few microseconds per call, against a fraction of one per kilobyte."""
    runs: list[list] = []              # [dtype, begin, end, names]
    for begin, stop, name, dtype, _ in specs:
        if not dtype.is_floating_point or stop == begin:
            continue
        run = runs[-1] if runs else None
        if joined is not None and run is not None and run[0] == dtype and run[2] == begin:
            run[2] = stop
            run[3].append(name)
        else:
            runs.append([dtype, begin, stop, [name]])
    for dtype, begin, stop, names in runs:
        if len(names) == 1:
            whole = out[names[0]]
        else:
            whole = torch.frombuffer(joined[begin:stop], dtype=dtype)
        if not finite(whole):
            check_finite({n: out[n] for n in names})


def check_finite(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """`tensors`, unless a float among them (in name order) holds a non-finite value: then
    ValueError naming it."""
    for name in sorted(tensors):
        if not finite(tensors[name]):
            raise ValueError(f"tensor {name!r} has non-finite values")
    return tensors


def _specs(header: dict, data_len: int) -> list[tuple]:
    """(begin, end, name, dtype, shape) per tensor, in data order; the data must be exactly
    covered, tensor after tensor, with no gap or overlap."""
    specs = []
    for name, spec in header.items():
        if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
            raise ValueError(f"tensor {name!r}: header entry must have dtype, shape, data_offsets")
        dtype, shape, offs = spec["dtype"], spec["shape"], spec["data_offsets"]
        if dtype not in DTYPES:
            raise ValueError(f"tensor {name!r}: unknown dtype {dtype!r}")
        if not (isinstance(shape, list) and all(_nat(d) for d in shape)):
            raise ValueError(f"tensor {name!r}: bad shape {shape!r}")
        if not (isinstance(offs, list) and len(offs) == 2 and all(_nat(o) for o in offs)):
            raise ValueError(f"tensor {name!r}: bad data_offsets {offs!r}")
        if offs[1] - offs[0] != math.prod(shape) * DTYPES[dtype].itemsize:
            raise ValueError(f"tensor {name!r}: {offs[1] - offs[0]} bytes for shape {shape} {dtype}")
        specs.append((offs[0], offs[1], name, DTYPES[dtype], shape))
    specs.sort(key=lambda s: (s[0], s[1]))
    end = 0
    for begin, stop, name, _, _ in specs:
        if begin != end:
            raise ValueError(f"tensor {name!r}: data starts at {begin}, expected {end}")
        end = stop
    if end != data_len:
        raise ValueError(f"data is {data_len} bytes, the header describes {end}")
    return specs


def _verify_digest(meta: object, table: dict, data: memoryview) -> None:
    want = meta.get(DIGEST) if isinstance(meta, dict) else None
    if not isinstance(want, str):
        raise ValueError(f"header has no {DIGEST} checksum (__metadata__)")
    h = xxhash.xxh3_64(_canonical(table))
    h.update(data)
    if h.hexdigest() != want:
        raise ValueError(f"checksum mismatch: the stored bytes changed ({DIGEST} "
                         f"{h.hexdigest()} != {want[:16]!r})")


def finite(t: Tensor) -> bool:
    """Whether every element of a float tensor is finite. A sum is finite when every term is
    (one NaN or inf makes it NaN or inf), and costs a fraction of isfinite(); only a sum that
    overflowed is checked element by element."""
    if not t.is_floating_point() or t.numel() == 0:
        return True
    acc = torch.float64 if t.dtype == torch.float64 else torch.float32
    if math.isfinite(float(t.sum(dtype=acc))):
        return True
    return bool(torch.isfinite(t).all())


def _nat(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 62
