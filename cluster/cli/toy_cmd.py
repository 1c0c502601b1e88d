"""`vgrpo toy pretrain|sample|grid`: make, watch and compare toy video models."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import numpy as np

from cluster.runs.media import grid_image
from common import toyscore
from common import toyworld as tw
from common.config import SCHEME_NAMES


def register(sub) -> None:
    p = sub.add_parser("toy", help="the toy world: pretrain, sample, grid",
                       description="The toy world: a coloured square moving across a 16×16 frame. "
                       "Pretrain its tiny Wan model, sample a prompt, or draw the eval set as a grid.")
    tsub = p.add_subparsers(dest="toy_command", metavar="ACTION", required=True)

    pre = tsub.add_parser("pretrain", help="flow-matching pretraining of the toy model",
                          description="Train the toy model from scratch on rendered videos. Every "
                          "--eval-every steps it scores the fixed eval set (16-step ODE) and, with "
                          "--snapshots, saves a checkpoint there; --steps K reproduces the snapshot "
                          "at step K (the lr is constant after warm-up).")
    pre.add_argument("--steps", type=int, default=2000, help="optimizer steps (default 2000)")
    pre.add_argument("--batch", type=int, default=64, help="videos per step (default 64)")
    pre.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    pre.add_argument("--seed", type=int, default=0, help="seed of data, noise and init (default 0)")
    pre.add_argument("--out", required=True, help="output NAME.safetensors (NAME.json is written beside it)")
    pre.add_argument("--snapshots", default=None, help="directory for per-eval snapshots (default: none)")
    pre.add_argument("--eval-every", type=int, default=200, help="steps between evals (default 200)")
    pre.add_argument("--eval-seeds", type=int, default=16, help="seeds per eval prompt (default 16)")
    pre.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    pre.add_argument("--init", default=None, help="go on from this checkpoint instead of from scratch")
    pre.add_argument("--i2v-prob", type=float, default=0.25,
                     help="share of videos conditioned on their first frame (default 0.25); >= 0.5 evaluates I2V")
    pre.add_argument("--i2v-layout", default="first_frame", choices=["first_frame", "broadcast"],
                     help="how the first frame enters: Wan I2V's frame-0 latent + mask (default), or "
                     "broadcast over time (the T2V base's layout)")
    pre.set_defaults(func=cmd_pretrain)

    smp = tsub.add_parser("sample", help="sample one prompt to a GIF and print its reward heads",
                          description="Sample PROMPT with the toy model and write a GIF (an MP4 too "
                          "when imageio-ffmpeg is installed); print the VQ/MQ/TA heads.")
    smp.add_argument("--prompt", required=True, help='e.g. "a blue square moving up"')
    _common(smp)
    smp.add_argument("--seed", type=int, default=0, help="initial-noise seed (default 0)")
    smp.add_argument("--i2v", action="store_true", help="condition on the first frame of a rendered I2V video "
                     "(seeded; the committed I2V base unless --checkpoint) and print IA too")
    smp.add_argument("--out", default="toy_sample.gif", help="output GIF (default toy_sample.gif)")
    smp.set_defaults(func=cmd_sample)

    data = tsub.add_parser("i2v-data", help="write the toy image-to-video sets (manifests + PNGs)",
                           description="Write OUT/train.jsonl, OUT/eval.jsonl and OUT/images/: the toy "
                           "world's I2V sets (rollout_worker/models/toy_i2v_data.py).")
    data.add_argument("--out", default="rollout_worker/models/assets/toy_i2v",
                      help="output folder (default: the committed copy)")
    data.set_defaults(func=cmd_i2v_data)

    grd = tsub.add_parser("grid", help="one PNG: a row per eval prompt, frames side by side",
                          description="Sample every eval prompt (toy-eval) with --seeds seeds and write "
                          "one upscaled PNG: a row per prompt, each seed's frames side by side.")
    _common(grd)
    grd.add_argument("--seeds", type=int, default=2, help="seeds per prompt, side by side (default 2)")
    grd.add_argument("--scale", type=int, default=8, help="pixel upscaling (default 8)")
    grd.add_argument("--out", default="toy_grid.png", help="output PNG (default toy_grid.png)")
    grd.set_defaults(func=cmd_grid)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", default=None, help="NAME.safetensors or a directory (default: the committed base)")
    p.add_argument("--scheme", default="ode", choices=SCHEME_NAMES,
                   help="sampling scheme (default ode)")
    p.add_argument("--steps", type=int, default=16, help="sampling steps (default 16)")
    p.add_argument("--shift", type=float, default=3.0, help="schedule shift (default 3)")
    p.add_argument("--guidance", type=float, default=1.0, help="CFG scale; 1 = single pass (default 1)")


def cmd_i2v_data(args) -> int:
    # lazy: torch, PIL (kept out of vgrpo --help)
    from rollout_worker.models.toy_i2v_data import write_sets

    for path in write_sets(args.out):
        print(f"wrote {path}")
    return 0


def cmd_pretrain(args) -> int:
    import torch  # lazy: torch (kept out of vgrpo --help)

    # lazy: torch, safetensors (kept out of vgrpo --help)
    from rollout_worker.models.toy_pretrain import pretrain

    torch.set_num_threads(args.threads)
    command = shlex.join(["vgrpo", *sys.argv[1:]]) if Path(sys.argv[0]).name == "vgrpo" else shlex.join(sys.argv)
    _, history = pretrain(args.steps, args.batch, args.lr, args.seed, args.out, eval_every=args.eval_every,
                          eval_seeds=args.eval_seeds, snapshot_dir=args.snapshots, command=command,
                          i2v_prob=args.i2v_prob, init=args.init, i2v_layout=args.i2v_layout)
    ev = history[-1]["eval"]
    print(f"wrote {args.out}: " + "  ".join(f"{k} {ev[k]['mean']:.3f}±{ev[k]['stderr']:.3f}"
                                           for k in ("VQ", "MQ", "TA", "IA", "colour", "direction_correct") if k in ev))
    return 0


def _sample(model, prompts, seeds, args, images=None):
    """Videos uint8 [B, F, H, W, 3] from the rollout sampler (one per (prompt, seed))."""
    # lazy: torch, PIL (kept out of vgrpo --help)
    from common.sde import Schedule
    from rollout_worker.sampler import sample_videos

    return sample_videos(model, prompts, seeds, Schedule.linear(args.steps, args.shift),
                         scheme_name=args.scheme, images=images)


def _load(args):
    import torch  # lazy: torch (kept out of vgrpo --help)

    # lazy: torch, safetensors (kept out of vgrpo --help)
    from rollout_worker.models.toy import BASE_I2V_CHECKPOINT, ToyVideoModel

    torch.set_num_threads(1)
    ckpt = args.checkpoint
    if ckpt is None and getattr(args, "i2v", False):
        ckpt = BASE_I2V_CHECKPOINT                      # the I2V base: Wan-style first-frame conditioning
    return ToyVideoModel.from_pretrained(ckpt, guidance_scale=args.guidance)


def cmd_sample(args) -> int:
    # lazy: torch, imageio (kept out of vgrpo --help)
    import imageio.v3 as iio
    import torch

    try:
        tw.parse_prompt(args.prompt)
    except ValueError as e:
        raise SystemExit(f"error: --prompt: {e}") from None
    model = _load(args)
    images = None
    if args.i2v:
        images = torch.from_numpy(tw.i2v_condition(args.prompt, args.seed))[None]
    frames = _sample(model, [args.prompt], [args.seed], args, images)[0].numpy()   # [F, H, W, 3]
    big = frames.repeat(8, axis=1).repeat(8, axis=2)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    iio.imwrite(out, big, duration=250, loop=0)
    written = [str(out)]
    try:
        # optional: imageio-ffmpeg
        import imageio_ffmpeg  # noqa: F401
    except ImportError:
        pass                                            # GIF only: MP4 needs imageio-ffmpeg
    else:
        try:
            iio.imwrite(out.with_suffix(".mp4"), np.ascontiguousarray(big), fps=4)
            written.append(str(out.with_suffix(".mp4")))
        except (OSError, ValueError, RuntimeError) as e:
            print(f"mp4 skipped: {e}")
    heads = toyscore.score_video(frames, args.prompt, None if images is None else images[0].numpy())
    print(f"wrote {', '.join(written)}")
    print("  ".join(f"{k} {heads[k]:.3f}" for k in (*toyscore.I2V_HEADS, "colour", "direction") if k in heads))
    return 0


def cmd_grid(args) -> int:
    import imageio.v3 as iio  # lazy: imageio (kept out of vgrpo --help)

    model = _load(args)
    pairs = tw.eval_pairs(args.seeds)
    frames = _sample(model, [p for p, _ in pairs], [s for _, s in pairs], args).numpy()  # [P·S, F, H, W, 3]
    grid = grid_image(frames, per_row=args.seeds, scale=args.scale)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    iio.imwrite(out, grid)
    print(f"wrote {out}: rows = {', '.join(tw.EVAL_PROMPTS)}; {args.seeds} seed(s) per row")
    return 0
