"""Modules built with their parameters on the meta device: no parameter storage is allocated or
initialised, while buffers (RoPE tables and the like, computed in __init__ from the config) are
built as usual. The learner shards such a module and then reads each rank's own rows of every
weight from the checkpoint's safetensors files (learner/shard_load.py), so no process ever holds
the whole model. Written here rather than taken from accelerate, which the project does not need.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter a module registers inside the block is moved to the meta device as it is
    registered, before the module's own initialisation runs (which is then a no-op on meta).
    Buffers stay where they were built."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        p = module._parameters.get(name)
        if p is not None and p.device.type != "meta":
            module._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def has_meta_parameters(module: nn.Module) -> bool:
    return any(p.device.type == "meta" for p in module.parameters())


def nbytes_materialised(module: nn.Module) -> int:
    """Bytes of parameter storage `module` holds off the meta device (its local shards under FSDP2)."""
    total = 0
    for p in module.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if local.device.type != "meta":
            total += local.numel() * local.element_size()
    return total

