"""The comparison's outputs: a markdown table of paired gains and a PNG of reward curves.

Inputs are plain records, so both writers run on synthetic data in tests:
- a run record: {"row", "seed", "heads", "before": {"values", "composite"}, "after": {...}, "wall_s"}
- per-run metrics rows as metrics.jsonl holds them ({"step", "reward_mean", "reward/<head>"}).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from cluster.evaluate import EvalResult, paired


def eval_from_dict(d: dict[str, Any], heads: list[str]) -> EvalResult:
    return EvalResult(list(heads), np.asarray(d["values"], dtype=np.float64).reshape(-1, len(heads)),
                      np.asarray(d["composite"], dtype=np.float64))


def eval_to_dict(r: EvalResult) -> dict[str, Any]:
    return {"values": r.values.tolist(), "composite": r.composite.tolist()}


def gains(runs: list[dict[str, Any]]) -> dict[str, dict[str, tuple[float, float, int, bool]]]:
    """row → key → (mean gain, stderr, seeds, stderr_is_over_pairs).

    The gain of one run is its paired after − before mean on the fixed eval pairs. Over several
    seeds the stderr is over seeds; with one seed it falls back to the paired stderr over pairs.
    """
    by_row: dict[str, list[dict[str, float]]] = {}
    pair_se: dict[str, dict[str, float]] = {}
    for r in runs:
        heads = r["heads"]
        diffs = paired(eval_from_dict(r["before"], heads), eval_from_dict(r["after"], heads))
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
                   rows_order: list[str]) -> str:
    """Method × (composite, heads): mean ± stderr of the after − before gain; plus the
    before level, the training reward at the end, and wall time per run."""
    if not runs:
        return "_no finished runs_\n"
    heads = runs[0]["heads"]
    keys = ["composite", *heads]
    g = gains(runs)
    before = eval_from_dict(runs[0]["before"], heads)
    head_line = "| method | seeds | " + " | ".join(f"Δ {k}" for k in keys) + " | train R (last 25%) | s/run |"
    lines = [head_line, "|" + "---|" * (len(keys) + 4)]
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
        lines.append(f"| {row} | {g[row][keys[0]][2]} | " + " | ".join(cells)
                     + f" | {np.nanmean(fin) if fin else math.nan:.3f} | {np.mean(wall):.0f} |")
    lvl = ", ".join(f"{k} {before.mean_se(k)[0]:.3f}" for k in keys)
    notes = [f"\nBefore training (every row starts from the same base, same pairs): {lvl}. "
             f"{len(before.composite)} fixed (prompt, seed) eval pairs, ODE sampling."]
    notes.append("Δ = after − before on those pairs, mean ± standard error over seeds.")
    if any_pairs:
        notes.append("† one seed: the ± is the paired standard error over the eval pairs, not over seeds.")
    return "\n".join(lines) + "\n" + "\n".join(notes) + "\n"


def mean_curve(runs_metrics: list[list[dict[str, Any]]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """Mean over seeds of `key` per step (steps every seed reached)."""
    per = [{r["step"]: r[key] for r in ms if r.get(key) is not None} for ms in runs_metrics]
    steps = sorted(set.intersection(*(set(p) for p in per))) if per else []
    return np.array(steps), np.array([np.mean([p[s] for p in per]) for s in steps])


def plot_curves(metrics: dict[str, list[list[dict[str, Any]]]], heads: list[str], path: Path,
                title: str = "") -> Path:
    """One panel per reward (composite, then heads); a line per method, mean over seeds, smoothed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
