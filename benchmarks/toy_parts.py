"""The toy reward heads taken apart (not a test): `python -m benchmarks.toy_parts TARGET [TARGET ...]`.

TARGET is `base` (the committed toy model, with -c CONFIG) or a run / checkpoint directory. Each is
ODE-sampled on its evaluation pairs, and the parts behind VQ (clean, size, crisp, mass/area), MQ
(smooth, steady, speed, |d̄|/v*) and TA (colour, direction) are averaged, so a change in a head can
be traced to what changed in the videos (docs/results.md, the quickstart's tuning).
"""

from __future__ import annotations

import argparse

import numpy as np

from common import toyscore as ts


def parts(frames: np.ndarray, prompt: str) -> dict[str, float]:
    """One uint8 [F, H, W, 3] video: the parts behind its VQ, MQ and TA (common.toyscore's own)."""
    vq = {k: float(v.mean()) for k, v in ts.visual_parts(frames).items()}
    mq = ts.motion_parts(frames) or {}
    s = ts.score_video(frames, prompt)
    return {**vq, **mq, **{k: s[k] for k in ("VQ", "MQ", "TA", "colour", "direction")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("targets", nargs="+", help="'base' or a run / checkpoint directory")
    ap.add_argument("-c", "--config", default="configs/quickstart.yaml", help="config for 'base'")
    ap.add_argument("--seeds", type=int, default=32, help="seeds per evaluation prompt")
    args = ap.parse_args()

    import torch

    from cluster.evaluation.policy import evaluate_policy
    from cluster.runs.policy_file import resolve_target

    torch.set_num_threads(1)
    for target in args.targets:
        cfg, ckpt = resolve_target(target, args.config)
        _, frames, evals = evaluate_policy(cfg, ckpt, args.seeds)
        conds = evals.conditions
        rows = [parts(f.numpy(), c.prompt) for f, c in zip(frames, conds, strict=True)]
        keys = ["VQ", "clean", "size", "crisp", "mass/area", "MQ", "smooth", "steady", "speed", "|d|/v*",
                "TA", "colour", "direction"]
        means = {k: float(np.nanmean([r.get(k, np.nan) for r in rows])) for k in keys}
        print(f"{target}" + ("" if ckpt is None else f" @ {ckpt.name}") + f" ({len(rows)} pairs): "
              + "  ".join(f"{k} {v:.3f}" for k, v in means.items()))


if __name__ == "__main__":
    main()
