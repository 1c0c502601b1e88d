"""The comparison's outputs: a markdown table of paired gains and a PNG of reward curves.

Inputs are plain records, so both writers run on synthetic data in tests:
- a run record: {"row", "seed", "heads", "before": {"values", "composite"}, "after": {...}, "wall_s"}
- per-run metrics rows as metrics.jsonl holds them ({"step", "reward_mean", "reward/<head>"}).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cluster.compare.stats import (
    BOOTSTRAP_RESAMPLES,
    RESOLUTION,
    CostRatio,
    claim_verdict,
    cost_ratio,
    paired_difference,
    run_gains,
    seeds_needed,
    verdict,
)
from cluster.evaluation.evaluate import EvalResult, paired


def gains(runs: list[dict[str, Any]]) -> dict[str, dict[str, tuple[float, float, int, bool]]]:
    """row → key → (mean gain, stderr, seeds, stderr_is_over_pairs).

    The gain of one run is its paired after − before mean on the fixed eval pairs. Over several
    seeds the stderr is over seeds; with one seed it falls back to the paired stderr over pairs.
    """
    by_row: dict[str, list[dict[str, float]]] = {}
    pair_se: dict[str, dict[str, float]] = {}
    for r in runs:
        heads = r["heads"]
        diffs = paired(EvalResult.from_record(r["before"], heads), EvalResult.from_record(r["after"], heads))
        by_row.setdefault(r["row"], []).append({d.key: d.diff for d in diffs})
        pair_se[r["row"]] = {d.key: d.se for d in diffs}
    out: dict[str, dict[str, tuple[float, float, int, bool]]] = {}
    for row, per_seed in by_row.items():
        out[row] = {}
        for key in per_seed[0]:
            x = np.array([s[key] for s in per_seed])
            if len(x) > 1:
                out[row][key] = (float(x.mean()), float(x.std(ddof=1) / math.sqrt(len(x))), len(x), False)
            else:
                out[row][key] = (float(x[0]), pair_se[row][key], 1, True)
    return out


def final_train_reward(metrics: list[dict[str, Any]], frac: float = 0.25) -> float:
    """Mean training composite reward over the last `frac` of a run's steps."""
    ys = [r["reward_mean"] for r in metrics if r.get("reward_mean") is not None]
    if not ys:
        return math.nan
    k = max(1, int(round(len(ys) * frac)))
    return float(np.mean(ys[-k:]))


def markdown_table(runs: list[dict[str, Any]], metrics: dict[str, list[list[dict[str, Any]]]],
                   rows_order: list[str], gpus: dict[str, float] | None = None) -> str:
    """Method × (composite, heads): mean ± stderr of the after − before gain; plus the
    before level, the training reward at the end, wall time per run and the cost columns
    (`costs`: rollout and learner seconds per run, composite gain per rollout-(GPU-)second)."""
    if not runs:
        return "_no finished runs_\n"
    heads = runs[0]["heads"]
    keys = ["composite", *heads]
    g = gains(runs)
    cost = costs(g, metrics, rows_order, gpus)
    unit = cost_unit(cost)
    before = EvalResult.from_record(runs[0]["before"], heads)
    head_line = ("| method | seeds | " + " | ".join(f"Δ {k}" for k in keys)
                 + f" | train R (last 25%) | s/run | rollout s | learner s | Δ composite / {unit} |")
    lines = [head_line, "|" + "---|" * (len(keys) + 7)]
    any_pairs = False
    for row in rows_order:
        if row not in g:
            continue
        cells = []
        for k in keys:
            m, se, n, over_pairs = g[row][k]
            any_pairs |= over_pairs
            cells.append(f"{m:+.3f} ± {se:.3f}{'†' if over_pairs else ''}")
        fin = [final_train_reward(ms) for ms in metrics.get(row, [])]
        wall = [r["wall_s"] for r in runs if r["row"] == row]
        c = cost[row]
        lines.append(f"| {row} | {g[row][keys[0]][2]} | " + " | ".join(cells)
                     + f" | {np.nanmean(fin) if fin else math.nan:.3f} | {np.mean(wall):.0f} | "
                     f"{c.rollout_s:.1f} | {c.learner_s:.1f} | {c.gain_per_rollout:+.5f} |")
    lvl = ", ".join(f"{k} {before.mean_se(k)[0]:.3f}" for k in keys)
    notes = [f"\nBefore training (every row starts from the same base, same pairs): {lvl}. "
             f"{len(before.composite)} fixed (prompt, seed) eval pairs, ODE sampling."]
    notes.append("Δ = after − before on those pairs, mean ± standard error over seeds.")
    if any_pairs:
        notes.append("† one seed: the ± is the paired standard error over the eval pairs, not over seeds.")
    notes.append(COST_NOTE.format(unit=unit))
    return "\n".join(lines) + "\n" + "\n".join(notes) + "\n"


