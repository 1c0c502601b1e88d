"""The finite-update guard: an optimizer step whose loss or gradient is not finite changes nothing.

One NaN or inf in a batch (a damaged latent, an overflow) reaches every weight through AdamW's
moments in a single step; the run then trains, publishes and checkpoints NaN weights. The guard
sits between backward and the step: when the batch-wide loss or the (global) gradient norm is not
finite, the optimizer does not step, so the weights, AdamW's moments, the anchors and λ_KL stay as
they were (the version still advances: it counts steps, and the driver's step follows it). The
step's stats say `update_skipped = 1` and name the groups it came from: those whose tensors hold
a non-finite value, or, when none does, every group of the batch (the loss itself overflowed).
The health check `numerics` stops the run after `health.nonfinite_max` such steps in a row
(cluster/health/checks.py), and a checkpoint never saves non-finite weights (`check_weights`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from common.errors import UserError
from common.types import TrainBatch, Trajectory

SKIPPED = "update_skipped"     # 1.0 when the step was skipped, else 0.0
GROUPS = "nonfinite_groups"    # a str (space-separated group ids): the driver takes it out of the row


class NonFiniteWeights(UserError, ValueError):
    """A state about to be saved holds a NaN or inf weight; the message names the tensor."""


def finite(loss: float, grad_norm: float) -> bool:
    return math.isfinite(loss) and math.isfinite(grad_norm)


def _traj_finite(t: Trajectory) -> bool:
    tensors = [getattr(t, k, None) for k in ("x", "x_next", "logp_old", "mu_old", "final_latents")]
    cond = getattr(t, "cond", None)  # the encoded condition a trajectory carries (codec format 3)
    for part in (getattr(cond, "tensors", None), getattr(cond, "uncond", None)):
        tensors += list((part or {}).values()) if isinstance(part, dict) else []
    return all(not v.is_floating_point() or bool(torch.isfinite(v).all())
               for v in tensors if isinstance(v, Tensor))


def suspects(batch: TrainBatch) -> list[str]:
    """The groups whose trajectories (fresh members or their bank entries) hold a non-finite
    value; every fresh group when none does."""
    bad = []
    for i, g in enumerate(batch.fresh):
        banked = batch.bank[i] if i < len(batch.bank) else []
        if not all(_traj_finite(t) for t in g.members) or not all(_traj_finite(t) for t, _, _ in banked):
            bad.append(g.group_id)
    return bad or [g.group_id for g in batch.fresh]


def step_stats(batch: TrainBatch, skipped: bool) -> dict[str, float | str]:
    """What the step reports: `update_skipped`, and the groups it came from when it was."""
    if not skipped:
        return {SKIPPED: 0.0}
    return {SKIPPED: 1.0, GROUPS: " ".join(suspects(batch))}


def _finite(t: Tensor) -> bool:
    lo, hi = torch.aminmax(t.detach())
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def check_weights(tensors: dict[str, Tensor], what: str) -> None:
    """Refuse to save `tensors` (name -> tensor) when one is not finite. Its min and max (NaN
    propagates into both, ±inf shows in one) allocate two scalars, not a mask the size of the
    weight, so a save stays without a copy of the shards."""
    for name, t in tensors.items():
        if isinstance(t, Tensor) and t.is_floating_point() and t.numel() and not _finite(t):
            raise NonFiniteWeights(f"{what}: weight {name!r} holds NaN/inf; not saved (the last checkpoint "
                                   "stands); the finite-update guard should have skipped the step that made it")
