"""What the trainer asks of a method (learner/trainer.py calls these, in this order per step)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from torch import Tensor

from common.methods import method_of, method_params
from common.types import Cond, TrainBatch


class Method(Protocol):
    keys: list[str]            # the stats its micro-batches sum (batch-wide after the reduce)
    rollout_anchor: str | None  # the weights the rollouts are sent instead of the live ones (None: live)

    def anchors(self) -> set[str]:
        """The anchors its loss evaluates (the Policy keeps a copy of each)."""

    def rows(self, batch: TrainBatch, version: int) -> Any:
        """The step's learner rows (with `.cond`, `.stats`) from the batch the rollouts made."""

    def micro_batches(self, rows: Any, size: int, rank: int, world_size: int) -> Iterable[Any]:
        """This rank's share of the rows, `size` rows a micro-batch (every rank the same count)."""

    def micro_loss(self, trainer, rows: Any, mb: Any, cond_all: Cond, lam_kl: float) -> tuple[Tensor, dict[str, Tensor]]:
        """One micro-batch's share of the loss (with grad) and its stats sums."""

    def step_stats(self, trainer, stats: dict[str, float], onpolicy_absmax: float) -> None:
        """After the step: the stats only the method can finish (in place)."""

    def after_step(self, trainer, stats: dict[str, float]) -> None:
        """After a finite optimizer step: anchors and λ_KL move."""

    def measures_pi0(self, trainer, version: int) -> bool:
        """Whether the step at `version` measures the KL to π_0 for the health checks."""


class Declared:
    """What every method reads from its declaration (common/methods.py), once: the weights its
    rollouts sample (`rollout_anchor`), the anchors its loss evaluates, its own hyperparameters
    (`p`: the upstream defaults with grpo.params over them). A method without a log-prob ratio
    has no step stats to finish."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.rollout_anchor = method_of(cfg).rollout_anchor  # None: the rollouts sample the live weights
        self.p = method_params(cfg)

    def anchors(self) -> set[str]:
        return set(method_of(self.cfg).anchors(self.cfg))

    def step_stats(self, trainer, stats: dict[str, float], onpolicy_absmax: float) -> None:
        pass