# --- cost: rollout and learner seconds, measured in the same runs ------------------------------

COST_NOTE = ("rollout s / learner s: mean per run of the seconds the rollout actors spent generating "
             "(time/generate) and the learner spent on its steps (time/train), from each run's "
             "metrics.jsonl. Δ composite / {unit}: the row's mean composite gain over its mean "
             "rollout seconds (times the rollout actor's GPUs, when it has any).")


@dataclass(frozen=True)
class Cost:
    rollout_s: float          # mean over the row's runs of time/generate (actor-seconds)
    learner_s: float          # mean of time/train
    gpus: float               # GPUs per rollout actor (0 on CPU)
    gain: float               # mean composite gain (after − before)

    @property
    def rollout_units(self) -> float:
        """Rollout-GPU-seconds (rollout seconds on CPU)."""
        return self.rollout_s * (self.gpus if self.gpus > 0 else 1.0)

    @property
    def gain_per_rollout(self) -> float:
        return self.gain / self.rollout_units if self.rollout_units > 0 else math.nan

    def to_dict(self) -> dict[str, float]:
        return {"rollout_s": self.rollout_s, "learner_s": self.learner_s, "rollout_gpus": self.gpus,
                "gain": self.gain, "gain_per_rollout": self.gain_per_rollout}


def run_seconds(metrics: list[dict[str, Any]]) -> tuple[float, float]:
    """(rollout s, learner s) of one run: its last row's cumulative time/generate and time/train."""
    last = metrics[-1] if metrics else {}
    return float(last.get("time/generate", math.nan)), float(last.get("time/train", math.nan))


def costs(g: dict[str, dict[str, tuple]], metrics: dict[str, list[list[dict[str, Any]]]], rows_order: list[str],
          gpus: dict[str, float] | None = None) -> dict[str, Cost]:
    """row → Cost, from the gains `g` (see `gains`) and the rows' per-run metrics."""
    out = {}
    for row in rows_order:
        if row not in g:
            continue
        secs = [run_seconds(ms) for ms in metrics.get(row, [])] or [(math.nan, math.nan)]
        out[row] = Cost(float(np.mean([s[0] for s in secs])), float(np.mean([s[1] for s in secs])),
                        float((gpus or {}).get(row, 0.0)), g[row]["composite"][0])
    return out


def cost_unit(cost: dict[str, Cost]) -> str:
    return "rollout-GPU-s" if cost and all(c.gpus > 0 for c in cost.values()) else "rollout-s"


def run_units(runs: list[dict[str, Any]], metrics: dict[str, list[list[dict[str, Any]]]],
              gpus: dict[str, float] | None = None) -> dict[tuple[str, int], float]:
    """(row, train.seed) → that run's rollout units: its rollout seconds, times the rollout actor's
    GPUs when it has any. metrics[row] lists the row's runs' metrics in the order `runs` lists the
    row's runs (run_matrix returns both in plan order)."""
    out = {}
    for row, per_run in metrics.items():
        seeds = [r["seed"] for r in runs if r["row"] == row]
        if len(seeds) != len(per_run):
            raise ValueError(f"row {row!r}: {len(seeds)} run record(s) but {len(per_run)} metrics file(s); "
                             "each run needs both, in the same order")
        g = float((gpus or {}).get(row, 0.0))
        for s, ms in zip(seeds, per_run, strict=True):
            out[(row, s)] = run_seconds(ms)[0] * (g if g > 0 else 1.0)
    return out


def cost_ratios(runs: list[dict[str, Any]], metrics: dict[str, list[list[dict[str, Any]]]], rows_order: list[str],
                reference: str | None, gpus: dict[str, float] | None = None) -> dict[str, CostRatio]:
    """row → its gain per rollout unit over the reference's, each pair on exactly the seeds both
    ran (`stats.cost_ratio`); rows that share no seed with the reference are left out."""
    if reference is None or not runs:
        return {}
    units = run_units(runs, metrics, gpus)
    gain = {(r["row"], r["seed"]): run_gains(r)["composite"] for r in runs}

    def of(row: str) -> tuple[dict[int, float], dict[int, float]]:
        return ({s: v for (rw, s), v in gain.items() if rw == row},
                {s: v for (rw, s), v in units.items() if rw == row})

    out = {}
    for row in rows_order:
        c = cost_ratio(*of(row), *of(reference))
        if c is not None:
            out[row] = c
    return out


