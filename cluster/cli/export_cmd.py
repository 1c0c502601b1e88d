"""`vgrpo export RUN --out DIR`: a run's trained policy as a diffusers LoRA file or model folder."""

from __future__ import annotations

import shlex


def register(sub) -> None:
    p = sub.add_parser(
        "export", help="write a run's policy in diffusers' formats, with a model card",
        description="Export RUN's newest checkpoint (or --step N) into DIR: a LoRA run becomes "
        "pytorch_lora_weights.safetensors, which the pipeline's load_lora_weights loads; a full "
        "fine-tune becomes a transformer/ folder for the transformer class's from_pretrained, or with "
        "--pipeline a whole pipeline folder (the base's other components linked beside it). With "
        "optim.ema_decay the weights are the moving average. README.md (the model card) and "
        "vgrpo_export.json say what the folder holds, its evaluation, and how to load it.")
    p.add_argument("run", help="a run directory (local or s3://…), or one of its checkpoints/step_NNNNNNNN")
    p.add_argument("--step", type=int, default=None, help="the checkpoint of this step (default: the newest)")
    p.add_argument("--out", required=True, help="the folder to write (new, empty, or an earlier export)")
    p.add_argument("--pipeline", action="store_true",
                   help="full fine-tunes: a whole pipeline folder, not only transformer/")
    p.set_defaults(func=run)


def run(args) -> int:
    # lazy: torch, safetensors (kept out of vgrpo --help)
    from cluster.runs.export import export_run

    argv = getattr(args, "argv", None) or ["export", args.run, "--out", args.out]
    info = export_run(args.run, args.out, args.step, args.pipeline, command=shlex.join(["vgrpo", *argv]))
    what = "LoRA adapter" if info["kind"] == "lora" else "transformer" + (" and pipeline" if info["pipeline"] else "")
    print(f"exported step {info['step']} of {info['run']} ({what}, {info['weights']} weights) to {args.out}: "
          f"{', '.join(info['files'])}, README.md, vgrpo_export.json")
    print("load it with:\n" + info["load"])
    return 0
