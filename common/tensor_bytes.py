"""How many bytes of tensor storage a process holds, and its peak, over a block of code: every
storage a torch op allocates inside the block (on any device but meta) is counted from the op
that makes it until the storage is freed. This is the figure `vgrpo plan`'s per-rank terms
predict (parameters, masters, anchors, gradients, optimizer state, activations), measured the
same way on a CPU as on a GPU, without the allocator's caching or the process's other memory.

Storages made outside torch's dispatcher (a safetensors file mapped into memory) are not
counted until an op copies them, which is when they take memory of their own.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveTensorBytes(TorchDispatchMode):
    """Use as a context manager; read `peak` (and `now`) after or inside it."""

    def __init__(self):
        super().__init__()
        self.now = 0
        self.peak = 0
        self._live: dict[int, int] = {}

    def _free(self, key: int) -> None:
        self.now -= self._live.pop(key, 0)

    def _track(self, t: torch.Tensor, inputs: set[int]) -> None:
        st = _storage(t)
        if st is None:
            return
        key = st._cdata
        if key in self._live or key in inputs:  # a view or an in-place result: no new bytes
            return
        n = st.nbytes()
        self._live[key] = n
        self.now += n
        self.peak = max(self.peak, self.now)
        weakref.finalize(st, self._free, key)  # storages keep their Python object while alive

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {st._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
                  for st in [_storage(t)] if st is not None}
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t, inputs)
        return out


def _storage(t: torch.Tensor):
    """The storage holding `t`'s bytes (a DTensor's: its shard's), None on meta."""
    local = getattr(t, "_local_tensor", t)
    if not isinstance(local, torch.Tensor) or local.is_meta or type(local) is not torch.Tensor:
        return None
    return local.untyped_storage()


def tensor_leaves(tree) -> list[torch.Tensor]:
    """The tensors in a nest of dicts, lists and tuples (a state dict, a checkpoint's state)."""
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]
