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
from common import toyworld as tw


def parts(frames: np.ndarray, prompt: str) -> dict[str, float]:
    """One uint8 [F, H, W, 3] video: every part of its VQ, MQ and TA (toyscore's formulas, unrolled)."""
    m = ts.foreground(frames)
    F, H, W = m.shape
    c, mass = ts.centroids(m)
    area, half = tw.side(H) ** 2, tw.side(H) / 2 + 1.0
    yy, xx = np.meshgrid(np.arange(H) + 0.5, np.arange(W) + 0.5, indexing="ij")
    ok = np.isfinite(c).all(axis=1)
    out = {"clean": float(np.mean([m[f][(np.abs(yy - c[f, 0]) <= half) & (np.abs(xx - c[f, 1]) <= half)].sum() / mass[f]
                                   for f in range(F) if ok[f]])) if ok.any() else 0.0,
           "size": float(np.mean([min(x / area, area / x) if x > 0 else 0.0 for x in mass])),
           "crisp": float(np.mean([1 - np.mean(4 * m[f] * (1 - m[f])) for f in range(F)])),
           "mass/area": float(mass.mean() / area)}
    if ok.all():
        d = np.diff(c, axis=0)
        dm = d.mean(axis=0)
        v = tw.travel(H) / (F - 1)
        out.update(smooth=float(np.exp(-np.linalg.norm(d - dm, axis=1).mean() / 0.5)),
                   steady=float(np.exp(-(mass.std() / mass.mean()) / 0.2)),
                   speed=float(np.exp(-abs(np.linalg.norm(dm) - v) / v)), **{"|d|/v*": float(np.linalg.norm(dm) / v)})
    s = ts.score_video(frames, prompt)
    out.update({k: s[k] for k in ("VQ", "MQ", "TA", "colour", "direction")})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("targets", nargs="+", help="'base' or a run / checkpoint directory")
    ap.add_argument("-c", "--config", default="configs/quickstart.yaml", help="config for 'base'")
    ap.add_argument("--seeds", type=int, default=32, help="seeds per evaluation prompt")
    args = ap.parse_args()

    import torch

    from cluster.eval_cmd import evaluate_policy, resolve_target

    torch.set_num_threads(1)
    for target in args.targets:
        cfg, ckpt = resolve_target(target, args.config)
        _, frames, conds, _ = evaluate_policy(cfg, ckpt, args.seeds)
        rows = [parts(f.numpy(), c.prompt) for f, c in zip(frames, conds, strict=True)]
        keys = ["VQ", "clean", "size", "crisp", "mass/area", "MQ", "smooth", "steady", "speed", "|d|/v*",
                "TA", "colour", "direction"]
        means = {k: float(np.nanmean([r.get(k, np.nan) for r in rows])) for k in keys}
        print(f"{target}" + ("" if ckpt is None else f" @ {ckpt.name}") + f" ({len(rows)} pairs): "
              + "  ".join(f"{k} {v:.3f}" for k, v in means.items()))


if __name__ == "__main__":
    main()
