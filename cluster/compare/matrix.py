"""A comparison matrix: one base config, a shared budget, and named rows of dotted overrides.

    base: quickstart.yaml            # relative to the matrix file
    budget: [train.steps=20, ...]    # the same for every row (steps, groups, seeds, eval pairs)
    seeds: 3                         # runs per row, train.seed = 0 … seeds-1
    most_seeds: 24                   # optional second stage: a row whose paired interval is wider
                                     # than ±0.02 runs the seeds its spread says, up to this many
    quick: {budget: [...], seeds: 1} # what --quick replaces
    parallel: 2                      # (row, seed) runs at once (default 1; --parallel wins)
    reference: DanceGRPO             # every other row's paired difference is against this row
    rows:
      DanceGRPO: [sde.scheme=dance, kl.strategy=none]
      SAGE: [sde.scheme=sage, kl.strategy=dual]
    claims:                          # judged on the paired composite difference better − worse
      - {claim: "SAGE beats DanceGRPO", better: SAGE, worse: DanceGRPO}   # worse may be a list

Every row is validated (base + budget + row + a seed) before anything runs. A row may not touch
the budget keys: then it would not be the same budget.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
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
from common.methods import KL_STRATEGIES

# Keys that define the shared budget; a row that sets one is refused.
BUDGET_KEYS = ("train.steps", "train.groups_per_step", "sampler.group_size", "train.seed",
               "train.eval_prompts", "train.eval_seeds", "train.prompts", "schedule", "model",
               "rewards", "run", "pools")
TOP_KEYS = {"base", "budget", "seeds", "most_seeds", "quick", "rows", "title", "parallel", "reference", "claims"}
CLAIM_KEYS = {"claim", "better", "worse"}


@dataclass(frozen=True)
class Claim:
    """A paper's claim: row `better` beats each row in `worse` on the composite gain."""

    claim: str
    better: str
    worse: tuple[str, ...]


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
    parallel: int = 1             # (row, seed) runs in flight at once
    reference: str | None = None  # the row every paired difference is taken against
    claims: list[Claim] = field(default_factory=list)
    most_seeds: int = 0           # second stage's cap; ≤ seeds: no second stage

    def for_mode(self, quick: bool, seeds: int | None = None) -> Matrix:
        """The matrix as it will run: --quick swaps in its budget and seeds and has no second stage;
        --seeds wins over both (and over most_seeds when larger)."""
        budget, n, most = self.budget, self.seeds, self.most_seeds
        if quick:
            # a quick entry replaces the budget entry with the same key
            merged = {item.split("=", 1)[0].strip(): item for item in [*budget, *self.quick.get("budget", [])]}
            budget = list(merged.values())
            n = self.quick.get("seeds", n)
            most = 0
        n = seeds or n
        return replace(self, budget=budget, seeds=n, most_seeds=max(most, n))

    def pairs(self) -> list[tuple[str, str]]:
        """The paired differences the report judges: each row − the reference, and each claim's
        better − worse."""
        out = [(r, self.reference) for r in self.rows if self.reference and r != self.reference]
        out += [(c.better, w) for c in self.claims for w in c.worse]
        return list(dict.fromkeys(out))

    def config(self, row: str, seed: int, extra: list[str] = ()) -> RunConfig:
        """The resolved config of one run; errors name the matrix file and the row."""
        data = copy.deepcopy(self.base)
        try:
            data = apply_overrides(data, [*self.budget, *self.rows[row], f"train.seed={seed}", *extra])
        except ConfigError as e:
            raise ConfigError(f"{self.source}: row {row!r}: {e}") from None
        return validate(data, source=f"{self.source}: row {row!r}")

    def validate_all(self) -> None:
        for row in self.rows:
            self.config(row, 0)

    def warnings(self) -> list[str]:
        """Rows that would not measure what their name says at this budget (printed, not refused:
        a plumbing test may run a dual row for two steps)."""
        out = []
        for row in self.rows:
            cfg = self.config(row, 0)
            # a moving anchor that never refreshes within the budget is the fixed anchor by construction
            if KL_STRATEGIES[cfg.kl.strategy].anchor == "moving" and cfg.train.steps <= cfg.kl.anchor_period:
                out.append(f"row {row!r}: kl.strategy={cfg.kl.strategy} refreshes its anchor every "
                           f"{cfg.kl.anchor_period} steps but the budget trains {cfg.train.steps}, so the anchor "
                           "never moves and the row equals a fixed KL; set kl.anchor_period below "
                           "train.steps in the budget")
        return out


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


def _claims(value: Any, rows: dict[str, list[str]], p: Path) -> list[Claim]:
    """The claims: list; each names rows of this matrix (`worse` a row or a list of rows)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise ConfigError(f"{p}: claims: expected a list of {{claim, better, worse}} entries")
    out = []
    for i, item in enumerate(value):
        name = item.get("claim") if isinstance(item, dict) else None
        where = f"{p}: claim {name!r}" if isinstance(name, str) else f"{p}: claims[{i}]"
        if not isinstance(item, dict) or set(item) != CLAIM_KEYS:
            raise ConfigError(f"{where}: expected exactly the keys claim, better, worse "
                              f"(worse: a row or a list of rows), got {item!r}")
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(f"{where}: claim: the claim in words, a non-empty string")
        better, worse = item["better"], item["worse"]
        worse = [worse] if isinstance(worse, str) else worse
        if not isinstance(better, str) or not isinstance(worse, list) or not worse \
                or not all(isinstance(w, str) for w in worse):
            raise ConfigError(f"{where}: better must be a row name and worse a row name or a non-empty list of them")
        for r in [better, *worse]:
            if r not in rows:
                raise ConfigError(f"{where}: unknown row {r!r}; the matrix has {list(rows)}")
        if better in worse:
            raise ConfigError(f"{where}: row {better!r} is both better and worse")
        out.append(Claim(name, better, tuple(worse)))
    return out


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
    most = data.get("most_seeds", seeds)
    if not isinstance(most, int) or isinstance(most, bool) or most < seeds:
        raise ConfigError(f"{p}: most_seeds = {most!r}: must be an integer ≥ seeds ({seeds}), the most "
                          "seeds a row may run when its interval asks for more")
    parallel = data.get("parallel", 1)
    if not isinstance(parallel, int) or isinstance(parallel, bool) or parallel < 1:
        raise ConfigError(f"{p}: parallel = {parallel!r}: must be an integer ≥ 1 (runs in flight at once)")
    reference = data.get("reference")
    if reference is not None and reference not in parsed:
        raise ConfigError(f"{p}: reference = {reference!r} is not a row; the matrix has {list(parsed)}")
    m = Matrix(p, str(data.get("title", p.stem)), base, _str_list(data.get("budget"), f"{p}: budget"),
               seeds, parsed, quick, data["base"], parallel, reference, _claims(data.get("claims"), parsed, p), most)
    m.validate_all()
    m.for_mode(quick=True).validate_all()
    return m
