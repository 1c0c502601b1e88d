"""`vgrpo eval` and `vgrpo sample`: a trained policy from a run directory, in this process (no Ray)."""

from __future__ import annotations

import argparse
import json
import math
import shutil
import tempfile
from pathlib import Path

import numpy as np

from cluster.data.text import clean_prompt
from cluster.evaluation.policy import evaluate_policy, load_policy, score
from cluster.runs.media import grid_image, write_gif
from cluster.runs.policy_file import resolve_target
from common import storage
from common.config import SCHEME_NAMES, ConfigError
from common.scorers import scorer_spec


def register(sub) -> None:
    e = sub.add_parser(
        "eval", help="evaluate a run's policy on fixed (prompt, seed) pairs",
        description="ODE-sample the evaluation pairs with a run's newest (or a given) checkpoint, "
        "score them with the run's reward models, print mean ± standard error per head and the "
        "composite, and write a grid image and sample GIFs.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    e.add_argument("target", help="a run directory, or one of its checkpoints/step_NNNNNNNN dirs; "
                   "'base' evaluates the untrained model of -c CONFIG")
    e.add_argument("-c", "--config", default=None, help="config for 'base' (a run uses its own)")
    e.add_argument("--prompts", default=None, help="a prompts file or a built-in set (default: the run's eval set)")
    e.add_argument("--seeds", type=int, default=None, help="seeds per prompt (default: the run's train.eval_seeds)")
    e.add_argument("--out", default=None, help="where to write grid.png and GIFs (default: TARGET/eval)")
    e.add_argument("--curve", action="store_true",
                   help="evaluate the base and every kept checkpoint of the run on the same pairs; write "
                   "curve.md, curve.json and curve.png (paired gain per head against the step) to --out")
    e.set_defaults(func=cmd_eval)

    s = sub.add_parser(
        "sample", help="sample one prompt with a run's policy to a GIF",
        description="Sample PROMPT with a run's newest checkpoint (or the base model of -c CONFIG) and "
        "write a GIF; print the reward heads.", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    s.add_argument("target", help="a run directory, a checkpoint dir, or 'base'")
    s.add_argument("--prompt", required=True)
    s.add_argument("-c", "--config", default=None, help="config for 'base'")
    s.add_argument("--image", default=None, help="the first frame (image-to-video runs: model.task = i2v)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--scheme", default="ode", choices=SCHEME_NAMES)
    s.add_argument("--out", default="sample.gif")
    s.set_defaults(func=cmd_sample)


def cmd_eval(args) -> int:
    # lazy: imageio, rich (kept out of vgrpo --help)
    import imageio.v3 as iio
    from rich.console import Console
    from rich.table import Table

    # lazy: torch, PIL (kept out of vgrpo --help)
    from cluster.data.manifests import side_by_side

    out, upload = _out_dir(args)
    if args.curve:
        # lazy: torch, rich (kept out of vgrpo --help)
        from cluster.evaluation.curve import run_curve

        run = storage.location(args.target)
        if not (run / "config.yaml").is_file():
            raise ConfigError(f"{run}: --curve needs a run directory (with config.yaml), not a checkpoint or 'base'")
        text, png = run_curve(run, args.seeds, out,
                              lambda cfg, ckpt, seeds: evaluate_policy(cfg, ckpt, seeds, args.prompts)[0])
        print(text)
        print(f"wrote {_shown(out / 'curve.md', out, upload)}, curve.json and {_shown(png, out, upload)}")
        _upload(out, upload)
        return 0
    cfg, ckpt = resolve_target(args.target, args.config)
    result, frames, evals = evaluate_policy(cfg, ckpt, args.seeds, args.prompts)
    pair_conds, n_seeds = evals.conditions, evals.per_prompt
    prompts = [c.prompt for c in evals.prompt_conditions]
    out = Path(args.out) if args.out else (Path(args.target) / "eval" if args.target != "base" else Path("eval"))
    out.mkdir(parents=True, exist_ok=True)
    # I2V: every video is shown with its first frame to its left
    shown = np.stack([side_by_side(f.numpy(), c, cfg.model) for f, c in zip(frames, pair_conds, strict=True)])
    iio.imwrite(out / "grid.png", grid_image(shown, per_row=n_seeds))
    for i, p in enumerate(prompts):
        write_gif(shown[i * n_seeds], out / f"{i}_{p.replace(' ', '_')[:60]}.gif")
    t = Table(title=f"{args.target}{'' if ckpt is None else ' @ ' + ckpt.name}: {len(pair_conds)} (prompt, seed) pairs, ODE")
    t.add_column("reward")
    t.add_column("mean ± stderr", justify="right")
    for key in ["composite", *result.heads]:
        m, se = result.mean_se(key)
        t.add_row(key, f"{m:.3f} ± {se:.3f}")
    Console().print(t)
    (out / "eval.json").write_text(json.dumps({"target": str(args.target), "checkpoint": str(ckpt),
                                               "pairs": len(pair_conds), **result.to_dict()}, indent=2))
    print(f"wrote {_shown(out / 'grid.png', out, upload)}, eval.json and {len(prompts)} GIFs")
    _upload(out, upload)
    return 0


def _out_dir(args) -> tuple[Path, str | None]:
    """(local folder to write into, object-store prefix to upload it to afterwards or None).
    The default is TARGET/eval; a target on an object store gets it there too."""
    if args.out:
        return Path(args.out), None
    if args.target == "base":
        return Path("eval"), None
    if storage.is_uri(args.target):
        return Path(tempfile.mkdtemp(prefix="vgrpo-eval-")), storage.join(args.target, "eval")
    return Path(args.target) / "eval", None


def _shown(f: Path, out: Path, upload: str | None) -> str:
    return str(f) if upload is None else storage.join(upload, f.relative_to(out).as_posix())


def _upload(out: Path, upload: str | None) -> None:
    if upload is not None:
        storage.push_tree(out, upload)
        shutil.rmtree(out, ignore_errors=True)


def cmd_sample(args) -> int:
    # lazy: torch, PIL (kept out of vgrpo --help)
    from common.images import ImageError, load_image
    from common.sde import Schedule
    from rollout_worker.sampler import sample_videos

    prompt = clean_prompt(args.prompt, "--prompt")
    if not prompt:
        raise ConfigError("--prompt is empty (or only spaces); give the text to sample")
    cfg, ckpt = resolve_target(args.target, args.config)
    if (args.image is None) != (cfg.model.task == "t2v"):
        raise ConfigError(f"--image: model.task = {cfg.model.task!r} "
                          + ("needs a first frame: pass --image PATH" if args.image is None else "takes no image"))
    try:
        images = None if args.image is None else load_image(args.image, cfg.model.height, cfg.model.width)[None]
    except ImageError as e:
        raise ConfigError(f"--image: {e}") from None
    model = load_policy(cfg, ckpt)
    _check_grammar(cfg, prompt)
    frames = sample_videos(model, [prompt], [args.seed], Schedule.from_config(cfg.schedule), args.scheme,
                           images=images, forward_batch_size=cfg.sampler.forward_batch_size)
    shown = frames[0].numpy() if images is None else np.concatenate(  # the first frame to the left
        [np.broadcast_to(images.numpy(), frames[0].shape), np.full((*frames.shape[1:3], 1, 3), 128, np.uint8),
         frames[0].numpy()], axis=2)
    path = write_gif(shown, Path(args.out))
    scores, composite = score(cfg, frames, [prompt], images)
    print(f"wrote {path}")
    values = scores.values[0].tolist()
    unscored = [h for h, v in zip(scores.heads, values, strict=True) if not math.isfinite(v)]
    if unscored or not math.isfinite(float(composite[0])):
        raise ConfigError(f"--prompt {_short(prompt)}: the reward models gave no finite score (heads "
                          f"{', '.join(unscored) or 'composite'}); is the prompt one they can read?")
    heads = "  ".join(f"{h} {v:.3f}" for h, v in zip(scores.heads, values, strict=True))
    print(f"composite {float(composite[0]):.3f}  {heads}")
    return 0


def _check_grammar(cfg, prompt: str) -> None:
    """A reward model that reads only its own grammar (the toy world's) would score NaN: refused."""
    for m in cfg.rewards.models:
        grammar = scorer_spec(m.name).grammar
        if grammar is None:
            continue
        try:
            grammar(prompt)
        except ValueError as e:
            raise ConfigError(f"--prompt: outside the grammar of reward model {m.name!r}, which would "
                              f"score it NaN: {e}") from None


def _short(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "…")
