"""The lean sharded setup: the trained module is built with its parameters on the meta device
(`build_model(..., empty=True)`), FSDP2-sharded there, and only then materialised, each rank
reading its own rows of every weight straight from the checkpoint's safetensors files
(`safe_open(...).get_slice`). No rank ever holds the whole model and nothing is broadcast: every
rank reads the same bytes of its rows from the same files.

Values are exactly the reference path's (build_model loads the whole model, Policy makes fp32
masters, Trainer.shard broadcasts and shards): each weight is read from the file, rounded to
model.dtype (as that load and `cast_params` round it), then held in its parameter's dtype (fp32
for the trained weights, the masters; model.dtype for a frozen LoRA base).

FSDP2 shards dim 0 as `torch.chunk` does: rank r of n holds rows [r·c, min((r+1)·c, N)) with
c = ceil(N / n) (none when r·c >= N).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor, nn

from common.errors import UserError
from learner import fsdp

INDEX = "diffusion_pytorch_model.safetensors.index.json"


class ShardLoadError(UserError):
    """The checkpoint's files lack a weight the module has, or hold it in another shape."""


class SafetensorsReader:
    """The tensors of one or more diffusers model folders, read by rows.

    `dirs` maps a module-name prefix ("" or "transformer_2.") to the folder holding that part's
    safetensors (with or without an index file)."""

    def __init__(self, dirs: dict[str, Path]):
        self.where: dict[str, tuple[Path, str]] = {}   # module key -> (file, key in the file)
        for prefix, d in dirs.items():
            for key, f in _weight_map(Path(d)).items():
                self.where[prefix + key] = (f, key)
        self._open: dict[Path, object] = {}

    def _slice(self, name: str):
        if name not in self.where:
            raise ShardLoadError(f"model.path: no weight {name!r} in the checkpoint's safetensors "
                                 f"({len(self.where)} weights read from the index); is it this model's checkpoint?")
        f, key = self.where[name]
        if f not in self._open:
            self._open[f] = safe_open(str(f), framework="pt", device="cpu")
        return self._open[f].get_slice(key)

    def rows(self, name: str, start: int, stop: int, shape: torch.Size) -> Tensor:
        """Rows [start, stop) of dim 0 of weight `name` (checked to have `shape`), only those read."""
        sl = self._slice(name)
        if tuple(sl.get_shape()) != tuple(shape):
            raise ShardLoadError(f"model.path: weight {name!r} is {tuple(sl.get_shape())} in the checkpoint, "
                                 f"the model built from its config.json has {tuple(shape)}")
        return sl[start:stop] if len(shape) else sl[:]

    def close(self) -> None:
        self._open.clear()


def _weight_map(d: Path) -> dict[str, Path]:
    """Key -> file of one diffusers model folder (its index, else every *.safetensors in it)."""
    index = d / INDEX
    if index.is_file():
        wm = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return {k: d / f for k, f in wm.items()}
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ShardLoadError(f"model.path: {d} holds no *.safetensors (the sharded learner reads its "
                             "rows from them; convert a .bin checkpoint with diffusers' save_pretrained)")
    out: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as h:
            out.update({k: f for k in h.keys()})  # noqa: SIM118 (safe_open is not a mapping)
    return out


def model_dirs(path: str, module: nn.Module) -> dict[str, Path]:
    """Module-name prefix -> the checkpoint folder of that part: "" -> transformer/ for one
    transformer; "<name>." -> <name>/ for each expert of a ModuleDict (Wan 2.2, both trained)."""
    parts = {f"{k}.": k for k in module} if isinstance(module, nn.ModuleDict) else {"": "transformer"}
    root = Path(path).expanduser()
    if not root.is_dir():  # a hub id: the parts' folders from the local cache (downloaded once)
        from huggingface_hub import snapshot_download  # heavy: huggingface_hub

        root = Path(snapshot_download(path, allow_patterns=[f"{p}/*" for p in parts.values()]))
    return {prefix: root / sub for prefix, sub in parts.items()}


def file_key(name: str) -> str:
    """The checkpoint's key of a module parameter (peft keeps a wrapped layer's under base_layer)."""
    return name.replace(".base_layer.", ".")


def local_rows(p: Tensor) -> tuple[int, int]:
    """The rows [start, stop) of dim 0 this rank's shard of `p` holds (all of a plain tensor)."""
    if not fsdp.is_dtensor(p):
        return 0, (p.shape[0] if p.dim() else 1)
    n, world = p.shape[0], p.device_mesh.size()
    chunk = -(-n // world)
    start = min(n, p.device_mesh.get_local_rank() * chunk)
    stop = min(n, start + chunk)
    if p.to_local().shape[0] != stop - start:  # FSDP2 changed how it shards: refuse, never misload
        raise RuntimeError(f"FSDP2 shard of {tuple(p.shape)} holds {p.to_local().shape[0]} rows, "
                           f"expected {stop - start} (rows {start}:{stop})")
    return start, stop


def lean_sharder(path: str, mesh, device: torch.device, dtype: torch.dtype,
                 offload: bool = False) -> Callable[[nn.Module, list[str]], torch.dtype | None]:
    """What Policy calls in place of fp32 masters + broadcast + shard: `(module, trained names)`
    -> the param_dtype FSDP2 computes in (None: keep each parameter's dtype)."""

    def shard(module: nn.Module, trained: list[str]) -> torch.dtype | None:
        return shard_and_load(module, trained, path, mesh, device, dtype, offload)

    return shard


@torch.no_grad()
def shard_and_load(module: nn.Module, trained: list[str], path: str, mesh, device: torch.device,
                   dtype: torch.dtype, offload: bool = False) -> torch.dtype | None:
    """Shard `module` (parameters on meta, except ones initialised here such as LoRA adapters)
    and fill each rank's shard; the trained weights become fp32 (the masters)."""
    # 1. the trained weights' masters are fp32; FSDP2 gathers them in the dtype they had
    compute = None
    params = dict(module.named_parameters())
    for n in trained:
        if params[n].dtype != torch.float32:
            compute = params[n].dtype
            params[n].data = params[n].data.float()   # still meta: no bytes
    made_here = {n: p.detach().clone() for n, p in params.items() if p.device.type != "meta"}
    buffers = {n: b.detach().clone() for n, b in module.named_buffers()}
    # 2. shard on meta, then give each rank's shard its storage (to_empty also empties buffers)
    fsdp.shard_model(module, mesh, param_dtype=compute, offload=offload)
    module.to_empty(device="cpu" if offload else device)
    for n, b in buffers.items():
        owner, _, leaf = n.rpartition(".")
        module.get_submodule(owner)._buffers[leaf] = b.to(device)
    # 3. each rank's rows, from the files (or from what was initialised here)
    reader = SafetensorsReader(model_dirs(path, module))
    try:
        for n, p in module.named_parameters():
            start, stop = local_rows(p)
            local = p.to_local() if fsdp.is_dtensor(p) else p
            if stop <= start:
                continue
            src = made_here[n][start:stop] if n in made_here else \
                reader.rows(file_key(n), start, stop, p.shape).to(dtype)
            local.copy_(src.reshape(local.shape))
    finally:
        reader.close()
    return compute

