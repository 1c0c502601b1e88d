"""The trained policy: a VideoModel's trainable module (LoRA or full) plus its anchors.

Anchors (ALGORITHM.md section 5) are snapshots of the trainable parameters only, so with
LoRA they are the adapter weights (a few MB), never a second copy of the model:
- `pi0`: the policy at setup (the `fixed` strategy's anchor);
- `moving`: refreshed every kl.anchor_period optimizer steps;
- `prev`: the policy before the last optimizer step (the exact D_step).

`anchor_velocity` swaps an anchor's weights into the live module, runs the forward without
grad, and swaps them back, one parameter at a time. Call it before the policy's own forward
of a micro-batch: swapping after it would change tensors autograd saved for backward.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Literal

import torch
from torch import Tensor

from common.config import OptimConfig
from rollout_worker.models.base import Cond, VideoModel
from rollout_worker.models.lora import inject_lora, is_lora_key

AnchorName = Literal["pi0", "moving", "prev"]


class Policy:
    def __init__(self, model: VideoModel, optim: OptimConfig, anchors: Sequence[AnchorName] = ("pi0", "moving")):
        self.model = model
        self.finetune = optim.finetune
        self.module = model.trainable_module()
        if optim.finetune == "lora":
            inject_lora(self.module, model.family, optim)
        else:
            self.module.requires_grad_(True)
        # No dropout: the learner must recompute exactly the log-probs the sampler computed.
        self.module.eval()
        self.params = {n: p for n, p in self.module.named_parameters() if p.requires_grad}
        if not self.params:
            raise ValueError(f"the {model.family!r} trainable module has no trainable parameters")
        self.anchors: dict[str, dict[str, Tensor]] = {a: self.snapshot() for a in anchors}
        self.device = next(iter(self.params.values())).device

    # --- forward -----------------------------------------------------------------------

    def velocity(self, x: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        """v_θ(x, σ, c); bf16 autocast on CUDA, fp32 elsewhere. [B, C, F, H, W]"""
        dev = torch.device(self.device).type
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
            return self.model.velocity(x, sigma, cond)

    @torch.no_grad()
    def anchor_velocity(self, name: str, x: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        with self.swapped(name):
            return self.velocity(x, sigma, cond)

    # --- anchors -----------------------------------------------------------------------

    @torch.no_grad()
    def snapshot(self) -> dict[str, Tensor]:
        return {n: p.detach().clone() for n, p in self.params.items()}

    @torch.no_grad()
    def refresh(self, name: str) -> None:
        """Set an anchor to the current weights."""
        for n, p in self.params.items():
            self.anchors[name][n].copy_(p.detach())

    @torch.no_grad()
    def _swap(self, name: str) -> None:
        snap = self.anchors[name]
        for n, p in self.params.items():
            tmp = p.detach().clone()
            p.copy_(snap[n])
            snap[n].copy_(tmp)

    @contextmanager
    def swapped(self, name: str) -> Iterator[None]:
        if name not in self.anchors:
            raise KeyError(f"policy keeps no {name!r} anchor (kept: {sorted(self.anchors)})")
        self._swap(name)
        try:
            yield
        finally:
            self._swap(name)

    # --- weights -----------------------------------------------------------------------

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return list(self.params.values())

    @torch.no_grad()
    def weights_payload(self) -> dict[str, Tensor]:
        """What the rollout side loads with VideoModel.load_weights.

        LoRA: only the adapter, keyed as the injected module's state dict
        (`blocks.0.attn1.to_q.lora_A.default.weight`); the receiver injects the same adapter
        first (rollout_worker.models.lora.inject_lora). Full: the module's whole state dict.
        """
        sd = self.module.state_dict()
        if self.finetune == "lora":
            sd = {k: v for k, v in sd.items() if is_lora_key(k)}
        return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in sd.items()}

    def state_dict(self) -> dict:
        return {"params": self.snapshot(), "anchors": {a: dict(s) for a, s in self.anchors.items()}}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        params, anchors = state["params"], state["anchors"]
        if set(params) != set(self.params):
            missing = sorted(set(self.params) - set(params))[:3]
            raise KeyError(f"checkpoint's trainable parameters do not match this policy (missing {missing}); "
                           f"was it saved with the same optim.finetune and LoRA settings?")
        for n, p in self.params.items():
            p.copy_(params[n])
        for a in self.anchors:
            if a not in anchors:
                raise KeyError(f"checkpoint has no {a!r} anchor")
            for n in self.params:
                self.anchors[a][n].copy_(anchors[a][n])
