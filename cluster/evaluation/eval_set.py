"""The fixed evaluation pairs: every prompt of an evaluation set with each of the fixed
evaluation seeds, in one order (prompt-major, seeds inner), each pair with its full condition
(I2V: its first frame, by path).

Every evaluation samples from one: the before/after evaluation (`Driver.evaluate`), the held-out
health checks, the tracker's step videos, `vgrpo eval` and its curve. Each sample depends only
on its own (condition, seed), so a subset or a split over rollout actors gives the same videos.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cluster.data.manifests import check_task
from cluster.data.prompts import load_prompts
from cluster.data.text import condition_id
from common.config import DataConfig, ModelConfig
from common.toyworld import eval_seeds
from common.types import Condition


@dataclass(frozen=True)
class EvalSet:
    conditions: tuple[Condition, ...]   # each pair's condition: prompt (and first frame)
    seeds: tuple[int, ...]              # each pair's seed
    per_prompt: int = 1                 # seeds per prompt: pair i is prompt i // per_prompt's

    @classmethod
    def load(cls, spec: str, seeds: int, model: ModelConfig, limits: DataConfig | None = None) -> EvalSet:
        """The prompt set `spec` (checked against model.task) × the first `seeds` fixed seeds; a
        file is read within `limits` (the run's data section)."""
        conds = load_prompts(spec, limits)
        check_task(conds, model.task, spec)
        fixed = eval_seeds(seeds)
        return cls(tuple(c for c in conds for _ in fixed), tuple(s for _ in conds for s in fixed), len(fixed))

    @classmethod
    def of_pairs(cls, pairs: Sequence[tuple[str, int]], images: Sequence[str] | None = None) -> EvalSet:
        """A hand-made list of (prompt, seed) pairs (with a first-frame path each, for I2V)."""
        paths = [None] * len(pairs) if images is None else list(images)
        return cls(tuple(Condition(condition_id(p), p, image_path=i) for (p, _), i in zip(pairs, paths, strict=True)),
                   tuple(s for _, s in pairs))

    def __post_init__(self) -> None:
        if len(self.conditions) != len(self.seeds) or len(self.seeds) % self.per_prompt:
            raise ValueError(f"{len(self.conditions)} conditions and {len(self.seeds)} seeds do not make "
                             f"pairs of {self.per_prompt} seeds per prompt")

    def __len__(self) -> int:
        return len(self.seeds)

    @property
    def pairs(self) -> list[tuple[str, int]]:
        return [(c.prompt, s) for c, s in zip(self.conditions, self.seeds, strict=True)]

    @property
    def prompts(self) -> list[str]:
        """Each pair's prompt."""
        return [c.prompt for c in self.conditions]

    @property
    def images(self) -> list[str] | None:
        """Each pair's first-frame path (read by whoever samples it), or None for text-to-video."""
        return [c.image_path for c in self.conditions] if self.conditions and self.conditions[0].is_i2v else None

    @property
    def prompt_conditions(self) -> list[Condition]:
        """One condition per prompt, in order."""
        return list(self.conditions[::self.per_prompt])

    def firsts(self, n: int | None = None) -> list[int]:
        """The pairs of the first seed of each of the first `n` prompts (all by default)."""
        return list(range(0, len(self), self.per_prompt))[:n]

    def grid(self, limit: int) -> list[int]:
        """The pairs a short grid video shows, in its order, at most `limit`: the first seed of
        every prompt first, so it shows every prompt."""
        return grid_pairs(len(self), self.per_prompt, limit)

    def subset(self, indices: Sequence[int]) -> EvalSet:
        """These pairs, in this order (a flat list: one seed per prompt)."""
        return EvalSet(tuple(self.conditions[i] for i in indices), tuple(self.seeds[i] for i in indices))


def grid_pairs(n: int, seeds: int, limit: int) -> list[int]:
    """Which of an evaluation's n videos (prompt-major, `seeds` per prompt) its tiled grid video
    shows, in order, at most `limit`: the first seed of every prompt first."""
    return [p * seeds + s for s in range(seeds) for p in range(n // seeds)][:limit]