def _times(x: float) -> str:
    return "∞" if math.isinf(x) else f"{x:.2f}×"


def _ratio_cell(c: CostRatio | None) -> str:
    if c is None or math.isnan(c.ratio):
        return "—"
    if math.isnan(c.low):
        return f"{_times(c.ratio)} (1 seed)"
    return f"{_times(c.ratio)} [{_times(c.low)}, {_times(c.high)}]"


def ranking_section(cost: dict[str, Cost], reference: str | None, ratios: dict[str, CostRatio]) -> str:
    """Rows ranked by composite gain per rollout-(GPU-)second, each against the reference's on the
    seeds both ran (`ratios`, from `cost_ratios`), with the seed count of each ratio."""
    if not cost:
        return ""
    unit = cost_unit(cost)
    ref = reference or "reference"
    ranked = sorted(cost, key=lambda r: -cost[r].gain_per_rollout if math.isfinite(cost[r].gain_per_rollout)
                    else math.inf)
    lines = [f"## Ranking by gain per {unit}\n", f"| rank | method | Δ composite / {unit} | rollout s | "
             f"learner s | seeds with {ref} | × {ref} [95% interval] |", "|---|---|---|---|---|---|---|"]
    for i, row in enumerate(ranked, 1):
        c, r = cost[row], ratios.get(row)
        cell = "1 (the reference)" if row == reference else _ratio_cell(r)
        lines.append(f"| {i} | {row} | {c.gain_per_rollout:+.5f} | {c.rollout_s:.1f} | {c.learner_s:.1f} | "
                     f"{r.n if r is not None else 0} | {cell} |")
    lines.append(
        f"\nΔ composite / {unit}: the row's own mean gain over its own mean rollout seconds, on every seed it ran "
        f"(the table above). × {ref}: the same quotient, the row's over {ref}'s, both taken on exactly the seeds "
        f"the two rows ran (`seeds with {ref}`), so no ratio mixes seed sets; [95% paired bootstrap interval: "
        f"those seeds resampled with replacement {BOOTSTRAP_RESAMPLES} times, the same draw for both rows, "
        f"seeded]. A resample in which {ref} gains nothing counts as ∞. Given only when both rows' gains on "
        "those seeds are positive (a ratio of a loss means nothing); whether two rows differ at all is the "
        "paired table's question.")
    return "\n".join(lines) + "\n"


