"""`vgrpo compare`: run a matrix of methods with one budget, then table their paired gains.

Runs go one after another in this process against one Ray cluster; each is a Driver with its
own run directory under --out (OUT/<row>/seed<k>), evaluated before and after on the fixed
(prompt, seed) pairs. A finished run (compare_run.json next to an identical config.yaml) is
reused, so an interrupted comparison continues where it stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import time
from pathlib import Path
from typing import Any

RUN_RECORD = "compare_run.json"


def register(sub) -> None:
    p = sub.add_parser(
        "compare", help="compare methods (or an ablation) on the toy world with one budget",
        description="Run every row of a matrix file (configs/compare_toy.yaml, configs/ablate_*.yaml) "
        "for several seeds with the same budget, evaluate each run before and after training on the "
        "fixed (prompt, seed) pairs, and write OUT/compare.md (method × reward heads: mean ± stderr "
        "over seeds of the after − before gain) and OUT/curves.png (training reward, mean over seeds). "
        "--quick replaces the budget with the matrix's quick: section (fewer steps, seeds and eval "
        "pairs).", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("-c", "--config", required=True, help="a matrix file, e.g. configs/compare_toy.yaml")
    p.add_argument("--quick", action="store_true", help="use the matrix's quick budget (about 10 min)")
    p.add_argument("--seeds", type=int, default=None, help="seeds per row (overrides the matrix)")
    p.add_argument("--out", default=None, help="output directory (default: runs/compare-<matrix name>[-quick])")
    p.add_argument("--rows", default=None, help="comma-separated subset of row names to run")
    p.set_defaults(func=cmd_compare)


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "row"


def machine() -> str:
    return (f"{platform.node()}: {platform.machine()}, {os.cpu_count()} cores, "
            f"Python {platform.python_version()}")


def _before_key(cfg) -> str:
    # the before-evaluation depends only on the base model, the schedule, the eval set and the rewards
    d = cfg.model_dump(mode="json")
    return json.dumps([d["model"], d["schedule"], d["rewards"], d["train"]["eval_prompts"],
                       d["train"]["eval_seeds"]], sort_keys=True)


def run_one(cfg, before_cache: dict[str, Any], note=print) -> dict[str, Any] | None:
    """Train one run with a Driver; its record, or None when it was interrupted."""
    from cluster.compare_report import eval_from_dict, eval_to_dict
    from cluster.driver import Driver
    from cluster.run_dir import RunDir

    run_dir = RunDir.create(cfg)
    driver = Driver(cfg, run_dir)
    t0 = time.monotonic()
    try:
        driver.setup()
        key = _before_key(cfg)
        if key in before_cache:
            before = before_cache[key]
        else:
            before = before_cache[key] = driver.evaluate("before", gifs=0)
        driver.run()
        if driver.stop_requested.is_set() and driver.step < cfg.train.steps:
            return None
        after = driver.evaluate("after", gifs=1)
    finally:
        driver.teardown()
    heads = list(after.heads)
    record = {"row": None, "seed": cfg.train.seed, "heads": heads, "steps": driver.step,
              "before": eval_to_dict(before), "after": eval_to_dict(after),
              "wall_s": round(time.monotonic() - t0, 1)}
    eval_from_dict(record["before"], heads)  # the record reads back as it will be read
    return record


def run_matrix(matrix, out: Path, rows: list[str] | None = None, note=print,
               share_before: bool = True) -> dict[str, Any]:
    """Every (row, seed) of `matrix` in turn; returns {"runs", "metrics", "failed", "interrupted"}.

    The before-evaluation is the base policy on the fixed pairs with ODE sampling, the same for
    every row; with `share_before` it is measured once and reused.
    """
    from cluster.pools import init_ray
    from cluster.run_dir import RunDir
    from common.config import save_config

    rows = rows or list(matrix.rows)
    plan = [(row, s) for row in rows for s in range(matrix.seeds)]
    cfgs = {(row, s): matrix.config(row, s, [f"run.root={out / slug(row)}", f"run.name=seed{s}"])
            for row, s in plan}
    handle = init_ray(cfgs[plan[0]])  # one cluster for every run; a Driver leaves it running
    runs, metrics, failed = [], {}, {}
    before_cache: dict[str, Any] = {}
    interrupted = False
    try:
        for i, (row, s) in enumerate(plan):
            cfg = cfgs[(row, s)]
            path = Path(cfg.run.root) / cfg.run.name
            rec_file = path / RUN_RECORD
            if rec_file.is_file() and _same_config(cfg, path, save_config):
                rec = json.loads(rec_file.read_text())
                note(f"[{i + 1}/{len(plan)}] {row} seed {s}: reusing {path}")
            else:
                if path.exists():
                    import shutil

                    shutil.rmtree(path)  # a half-finished or differently configured run: start over
                note(f"[{i + 1}/{len(plan)}] {row} seed {s}: training {cfg.train.steps} steps → {path}")
                try:
                    rec = run_one(cfg, before_cache if share_before else {}, note)
                except Exception as e:  # one failed run does not lose the others
                    failed[f"{row} seed {s}"] = f"{type(e).__name__}: {e}"
                    note(f"  failed: {type(e).__name__}: {e}")
                    continue
                if rec is None:
                    interrupted = True
                    note("interrupted: writing the table of the finished runs")
                    break
                rec["row"] = row
                rec_file.write_text(json.dumps(rec))
                d = rec["after"]["composite"]
                note(f"  done in {rec['wall_s']:.0f}s; after: composite {sum(d) / len(d):.3f}")
            runs.append(rec)
            metrics.setdefault(row, []).append(RunDir(path).read_metrics())
    finally:
        handle.shutdown()
    return {"runs": runs, "metrics": metrics, "failed": failed, "interrupted": interrupted}


def _same_config(cfg, path: Path, save_config) -> bool:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        save_config(cfg, Path(d) / "c.yaml")
        want = (Path(d) / "c.yaml").read_text()
    have = path / "config.yaml"
    return have.is_file() and have.read_text() == want


def write_report(matrix, result: dict[str, Any], out: Path, command: str, elapsed_s: float) -> Path:
    from cluster.compare_report import gains, markdown_table, plot_curves

    rows = [r for r in matrix.rows if r in result["metrics"]]
    heads = result["runs"][0]["heads"] if result["runs"] else []
    curves = plot_curves({r: result["metrics"][r] for r in rows}, heads, out / "curves.png",
                         title=f"{matrix.title}: training reward, mean over seeds") if rows else None
    budget = ", ".join(f"`{b}`" for b in matrix.budget) or "the base config's"
    text = [f"# {matrix.title}\n",
            f"Command: `{command}`  ",
            f"Matrix: `{matrix.source}` (base `{matrix.base_name}`); budget: {budget}; "
            f"{matrix.seeds} seed(s) per row.  ",
            f"Machine: {machine()}; wall time {elapsed_s / 60:.1f} min.\n",
            markdown_table(result["runs"], result["metrics"], rows)]
    if curves:
        text.append(f"\nTraining reward curves: `{curves.name}`.\n")
    text.append("\nRows:\n")
    text += [f"- **{r}**: {' '.join(f'`{o}`' for o in matrix.rows[r]) or '(the base)'}" for r in matrix.rows]
    if result["failed"]:
        text.append("\nFailed runs:\n")
        text += [f"- {k}: {v}" for k, v in result["failed"].items()]
    if result["interrupted"]:
        text.append("\nInterrupted: the table covers the runs that finished.")
    md = out / "compare.md"
    md.write_text("\n".join(text) + "\n", encoding="utf-8")
    g = gains(result["runs"]) if result["runs"] else {}
    (out / "compare.json").write_text(json.dumps(
        {"matrix": str(matrix.source), "seeds": matrix.seeds, "budget": matrix.budget,
         "gains": {r: {k: {"mean": v[0], "se": v[1], "n": v[2], "se_over_pairs": v[3]} for k, v in kv.items()}
                   for r, kv in g.items()},
         "failed": result["failed"], "interrupted": result["interrupted"]}, indent=2))
    return md


def cmd_compare(args) -> int:
    import sys

    from cluster.compare_matrix import load_matrix
    from common.config import ConfigError

    matrix = load_matrix(args.config).for_mode(args.quick, args.seeds)
    rows = None
    if args.rows:
        rows = [r.strip() for r in args.rows.split(",") if r.strip()]
        bad = [r for r in rows if r not in matrix.rows]
        if bad:
            raise ConfigError(f"--rows: unknown row(s) {bad}; the matrix has {list(matrix.rows)}")
    out = Path(args.out or f"runs/compare-{Path(args.config).stem}{'-quick' if args.quick else ''}")
    out.mkdir(parents=True, exist_ok=True)
    command = "vgrpo " + " ".join(sys.argv[1:]) if sys.argv and "vgrpo" in sys.argv[0] else \
        f"vgrpo compare -c {args.config}{' --quick' if args.quick else ''}"
    t0 = time.monotonic()
    result = run_matrix(matrix, out, rows, note=lambda s: print(s, flush=True))
    md = write_report(matrix, result, out, command, time.monotonic() - t0)
    print(md.read_text())
    print(f"wrote {md}, {out / 'compare.json'} and {out / 'curves.png'}")
    if result["interrupted"]:
        return 130
    return 1 if result["failed"] else 0
