"""The reward heads of a run: their names in score order, the weight w_h of each, and the
composite R = Σ_h w_h·S_h (docs/algorithm.md, section 3).

One definition for every user: the reward client the rollout actors score with, the learner's
per-head advantages, `vgrpo eval` and the driver's evaluations. A head is named once across all
reward models; two models that report the same head name are refused in one line (the composite
and the per-head advantages could not tell them apart). A head's weight is the one a
`rewards.models[].weights` entry gives it, else 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from common.config import ConfigError, RewardModelConfig
from common.types import Scores


def actor_names(cfgs: Sequence[RewardModelConfig]) -> list[str]:
    """One name per reward model: its name, numbered when a model appears twice."""
    names = [c.name for c in cfgs]
    return [n if names.count(n) == 1 else f"{n}{names[:i].count(n)}" for i, n in enumerate(names)]


@dataclass(frozen=True)
class RewardHeads:
    names: tuple[str, ...]       # every head, model by model, in score order
    weights: tuple[float, ...]   # w_h of each head, aligned with names

    @classmethod
    def build(cls, cfgs: Sequence[RewardModelConfig], heads: Sequence[Sequence[str]],
              models: Sequence[str] | None = None) -> RewardHeads:
        """The heads `heads[i]` that reward model `cfgs[i]` (called `models[i]`, default
        actor_names) reports. ConfigError when two models report the same head name."""
        models = list(models) if models is not None else actor_names(cfgs)
        if not len(cfgs) == len(heads) == len(models):
            raise ValueError(f"{len(cfgs)} reward configs, {len(heads)} head lists, {len(models)} names")
        owner: dict[str, int] = {}
        for i, hs in enumerate(heads):
            if len(set(hs)) != len(hs):
                raise ValueError(f"reward model {models[i]} reports a head twice: {list(hs)}")
            for h in hs:
                if (j := owner.setdefault(h, i)) != i:
                    raise ConfigError(
                        f"rewards.models[{j}] ({models[j]}) and rewards.models[{i}] ({models[i]}) both "
                        f"report a head named {h!r}; head names must be unique across reward models: "
                        "drop one of the two models")
        return cls.of(cfgs, [h for hs in heads for h in hs])

    @classmethod
    def of(cls, cfgs: Sequence[RewardModelConfig], names: Sequence[str]) -> RewardHeads:
        """The heads a Scores carries (`names`, unique), weighted as `cfgs` say (the learner,
        which sees the merged scores, not which model reported each head)."""
        if len(set(names)) != len(names):
            raise ValueError(f"reward heads repeat a name: {list(names)}")
        given: dict[str, tuple[int, float]] = {}
        for i, c in enumerate(cfgs):
            for h, w in c.weights.items():
                if h in given and given[h][1] != w:
                    raise ConfigError(f"rewards.models[{given[h][0]}].weights and rewards.models[{i}].weights "
                                      f"give head {h!r} different weights ({given[h][1]:g}, {w:g}); "
                                      "weigh it in one model only")
                given.setdefault(h, (i, float(w)))
        return cls(tuple(names), tuple(given[h][1] if h in given else 1.0 for h in names))

    def weight(self, head: str) -> float:
        return self.weights[self.names.index(head)]

    def vector(self) -> Tensor:
        """w_h in head order, fp32 [H]."""
        return torch.tensor(self.weights, dtype=torch.float32)

    def composite(self, scores: Scores) -> Tensor:
        """R = Σ_h w_h·S_h for each video. Scores [B, H] → fp32 [B]."""
        if list(scores.heads) != list(self.names):
            raise ValueError(f"scores carry heads {scores.heads}, the run's reward heads are {list(self.names)}")
        return scores.values.float() @ self.vector()