def mean_curve(runs_metrics: list[list[dict[str, Any]]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """Mean over seeds of `key` per step (steps every seed reached)."""
    per = [{r["step"]: r[key] for r in ms if r.get(key) is not None} for ms in runs_metrics]
    steps = sorted(set.intersection(*(set(p) for p in per))) if per else []
    return np.array(steps), np.array([np.mean([p[s] for p in per]) for s in steps])


def plot_curves(metrics: dict[str, list[list[dict[str, Any]]]], heads: list[str], path: Path,
                title: str = "") -> Path:
    """One panel per reward (composite, then heads); a line per method, mean over seeds, smoothed."""
    import matplotlib  # heavy: matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy: matplotlib

    keys = [("reward_mean", "composite")] + [(f"reward/{h}", h) for h in heads]
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.8), squeeze=False)
    for ax, (key, label) in zip(axes[0], keys, strict=True):
        for row, runs_metrics in metrics.items():
            xs, ys = mean_curve(runs_metrics, key)
            if len(xs) == 0:
                continue
            w = max(1, len(ys) // 8)
            smooth = np.convolve(ys, np.ones(w) / w, mode="valid")
            ax.plot(xs[w - 1:], smooth, lw=1.6, label=row)
        ax.set_title(label)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("training reward (mean over seeds)")
    if axes[0][0].lines:
        axes[0][0].legend(fontsize=7, loc="best")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


# --- paired differences and claims (cluster/compare/stats.py) ---------------------------------

def _ci(p) -> str:
    if p.n < 2:
        return f"{p.mean:+.3f} (1 seed)"
    return f"{p.mean:+.3f} [{p.low:+.3f}, {p.high:+.3f}]"


def paired_rows(runs: list[dict[str, Any]], reference: str, rows_order: list[str]) -> dict[str, dict[str, Any]]:
    """row → key → Paired (row − reference on the same seeds and pairs), rows that share a seed with it."""
    if not runs:
        return {}
    keys = ["composite", *runs[0]["heads"]]
    out = {}
    for row in rows_order:
        if row == reference:
            continue
        per_key = {k: paired_difference(runs, row, reference, k) for k in keys}
        if per_key["composite"] is not None:
            out[row] = per_key
    return out


def paired_table(runs: list[dict[str, Any]], reference: str | None, rows_order: list[str]) -> str:
    """Row − reference: mean and 95% Student-t interval over seeds, composite and each head, and
    whether the composite interval is narrow enough to separate an effect of RESOLUTION."""
    if reference is None:
        return ""
    title = f"## Paired difference vs {reference}\n"
    table = paired_rows(runs, reference, rows_order)
    if not table:
        return title + f"\n_no row shares a finished seed with {reference}_\n"
    keys = ["composite", *runs[0]["heads"]]
    lines = ["| method | seeds | " + " | ".join(f"Δ {k} − ref" for k in keys) + " | CI half-width (composite) |",
             "|" + "---|" * (len(keys) + 3)]
    for row, per_key in table.items():
        c = per_key["composite"]
        hw = "—" if c.n < 2 else f"{c.half_width:.3f} {'≤' if c.half_width <= RESOLUTION else '>'} {RESOLUTION}"
        lines.append(f"| {row} | {c.n} | " + " | ".join(_ci(per_key[k]) for k in keys) + f" | {hw} |")
    widths = [pk["composite"].half_width for pk in table.values() if pk["composite"].n >= 2]
    if not widths:
        res = "With one seed per row there is no interval: run at least 2 seeds to resolve anything."
    elif max(widths) <= RESOLUTION:
        res = (f"Resolution: every composite interval's half-width is ≤ {RESOLUTION} (largest {max(widths):.3f}), "
               f"so an effect of {RESOLUTION} composite is resolved.")
    else:
        n_ok = sum(w <= RESOLUTION for w in widths)
        widest = max(table, key=lambda r: table[r]["composite"].half_width if table[r]["composite"].n >= 2 else -1)
        w = table[widest]["composite"]
        need = seeds_needed(w.sd)
        res = (f"Resolution: {n_ok} of {len(widths)} composite intervals have half-width ≤ {RESOLUTION} "
               f"(largest {max(widths):.3f}); an effect of {RESOLUTION} composite is not resolved in every "
               f"row. At the spread measured here the widest row ({widest}) would need "
               f"{f'about {need} seeds' if need else 'more than 1000 seeds'}; more eval pairs per seed "
               "also narrow it.")
    notes = [f"\nEach cell: mean over seeds of (row's gain − {reference}'s gain on the same train.seed and the "
             "same eval pairs) [95% Student-t interval, n − 1 degrees of freedom].", res]
    return title + "\n" + "\n".join(lines) + "\n" + "\n".join(notes) + "\n"


def _claim_line(better: str, worse: str, p, v: str) -> str:
    if p is None:
        return f"{better} − {worse}: not run"
    return f"{better} − {worse} = {_ci(p)}, {p.n} seed{'s' if p.n != 1 else ''}: {v}"


def claims_section(runs: list[dict[str, Any]], claims) -> tuple[str, list[dict[str, Any]]]:
    """'Which claims reproduce': per claim the paired composite difference better − worse and a
    verdict; with the same numbers as plain data for compare.json."""
    if not claims:
        return "", []
    lines, data = ["## Which claims reproduce\n"], []
    for c in claims:
        parts = []
        for w in c.worse:
            p = paired_difference(runs, c.better, w, "composite") if runs else None
            parts.append((w, p, verdict(p)))
        overall = claim_verdict([v for _, _, v in parts])
        data.append({"claim": c.claim, "better": c.better, "worse": list(c.worse), "verdict": overall,
                     "comparisons": [{"worse": w, "verdict": v, **(p.to_dict() if p else {})} for w, p, v in parts]})
        if len(parts) == 1:
            lines.append(f"- **{c.claim}**: {overall}. {_claim_line(c.better, *parts[0])}.")
        else:
            lines.append(f"- **{c.claim}**: {overall}.")
            lines += [f"  - {_claim_line(c.better, *part)}." for part in parts]
    lines.append(
        "\nEach difference is the composite gain of the first row minus the second's on the same "
        "train.seed and eval pairs, mean [95% Student-t interval] over seeds. Reproduces: the interval "
        "lies above 0. Contradicted: it lies below 0. Not resolved: it contains 0, so this budget cannot "
        "tell the two apart. A claim against several rows reproduces only if it does against each and is "
        "contradicted if it is against any. A claim of \"at least as good\" is judged by the same rule: "
        "not resolved means no difference was found at this resolution, which is consistent with the "
        "claim but does not prove it; contradicted refutes it.")
    return "\n".join(lines) + "\n", data
