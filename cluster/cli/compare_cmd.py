"""`vgrpo compare`: run a matrix of methods with one budget, then table their paired gains.

Runs share one Ray cluster in this process; each is a Driver with its own run directory under
--out (OUT/<row>/seed<k>), evaluated before and after on the fixed (prompt, seed) pairs.
`parallel: N` (or --parallel N) keeps N runs in flight at once, each in its own thread; the
records do not depend on N. A finished run (compare_run.json next to an identical config.yaml)
is reused, so an interrupted comparison continues where it stopped.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from cluster.compare.matrix import load_matrix
from cluster.compare.runner import run_matrix, write_report
from common.config import ConfigError


def register(sub) -> None:
    p = sub.add_parser(
        "compare", help="compare methods (or an ablation) on the toy world with one budget",
        description="Run every row of a matrix file (configs/compare_toy.yaml, configs/ablate_*.yaml) "
        "for several seeds with the same budget, evaluate each run before and after training on the "
        "fixed (prompt, seed) pairs, and write OUT/compare.md and OUT/compare.json: method × reward "
        "heads, mean ± stderr over seeds of the after − before gain, each row's rollout and learner seconds "
        "and its gain per rollout-(GPU-)second, ranked by it; with `reference:` in the matrix, "
        "that quotient's ratio to the reference's on exactly the seeds both rows ran (with a paired 95% "
        "bootstrap interval and the seed count), and "
        "each row's paired difference against that row on the same seeds and pairs, with its 95% "
        "Student-t interval and whether it resolves 0.02 composite; with `most_seeds:` above `seeds:`, "
        "a second stage runs more seeds for each row whose interval (against the reference or in a "
        "claim) is wider than ±0.02, as many as its measured spread needs, up to most_seeds; with `claims:`, which claims "
        "reproduce (interval above 0), are contradicted (below 0) or are not resolved (it contains 0). "
        "Also OUT/curves.png (training reward, mean over seeds). "
        "--quick replaces the budget with the matrix's quick: section (fewer steps, seeds and eval "
        "pairs).", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("-c", "--config", required=True, help="a matrix file, e.g. configs/compare_toy.yaml (the methods) or "
                   "configs/compare_toy_ablations.yaml (the papers' ablation claims)")
    p.add_argument("--quick", action="store_true", help="use the matrix's quick budget (about 10 min)")
    p.add_argument("--seeds", type=int, default=None,
                   help="seeds per row in the first stage (overrides the matrix's seeds:)")
    p.add_argument("--parallel", type=int, default=None,
                   help="runs in flight at once (overrides the matrix's parallel:, default 1); in sync "
                   "mode a run keeps about one core busy, so 2 on 2 cores nearly halves the wall time")
    p.add_argument("--out", default=None, help="output directory (default: runs/compare-<matrix name>[-quick])")
    p.add_argument("--rows", default=None, help="comma-separated subset of row names to run")
    p.set_defaults(func=cmd_compare)


def cmd_compare(args) -> int:

    matrix = load_matrix(args.config).for_mode(args.quick, args.seeds)
    for w in matrix.warnings():
        print(f"warning: {args.config}: {w}", flush=True)
    if args.parallel is not None and args.parallel < 1:
        raise ConfigError(f"--parallel {args.parallel}: must be at least 1 (runs in flight at once)")
    rows = None
    if args.rows:
        rows = [r.strip() for r in args.rows.split(",") if r.strip()]
        bad = [r for r in rows if r not in matrix.rows]
        if bad:
            raise ConfigError(f"--rows: unknown row(s) {bad}; the matrix has {list(matrix.rows)}")
    out = Path(args.out or f"runs/compare-{Path(args.config).stem}{'-quick' if args.quick else ''}")
    out.mkdir(parents=True, exist_ok=True)
    command = "vgrpo " + " ".join(sys.argv[1:]) if sys.argv and "vgrpo" in sys.argv[0] else \
        f"vgrpo compare -c {args.config}{' --quick' if args.quick else ''}{' --rows ' + args.rows if args.rows else ''}"
    t0 = time.monotonic()
    parallel = args.parallel or matrix.parallel
    result = run_matrix(matrix, out, rows, note=lambda s: print(s, flush=True), parallel=parallel)
    md = write_report(matrix, result, out, command, time.monotonic() - t0, parallel)
    print(md.read_text())
    print(f"wrote {md}, {out / 'compare.json'} and {out / 'curves.png'}")
    if result["interrupted"]:
        return 130
    return 1 if result["failed"] else 0
