"""Does RL improve the toy I2V model on held-out (image, prompt) pairs? Base vs a run's policy.

    vgrpo train -c configs/toy_i2v.yaml                        # writes runs/toy_i2v
    python -m benchmarks.toy_i2v_gain runs/toy_i2v [--seeds 4]

ODE-samples the held-out set (toy-i2v-eval: 4 unseen prompts × 8 unseen first frames) with
`--seeds` noise seeds each, for the committed I2V base and for the run's newest checkpoint,
scores both with the run's rewards and prints the paired gain per head twice: over every
(image, prompt, seed) video, and over the 32 (image, prompt) pairs (each the mean of its
seeds) — the stricter test, since videos of one pair are not independent.
Not a test: it prints a table (docs/results.md records it).
"""

from __future__ import annotations

import argparse
import math

import numpy as np


def paired_z(before: np.ndarray, after: np.ndarray) -> tuple[float, float, float]:
    d = after - before
    se = float(d.std(ddof=1) / math.sqrt(len(d)))
    return float(d.mean()), se, float(d.mean() / se) if se > 0 else math.inf


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", help="a run directory of configs/toy_i2v.yaml")
    ap.add_argument("--seeds", type=int, default=4, help="noise seeds per (image, prompt) pair")
    args = ap.parse_args(argv)

    from cluster.evaluation.policy import evaluate_policy
    from cluster.runs.policy_file import resolve_target

    cfg, ckpt = resolve_target(args.run, None)
    out = {}
    for label, at in (("base", None), ("after", ckpt)):  # the same EvalSet both times
        result, _, evals = evaluate_policy(cfg, at, args.seeds)
        out[label] = dict(zip(result.heads, result.values.T, strict=True)) | {"composite": result.composite}
    conds, seeds = evals.prompt_conditions, evals.seeds[:evals.per_prompt]
    print(f"{args.run} @ {ckpt.name}: {len(conds)} held-out (image, prompt) pairs × {len(seeds)} seeds")
    print(f"{'head':<10} {'base':>7} {'after':>7} {'gain ± se (videos)':>22} {'z':>6} "
          f"{'gain ± se (pairs)':>22} {'z':>6}")
    for key in ["composite", *[h for h in out["base"] if h != "composite"]]:
        b, a = out["base"][key], out["after"][key]
        dv, sv, zv = paired_z(b, a)
        bp, ap_ = b.reshape(len(conds), -1).mean(1), a.reshape(len(conds), -1).mean(1)
        dp, sp, zp = paired_z(bp, ap_)
        print(f"{key:<10} {b.mean():7.3f} {a.mean():7.3f} {dv:+13.3f} ± {sv:.3f} {zv:6.1f} "
              f"{dp:+13.3f} ± {sp:.3f} {zp:6.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
