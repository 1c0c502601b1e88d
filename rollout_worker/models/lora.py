"""LoRA injection with per-family default target modules.

The learner trains the adapter; the rollout side injects the same adapter (same family,
rank, alpha, targets) before it loads an adapter-only weights payload, whose keys are the
injected module's keys, e.g. `blocks.0.attn1.to_q.lora_A.default.weight`.

`LoraLinear` is laid out and computes as peft's `lora.Linear` (plain LoRA, no dropout): the same
modules and state-dict keys, the same initial values from the same seed, the same forward, which
tests/test_lora_seed.py holds to peft itself. It is ours because importing peft costs every
rollout and learner process 2-3 s (peft pulls in transformers and torch._dynamo); peft stays
what diffusers' `load_lora_weights` uses to read an export (cluster/runs/export.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from common.config import OptimConfig
from common.families import FAMILIES

ADAPTER = "default"


def lora_targets(family: str, optim: OptimConfig) -> list[str]:
    if optim.lora_target_modules is not None:
        return list(optim.lora_target_modules)
    if family not in FAMILIES:
        raise ValueError(f"no default LoRA targets for model family {family!r}; "
                         f"set optim.lora_target_modules")
    return list(FAMILIES[family].lora_targets)  # the family's attention projections (common/families.py)


def inject_lora(module: nn.Module, family: str, optim: OptimConfig, seed: int = 0) -> nn.Module:
    """Add a LoRA adapter in place (B = 0, so the output is unchanged); only it requires grad.

    The adapter weights are fp32 whatever the base dtype (cast to the base dtype, as peft does,
    then widened: in bf16, lr·grad falls below bf16 resolution); the adapter path runs in its dtype.
    The learner and the rollout side both inject through here, so they compute alike.
    """
    targets = lora_targets(family, optim)
    names = {n.rsplit(".", 1)[-1] for n, _ in module.named_modules()} | {
        n for n, _ in module.named_modules()}
    if not any(n == t or n.endswith("." + t) for t in targets for n in names):
        raise ValueError(f"optim.lora_target_modules {targets} match no module of the "
                         f"{family!r} transformer")
    # lora_A is drawn from torch's global RNG, whose state differs per process: seeded here, a
    # run is reproducible from its config (the learner passes train.seed), on any device
    with torch.random.fork_rng(), _adapters_on_cpu(any(p.is_meta for p in module.parameters()), module):
        torch.manual_seed(seed)
        for name in [n for n, _ in module.named_modules()]:  # as peft: every match, in module order
            if any(name == t or name.endswith("." + t) for t in targets):
                parent, _, child = name.rpartition(".")
                host = module.get_submodule(parent)
                setattr(host, child, LoraLinear(getattr(host, child), optim.lora_rank, optim.lora_alpha, name))
        for name, p in module.named_parameters():  # only the adapter trains
            if "lora_" not in name:
                p.requires_grad_(False)
    for name, p in module.named_parameters():
        if is_lora_key(name) and p.dtype != torch.float32:
            p.data = p.data.float()
    return module


class LoraLinear(nn.Module):
    """y = base(x) + B(A(x)) · alpha / r, the adapter's path in the adapter's dtype: peft's
    lora.Linear (plain LoRA, dropout 0, bias only in the base), module for module, so its keys are
    `base_layer.weight`, `lora_A.default.weight`, `lora_B.default.weight`. A is drawn as peft
    draws it (both layers built as nn.Linear, then A kaiming-uniform again), B is zero, and both
    take the base weight's device and dtype (inject_lora then makes them fp32)."""

    def __init__(self, base: nn.Module, r: int, alpha: float, name: str = ""):
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise ValueError(f"optim.lora_target_modules matches {name or 'a module'} "
                             f"({type(base).__name__}); LoRA targets nn.Linear layers only")
        self.base_layer = base
        self.lora_dropout = nn.ModuleDict({ADAPTER: nn.Identity()})
        a, b = nn.Linear(base.in_features, r, bias=False), nn.Linear(r, base.out_features, bias=False)
        nn.init.kaiming_uniform_(a.weight, a=math.sqrt(5))
        nn.init.zeros_(b.weight)
        w = base.weight
        dtype = w.dtype if w.dtype.is_floating_point else None
        self.lora_A = nn.ModuleDict({ADAPTER: a.to(w.device, dtype=dtype)})
        self.lora_B = nn.ModuleDict({ADAPTER: b.to(w.device, dtype=dtype)})
        self.scaling = alpha / r

    @property
    def weight(self) -> torch.Tensor:  # callers that read a projection's weight (its dtype, device)
        return self.base_layer.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base_layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)
        a, b = self.lora_A[ADAPTER], self.lora_B[ADAPTER]
        if x.dtype != a.weight.dtype:
            x = x.to(a.weight.dtype)
        return (result + b(a(x)) * self.scaling).to(result.dtype)


@contextmanager
def _adapters_on_cpu(on: bool, module: nn.Module) -> Iterator[None]:
    """On a module built on meta (the sharded learner's), each new adapter would go to its base
    layer's device, meta, losing the seeded values. For the injection, each meta `weight` is
    stood in for by a CPU tensor of its shape and dtype that takes no memory (a stride-0
    expand): the adapters then stay on the CPU, cast to the base dtype exactly as on a loaded
    model. The meta weights are put back after; the learner shards the adapters with their
    block (learner/shard_load.py)."""
    if not on:
        yield
        return
    real = {}
    for m in module.modules():
        w = m._parameters.get("weight")
        if w is not None and w.is_meta:
            real[m] = w
            m._parameters["weight"] = nn.Parameter(torch.zeros((), dtype=w.dtype).expand(w.shape),
                                                   requires_grad=False)
    try:
        yield
    finally:
        for m, w in real.items():
            w.requires_grad_(m._parameters["weight"].requires_grad)  # the injection froze the stand-in
            m._parameters["weight"] = w


def is_lora_key(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name
