"""The trained policy: a VideoModel's trainable module (LoRA or full) plus its anchors.

Anchors (ALGORITHM.md section 5) are snapshots of the trainable parameters only, so with
LoRA they are the adapter weights (a few MB), never a second copy of the model:
- `pi0`: the policy at setup (the `fixed` strategy's anchor);
- `moving`: refreshed every kl.anchor_period optimizer steps;
- `ema`: the exponential moving average of the weights (optim.ema_decay), the exported policy;
- `old`: DiffusionNFT's sampling policy v_old, following θ after each step (nft.old_*);

`anchor_velocity` swaps an anchor's weights into the live module, runs the forward without
grad, and swaps them back, one parameter at a time. Call it before the policy's own forward
of a micro-batch: swapping after it would change tensors autograd saved for backward.

Precision: the module computes with the weights the sampler holds (model.dtype, no autocast),
so log r = 0 on replay. Trainable weights held below fp32 get fp32 master copies, which the
optimizer steps (`optim_parameters`); `grads_to_master` before the step and `master_to_params`
after it move between the two. LoRA adapters are fp32 themselves (no copy). Under FSDP2 the
sharded fp32 parameters are the masters and MixedPrecisionPolicy makes the compute copy
(`prepare_for_sharding`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Literal

import torch
from torch import Tensor

from common.config import OptimConfig
from common.types import Cond
from rollout_worker.models.base import VideoModel
from rollout_worker.models.lora import inject_lora, is_lora_key


def enable_checkpointing(module: torch.nn.Module) -> None:
    """Activation checkpointing of the transformer blocks (diffusers' own, per block), for every
    diffusers model in `module` (both Wan 2.2 experts when both train). Only grad-enabled forwards
    recompute, so the sampler and the anchors' no-grad forwards are unchanged."""
    models = [m for m in module.modules() if getattr(m, "_supports_gradient_checkpointing", False)]
    if not models:
        raise ValueError(f"model.gradient_checkpointing: {type(module).__name__} does not support it; "
                         "set model.gradient_checkpointing: false")
    for m in models:
        m.enable_gradient_checkpointing()

AnchorName = Literal["pi0", "moving", "ema", "old"]


Sharder = Callable[[torch.nn.Module, list[str]], "torch.dtype | None"]
"""Shards a module built on meta and fills each rank's shard, the trained weights in fp32
(learner/shard_load.lean_sharder); given the trained parameters' names, returns FSDP2's param_dtype."""


class Policy:
    def __init__(self, model: VideoModel, optim: OptimConfig, anchors: Sequence[AnchorName] = ("pi0", "moving"),
                 checkpointing: bool = False, seed: int = 0, sharder: Sharder | None = None):
        """sharder: the lean sharded setup (the module is on meta): it shards and loads the module,
        whose sharded fp32 parameters are then the masters, and the anchors are taken per shard.
        Without it the module holds its weights and fp32 masters are copied here (the reference
        path; Trainer.shard may shard it after)."""
        self.model = model
        self.finetune = optim.finetune
        self.module = model.trainable_module()
        if optim.finetune == "lora":
            inject_lora(self.module, model.family, optim, seed=seed)  # lora_A from the seed
        else:
            self.module.requires_grad_(True)
        # No dropout: the learner must recompute exactly the log-probs the sampler computed.
        self.module.eval()
        if checkpointing:
            enable_checkpointing(self.module)
        self.params = {n: p for n, p in self.module.named_parameters() if p.requires_grad}
        if not self.params:
            raise ValueError(f"the {model.family!r} trainable module has no trainable parameters")
        self.compute_dtype: torch.dtype | None = None  # FSDP2's param_dtype, once sharded
        if sharder is not None:
            self.compute_dtype = sharder(self.module, list(self.params))
            self.params = {n: p for n, p in self.module.named_parameters() if p.requires_grad}
            self.master = {}
        else:
            self.master = self._make_master()
        self.anchors: dict[str, dict[str, Tensor]] = {a: self._snapshot_for(a) for a in anchors}
        self.device = next(iter(self.params.values())).device

    # --- forward -----------------------------------------------------------------------

    def velocity(self, x: Tensor, sigma: Tensor, cond: Cond, sigma_next: Tensor | None = None) -> Tensor:
        """v_θ(x, σ, c) exactly as the sampler computes it (same weights and dtype, no autocast). [B, C, F, H, W]"""
        kw = {"sigma_next": sigma_next} if self.model.needs_sigma_next else {}
        return self.model.velocity(x, sigma, cond, **kw)

    @torch.no_grad()
    def anchor_velocity(self, name: str, x: Tensor, sigma: Tensor, cond: Cond,
                        sigma_next: Tensor | None = None) -> Tensor:
        with self.swapped(name):
            return self.velocity(x, sigma, cond, sigma_next)

    # --- master weights ------------------------------------------------------------------

    def _make_master(self) -> dict[str, torch.nn.Parameter]:
        """fp32 copies of the trainable weights held below fp32 (none for fp32 or LoRA adapters)."""
        return {n: torch.nn.Parameter(p.detach().float().clone())
                for n, p in self.params.items() if p.dtype != torch.float32}

    def optim_parameters(self) -> list[Tensor]:
        """What the optimizer steps: the fp32 master of each trainable weight (or the weight itself)."""
        return [self.master.get(n, p) for n, p in self.params.items()]

    @torch.no_grad()
    def grads_to_master(self) -> None:
        for n, m in self.master.items():
            g = self.params[n].grad
            m.grad = None if g is None else g.float()
            self.params[n].grad = None

    @torch.no_grad()
    def master_to_params(self) -> None:
        """The compute weights from the masters, rounded as the sampler's load rounds them."""
        for n, m in self.master.items():
            self.params[n].copy_(m)

    @torch.no_grad()
    def prepare_for_sharding(self) -> torch.dtype | None:
        """Before FSDP2: make the masters the module's own (fp32) parameters; returns the
        param_dtype FSDP2 must compute in (None: keep each parameter's dtype)."""
        compute = None
        for n, m in self.master.items():
            compute = self.params[n].dtype
            self.params[n].data = m.data
        self.master = {}
        self.compute_dtype = compute
        return compute

    def rebind(self) -> None:
        """Re-read the parameters after the module's were replaced (FSDP2 sharding)."""
        self.params = {n: p for n, p in self.module.named_parameters() if p.requires_grad}
        self.anchors = {a: self._snapshot_for(a) for a in self.anchors}

    # --- anchors -----------------------------------------------------------------------

    @torch.no_grad()
    def snapshot(self) -> dict[str, Tensor]:
        return {n: p.detach().clone() for n, p in self.params.items()}

    def _snapshot_for(self, name: str) -> dict[str, Tensor]:
        # the averages are kept in fp32: bf16 could not hold their small per-step moves
        if name in ("ema", "old"):
            return {n: self.master.get(n, p).detach().float().clone() for n, p in self.params.items()}
        return self.snapshot()

    @torch.no_grad()
    def refresh(self, name: str) -> None:
        """Set an anchor to the current weights."""
        for n, p in self.params.items():
            self.anchors[name][n].copy_(p.detach())

    @torch.no_grad()
    def update_ema(self, decay: float, name: str = "ema") -> None:
        """anchor <- decay * anchor + (1 - decay) * theta, in fp32 from the fp32 masters (`ema`, or
        DiffusionNFT's `old`)."""
        for n, p in self.params.items():
            self.anchors[name][n].lerp_(self.master.get(n, p).detach().float(), 1.0 - decay)

    @torch.no_grad()
    def _swap(self, name: str) -> None:
        snap = self.anchors[name]
        for n, p in self.params.items():
            tmp = p.detach().clone()
            p.copy_(snap[n])
            snap[n].copy_(tmp)
        self.after_swap()

    def after_swap(self) -> None:
        """Called after weights are swapped in or out. Under FSDP2 (Trainer.shard) it drops the
        gathered copies, so the next forward gathers the weights the shards now hold."""

    @contextmanager
    def swapped(self, name: str) -> Iterator[None]:
        """The anchor's weights in the live module for the block (rounded to the weights' dtype).

        An anchor held in the weights' own dtype is exchanged in place (no extra copy); one held in
        higher precision (the fp32 average of bf16 weights) is copied in and the live weights restored
        after, since an exchange would round the anchor itself."""
        if name not in self.anchors:
            raise KeyError(f"policy keeps no {name!r} anchor (kept: {sorted(self.anchors)})")
        snap = self.anchors[name]
        if all(snap[n].dtype == p.dtype for n, p in self.params.items()):
            self._swap(name)
            try:
                yield
            finally:
                self._swap(name)
            return
        live = self.snapshot()
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(snap[n])
        self.after_swap()
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in self.params.items():
                    p.copy_(live[n])
            self.after_swap()

    # --- weights -----------------------------------------------------------------------

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return list(self.params.values())

    def payload_tensors(self) -> dict[str, Tensor]:
        """What the rollout side loads with VideoModel.load_weights, as references (no copy;
        under FSDP2 the local shards, as DTensors).

        LoRA: only the adapter, keyed as the injected module's state dict
        (`blocks.0.attn1.to_q.lora_A.default.weight`); the receiver injects the same adapter
        first (rollout_worker.models.lora.inject_lora). Full: the module's whole state dict.
        """
        sd = self.module.state_dict()
        if self.finetune == "lora":
            sd = {k: v for k, v in sd.items() if is_lora_key(k)}
        return sd

    def wire_dtype(self, name: str, t: Tensor) -> torch.dtype:
        """The dtype the rollout side holds `name` in, which is the one it travels in: sharded fp32
        masters go as the compute copy FSDP2 makes (model.dtype; rounding is the same elementwise
        on a shard as on the whole tensor), everything else as it is here."""
        if self.compute_dtype is not None and t.is_floating_point():
            if not hasattr(self, "_param_names"):  # buffers keep their dtype, as FSDP2 leaves them
                self._param_names = {n for n, _ in self.module.named_parameters()}
            if name in self._param_names:
                return self.compute_dtype
        return t.dtype

    @torch.no_grad()
    def weights_payload(self) -> dict[str, Tensor]:
        """`payload_tensors` copied to the CPU (the single-process path)."""
        return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in self.payload_tensors().items()}

    def state_dict(self) -> dict:
        """The fp32 master values (so a resume loses no precision) and the anchors, as references:
        a checkpoint writes them as they are (a copy of every shard would double the trained
        state's memory for the save); read or write them before the next step changes them."""
        params = {n: self.master.get(n, p).detach() for n, p in self.params.items()}
        return {"params": params, "anchors": {a: dict(s) for a, s in self.anchors.items()}}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        params, anchors = state["params"], state["anchors"]
        if set(params) != set(self.params):
            missing = sorted(set(self.params) - set(params))[:3]
            raise KeyError(f"checkpoint's trainable parameters do not match this policy (missing {missing}); "
                           f"was it saved with the same optim.finetune and LoRA settings?")
        for n, p in self.params.items():
            p.copy_(params[n])
            if n in self.master:
                self.master[n].copy_(params[n])
        for a in self.anchors:
            # a run that turns optim.ema_decay on at a resume starts its average at the resumed weights
            src = anchors.get(a, params if a in ("ema", "old") else None)
            if src is None:
                raise KeyError(f"checkpoint has no {a!r} anchor")
            for n in self.params:
                self.anchors[a][n].copy_(src[n])
