"""LoRA injection with per-family default target modules.

The learner trains the adapter; the rollout side injects the same adapter (same family,
rank, alpha, targets) before it loads an adapter-only weights payload, whose keys are the
injected module's keys, e.g. `blocks.0.attn1.to_q.lora_A.default.weight`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from peft import LoraConfig, inject_adapter_in_model
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

    The adapter weights are fp32 whatever the base dtype (peft would make them bf16 on a bf16
    model, where lr·grad falls below bf16 resolution); peft runs the adapter path in its dtype.
    The learner and the rollout side both inject through here, so they compute alike.
    """
    targets = lora_targets(family, optim)
    names = {n.rsplit(".", 1)[-1] for n, _ in module.named_modules()} | {
        n for n, _ in module.named_modules()}
    if not any(n == t or n.endswith("." + t) for t in targets for n in names):
        raise ValueError(f"optim.lora_target_modules {targets} match no module of the "
                         f"{family!r} transformer")
    cfg = LoraConfig(r=optim.lora_rank, lora_alpha=optim.lora_alpha, target_modules=targets,
                     lora_dropout=0.0, init_lora_weights=True)
    # peft draws lora_A from torch's global RNG, whose state differs per process: seeded here, a
    # run is reproducible from its config (the learner passes train.seed), on any device
    with torch.random.fork_rng(), _adapters_on_cpu(any(p.is_meta for p in module.parameters()), module):
        torch.manual_seed(seed)
        module = inject_adapter_in_model(cfg, module, adapter_name=ADAPTER)
    for name, p in module.named_parameters():
        if is_lora_key(name) and p.dtype != torch.float32:
            p.data = p.data.float()
    return module


@contextmanager
def _adapters_on_cpu(on: bool, module: nn.Module) -> Iterator[None]:
    """On a module built on meta (the sharded learner's), peft would put each new adapter on its
    base layer's device, meta, losing the seeded values. For the injection, each meta `weight`
    is stood in for by a CPU tensor of its shape and dtype that takes no memory (a stride-0
    expand): peft then keeps the adapters on the CPU, cast to the base dtype exactly as on a
    loaded model. The meta weights are put back after; the learner shards the adapters with
    their block (learner/shard_load.py)."""
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
            w.requires_grad_(m._parameters["weight"].requires_grad)  # peft froze the stand-in
            m._parameters["weight"] = w


def is_lora_key(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name
