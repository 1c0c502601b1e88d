"""`vgrpo eval RUN --curve`: the base and every kept checkpoint on the same fixed pairs.

Long runs ask "does a head keep rising, or does it fall?" at more than one point. Each checkpoint
is ODE-sampled on the run's evaluation pairs and compared, pair by pair, with the base model on
the same pairs; the result is one row per step of paired gains (mean ± standard error) per head.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from rich.progress import track

from cluster.evaluation.evaluate import EvalResult, paired
from cluster.runs.policy_file import policy_checkpoints
from common.config import ConfigError, load_config


def checkpoints(run: Path) -> list[Path]:
    return policy_checkpoints(run)


def step_of(ckpt: Path) -> int:
    return int(ckpt.name.split("_")[-1])


def curve_rows(before: EvalResult, afters: list[tuple[int, EvalResult]]) -> list[dict[str, Any]]:
    """One row per step: {"step", key: {"gain", "se", "z", "after"}} for the composite and each head."""
    rows = []
    for step, after in afters:
        row: dict[str, Any] = {"step": step}
        for d in paired(before, after):
            row[d.key] = {"gain": d.diff, "se": d.se, "z": d.z, "after": d.after}
        rows.append(row)
    return rows


def markdown(before: EvalResult, rows: list[dict[str, Any]]) -> str:
    keys = ["composite", *before.heads]
    lvl = ", ".join(f"{k} {before.mean_se(k)[0]:.3f}" for k in keys)
    out = ["| step | " + " | ".join(f"Δ {k}" for k in keys) + " |", "|" + "---|" * (len(keys) + 1)]
    for r in rows:
        out.append(f"| {r['step']} | " + " | ".join(
            f"{r[k]['gain']:+.3f} ± {r[k]['se']:.3f} (z {r[k]['z']:.1f})" for k in keys) + " |")
    return (f"Base on {len(before.composite)} fixed (prompt, seed) pairs, ODE: {lvl}. "
            "Δ = checkpoint − base on the same pairs, ± paired standard error.\n\n" + "\n".join(out) + "\n")


def plot(before: EvalResult, rows: list[dict[str, Any]], path: Path, title: str = "") -> Path:
    import matplotlib  # heavy: matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy: matplotlib

    keys = ["composite", *before.heads]
    fig, axes = plt.subplots(1, len(keys), figsize=(3.6 * len(keys), 3.4), squeeze=False)
    steps = np.array([0] + [r["step"] for r in rows])
    for ax, k in zip(axes[0], keys, strict=True):
        g = np.array([0.0] + [r[k]["gain"] for r in rows])
        se = np.array([0.0] + [r[k]["se"] for r in rows])
        ax.errorbar(steps, g, yerr=2 * se, marker="o", ms=3, capsize=2)
        ax.axhline(0.0, color="grey", lw=0.8)
        ax.set_title(f"Δ {k} (±2 SE)")
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def run_curve(run: Path, seeds: int | None, out: Path, evaluate) -> tuple[str, Path]:
    """Evaluate the base and each checkpoint of `run` with `evaluate(cfg, ckpt_or_None, seeds)`
    → EvalResult; write curve.json, curve.md and curve.png under `out`."""
    ckpts = checkpoints(run)
    if not ckpts:
        raise ConfigError(f"{run}: no checkpoint under {run / 'checkpoints'} (train.checkpoint_every, "
                          "train.keep_checkpoints keep them)")
    cfg = load_config(run / "config.yaml")

    before = evaluate(cfg, None, seeds)
    afters = [(step_of(c), evaluate(cfg, c, seeds))
              for c in track(ckpts, description=f"evaluating {len(ckpts)} checkpoints")]
    rows = curve_rows(before, afters)
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(before, rows)
    (out / "curve.md").write_text(f"# {run.name}: held-out gains per checkpoint\n\n{text}", encoding="utf-8")
    (out / "curve.json").write_text(json.dumps({"run": str(run), "pairs": int(len(before.composite)),
                                                "base": before.to_dict(), "rows": rows}, indent=2))
    png = plot(before, rows, out / "curve.png", title=f"{run.name}: held-out gain over training")
    return text, png
