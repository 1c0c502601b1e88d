"""The safetensors format, written and read with one copy each way.

`safetensors.torch.save/load` copy each tensor two or three times, which cost the bank
about half its throughput on 16 MB entries. The format is simple (8-byte little-endian
header length, a JSON header padded to 8 bytes, then the raw little-endian data), so it is
written here; blobs stay readable by the safetensors library and vice versa (tested).
Reading validates everything and raises ValueError; it never unpickles.
"""

from __future__ import annotations

import json
import math
import warnings

import torch
from torch import Tensor

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
CODES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 1 << 20   # our headers are a few hundred bytes


def dumps(tensors: dict[str, Tensor]) -> bytes:
    header: dict[str, dict] = {}
    parts = []
    off = 0
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        if t.dtype not in CODES:
            raise ValueError(f"tensor {name!r}: dtype {t.dtype} cannot be stored")
        raw = t.reshape(-1).view(torch.uint8).numpy()   # zero-copy byte view
        header[name] = {"dtype": CODES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [off, off + raw.nbytes]}
        off += raw.nbytes
        parts.append(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)                          # keeps the data 8-byte aligned
    return b"".join([len(h).to_bytes(8, "little"), h, *parts])


def loads(blob: bytes | bytearray | memoryview, copy: bool = True) -> dict[str, Tensor]:
    """The tensors of a blob. With copy=False and an immutable `bytes` blob they view its memory
    (and keep it alive): for a caller that owns the blob and only reads the tensors."""
    mv = memoryview(blob).cast("B")
    if len(mv) < 8:
        raise ValueError(f"blob of {len(mv)} bytes is shorter than the 8-byte header length")
    n = int.from_bytes(mv[:8], "little")
    if n > min(MAX_HEADER, len(mv) - 8):
        raise ValueError(f"header length {n} exceeds the blob ({len(mv)} bytes)")
    try:
        header = json.loads(bytes(mv[8:8 + n]))
    except (ValueError, RecursionError):
        raise ValueError("header is not JSON") from None
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    header.pop("__metadata__", None)
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
    # The data must be exactly covered, tensor after tensor, with no gap or overlap.
    specs.sort(key=lambda s: (s[0], s[1]))
    end = 0
    for begin, stop, name, _, _ in specs:
        if begin != end:
            raise ValueError(f"tensor {name!r}: data starts at {begin}, expected {end}")
        end = stop
    if end != len(mv) - 8 - n:
        raise ValueError(f"data is {len(mv) - 8 - n} bytes, the header describes {end}")
    if copy or not isinstance(blob, bytes):
        buf = bytearray(mv[8 + n:])    # the one copy: writable memory the tensors own
    else:
        buf = mv[8 + n:]
    out = {}
    for begin, stop, name, dtype, shape in specs:
        if stop == begin:
            out[name] = torch.empty(shape, dtype=dtype)
        else:
            with warnings.catch_warnings():  # "not writable": copy=False is read-only by contract
                warnings.simplefilter("ignore", UserWarning)
                out[name] = torch.frombuffer(buf, dtype=dtype, count=math.prod(shape),
                                             offset=begin).reshape(shape)
    return out


def _nat(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 62
