"""A comparison matrix: one base config, a shared budget, and named rows of dotted overrides.

    base: quickstart.yaml            # relative to the matrix file
    budget: [train.steps=20, ...]    # the same for every row (steps, groups, seeds, eval pairs)
    seeds: 3                         # runs per row, train.seed = 0 … seeds-1
    quick: {budget: [...], seeds: 1} # what --quick replaces
    rows:
      DanceGRPO: [sde.scheme=dance, kl.strategy=none]

Every row is validated (base + budget + row + a seed) before anything runs. A row may not touch
the budget keys: then it would not be the same budget.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.config import (
    ConfigError,
    RunConfig,
    apply_overrides,
    parse_override,
    read_yaml,
    validate,
)

# Keys that define the shared budget; a row that sets one is refused.
BUDGET_KEYS = ("train.steps", "train.groups_per_step", "sampler.group_size", "train.seed",
               "train.eval_prompts", "train.eval_seeds", "train.prompts", "schedule", "model",
               "rewards", "run", "pools")
TOP_KEYS = {"base", "budget", "seeds", "quick", "rows", "title"}


@dataclass
class Matrix:
    source: Path
    title: str
    base: dict[str, Any]          # the base config's data (budget not yet applied)
    budget: list[str]
    seeds: int
    rows: dict[str, list[str]]
    quick: dict[str, Any] = field(default_factory=dict)
    base_name: str = ""

    def for_mode(self, quick: bool, seeds: int | None = None) -> Matrix:
        """The matrix as it will run: --quick swaps in its budget and seeds; --seeds wins over both."""
        budget, n = self.budget, self.seeds
        if quick:
            # a quick entry replaces the budget entry with the same key
            merged = {item.split("=", 1)[0].strip(): item for item in [*budget, *self.quick.get("budget", [])]}
            budget = list(merged.values())
            n = self.quick.get("seeds", n)
        return Matrix(self.source, self.title, self.base, budget, seeds or n, self.rows, self.quick, self.base_name)

    def config(self, row: str, seed: int, extra: list[str] = ()) -> RunConfig:
        """The resolved config of one run; errors name the matrix file and the row."""
        import copy

        data = copy.deepcopy(self.base)
        try:
            data = apply_overrides(data, [*self.budget, *self.rows[row], f"train.seed={seed}", *extra])
        except ConfigError as e:
            raise ConfigError(f"{self.source}: row {row!r}: {e}") from None
        return validate(data, source=f"{self.source}: row {row!r}")

    def validate_all(self) -> None:
        for row in self.rows:
            self.config(row, 0)


def _str_list(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where}: expected a list of key.path=value strings")
    return list(value)


def _touches_budget(item: str) -> str | None:
    key = ".".join(parse_override(item)[0])
    for b in BUDGET_KEYS:
        if key == b or key.startswith(b + "."):
            return key
    return None


def load_matrix(path: str | Path) -> Matrix:
    """Read and check a matrix file; every row's config is validated here, before any run."""
    p = Path(path)
    data = read_yaml(p)
    unknown = sorted(set(data) - TOP_KEYS)
    if unknown:
        raise ConfigError(f"{p}: unknown key(s) {unknown}; expected {sorted(TOP_KEYS)}")
    if "base" not in data or not isinstance(data["base"], str):
        raise ConfigError(f"{p}: base: required, the path of the base config (relative to this file)")
    base_path = (p.parent / data["base"]) if not Path(data["base"]).is_absolute() else Path(data["base"])
    base = read_yaml(base_path)
    rows = data.get("rows")
    if not isinstance(rows, dict) or not rows:
        raise ConfigError(f"{p}: rows: required, a mapping of row name → list of overrides")
    parsed: dict[str, list[str]] = {}
    for name, items in rows.items():
        items = _str_list(items, f"{p}: row {name!r}")
        for item in items:
            try:
                hit = _touches_budget(item)
            except ConfigError as e:
                raise ConfigError(f"{p}: row {name!r}: {e}") from None
            if hit:
                raise ConfigError(f"{p}: row {name!r}: {hit} is part of the shared budget; "
                                  "set it in budget:, not in a row")
        parsed[str(name)] = items
    seeds = data.get("seeds", 1)
    if not isinstance(seeds, int) or seeds < 1:
        raise ConfigError(f"{p}: seeds = {seeds!r}: must be an integer ≥ 1")
    quick = data.get("quick") or {}
    if not isinstance(quick, dict) or set(quick) - {"budget", "seeds"}:
        raise ConfigError(f"{p}: quick: expected a mapping with budget and/or seeds")
    quick = {"budget": _str_list(quick.get("budget"), f"{p}: quick.budget"), "seeds": quick.get("seeds", seeds)}
    if not isinstance(quick["seeds"], int) or quick["seeds"] < 1:
        raise ConfigError(f"{p}: quick.seeds = {quick['seeds']!r}: must be an integer ≥ 1")
    m = Matrix(p, str(data.get("title", p.stem)), base, _str_list(data.get("budget"), f"{p}: budget"),
               seeds, parsed, quick, data["base"])
    m.validate_all()
    m.for_mode(quick=True).validate_all()
    return m
