"""The exported policy's files in a checkpoint: diffusers' sharded safetensors layout, planned
from names, shapes and dtypes alone (no data), the same on every learner rank.

    step_NNNNNNNN/policy/transformer/config.json              (a full fine-tune: the class's config)
    step_NNNNNNNN/policy/transformer/diffusion_pytorch_model.safetensors.index.json
    step_NNNNNNNN/policy/transformer/diffusion_pytorch_model-00001-of-00004.safetensors …
    step_NNNNNNNN/policy/transformer_2/…                     (Wan 2.2 with both experts trained)

`policy/transformer/` is what `WanTransformer3DModel.from_pretrained` (the family's transformer
class) loads. A LoRA run's folders hold the adapter under vgrpo's keys, with no config.json.

Who writes what (learner/policy_writer.py): the tensors, in `Layout.entries` order, are cut into
`world` contiguous runs of about equal bytes; rank r writes the shard files of its run (one per
expert folder it reaches), and no two ranks write the same file. Every rank gathers each tensor
in that order (a collective); only its owner writes it, so a rank's host holds one tensor at a
time, never a shard. Rank 0 writes the config and the index once every shard is written: the
index is the marker, so a reader never sees a policy whose shards are not all there.

The safetensors header of each shard is known before its first tensor is gathered (offsets
follow from shapes and dtypes), so a shard is streamed to its file tensor by tensor. Within a
file the tensors go by element size, largest first, then name (safetensors' own order), so every
tensor starts at a multiple of its element size.

A checkpoint written before this layout holds one `policy.safetensors` (LEGACY_FILE), still read.
Pure: no torch (dtypes are torch's names: "bfloat16", "float32", …).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

POLICY_DIR = "policy"
LEGACY_FILE = "policy.safetensors"
WEIGHTS_INDEX = "diffusion_pytorch_model.safetensors.index.json"   # diffusers' SAFE_WEIGHTS_INDEX_NAME
CONFIG_FILE = "config.json"
EXPERTS = ("transformer", "transformer_2")

# torch dtype name -> (safetensors dtype, bytes per element)
DTYPES: dict[str, tuple[str, int]] = {
    "float64": ("F64", 8), "float32": ("F32", 4), "float16": ("F16", 2), "bfloat16": ("BF16", 2),
    "int64": ("I64", 8), "int32": ("I32", 4), "int16": ("I16", 2), "int8": ("I8", 1),
    "uint8": ("U8", 1), "bool": ("BOOL", 1),
}


def shard_name(k: int, n: int) -> str:
    """diffusers' name of shard k (1-based) of n."""
    return f"diffusion_pytorch_model-{k:05d}-of-{n:05d}.safetensors"


def split_key(key: str, prefixed: bool) -> tuple[str, str]:
    """(expert folder, key in its files) of a payload key: a run that trains both Wan 2.2 experts
    keys them `transformer.…` and `transformer_2.…` (the trained ModuleDict); any other run
    trains `transformer` alone, its keys as they are."""
    if not prefixed:
        return EXPERTS[0], key
    head, _, rest = key.partition(".")
    return head, rest


def is_prefixed(keys) -> bool:
    """Whether payload keys name the expert first (a ModuleDict of the experts)."""
    heads = {k.split(".", 1)[0] for k in keys}
    return bool(heads) and heads <= set(EXPERTS)


@dataclass(frozen=True)
class Entry:
    key: str                  # in the payload
    expert: str
    file_key: str             # in the shard file (and the diffusers model)
    shape: tuple[int, ...]
    dtype: str                # torch's name
    nbytes: int
    owner: int                # the rank that writes it


@dataclass
class ShardFile:
    expert: str
    name: str
    owner: int
    entries: list[Entry] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def header(self, meta: dict[str, str]) -> bytes:
        """The file's first bytes: the header's length (8 bytes, little-endian), then its JSON,
        padded with spaces to a multiple of 8. Its tensors follow in `entries` order."""
        head: dict = {"__metadata__": dict(meta)} if meta else {}
        off = 0
        for e in self.entries:
            head[e.file_key] = {"dtype": DTYPES[e.dtype][0], "shape": list(e.shape), "data_offsets": [off, off + e.nbytes]}
            off += e.nbytes
        text = json.dumps(head, separators=(",", ":")).encode("utf-8")
        text += b" " * (-len(text) % 8)
        return len(text).to_bytes(8, "little") + text


@dataclass
class Layout:
    entries: list[Entry]      # the order every rank gathers them in
    files: list[ShardFile]

    def files_of(self, rank: int) -> list[ShardFile]:
        return [f for f in self.files if f.owner == rank]

    def experts(self) -> list[str]:
        return sorted({f.expert for f in self.files}, key=EXPERTS.index)

    def index(self, expert: str, meta: dict[str, str]) -> dict:
        """diffusers' index of one expert folder: every key's shard, the total size, our metadata."""
        files = [f for f in self.files if f.expert == expert]
        return {"metadata": {"total_size": sum(f.nbytes for f in files), **meta},
                "weight_map": {e.file_key: f.name for f in files for e in f.entries}}

    def largest(self) -> int:
        """The most bytes one tensor takes: what a writing rank holds on its host at once."""
        return max((e.nbytes for e in self.entries), default=0)


def plan(specs: list[tuple[str, tuple[int, ...], str]], world: int) -> Layout:
    """The layout of a payload given as (key, shape, torch dtype name), written by `world` ranks."""
    if world < 1:
        raise ValueError(f"world = {world}: at least one rank writes the policy")
    prefixed = is_prefixed([k for k, _, _ in specs])
    rows = []
    for key, shape, dtype in specs:
        if dtype not in DTYPES:
            raise ValueError(f"policy tensor {key!r}: dtype {dtype} has no safetensors name")
        expert, file_key = split_key(key, prefixed)
        n = DTYPES[dtype][1]
        for s in shape:
            n *= int(s)
        rows.append((expert, file_key, key, tuple(int(s) for s in shape), dtype, n))
    rows.sort(key=lambda r: (EXPERTS.index(r[0]) if r[0] in EXPERTS else len(EXPERTS), -DTYPES[r[4]][1], r[1]))
    total = sum(r[5] for r in rows) or 1
    entries, start = [], 0
    for expert, file_key, key, shape, dtype, n in rows:
        # a contiguous run of about total / world bytes per rank, cut at tensors' midpoints
        owner = min(world - 1, int((start + n / 2) * world // total))
        entries.append(Entry(key, expert, file_key, shape, dtype, n, owner))
        start += n
    by_file: dict[tuple[str, int], ShardFile] = {}
    for e in entries:
        by_file.setdefault((e.expert, e.owner), ShardFile(e.expert, "", e.owner)).entries.append(e)
    files = []
    for expert in dict.fromkeys(e.expert for e in entries):
        mine = [f for (x, _), f in by_file.items() if x == expert]
        for k, f in enumerate(mine, 1):
            f.name = shard_name(k, len(mine))
            files.append(f)
    return Layout(entries, files)
