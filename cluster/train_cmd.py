"""`vgrpo train` and `vgrpo resume`: set up, evaluate, train, evaluate, clean up."""

from __future__ import annotations

import json
from pathlib import Path

from cluster.cmd_config import add_config_args


def register(sub) -> None:
    p = sub.add_parser(
        "train", help="train a video model with GRPO",
        description="Run a training job: rollout, reward and learner actors on Ray, the memory bank "
        "on Redis (embedded unless bank.redis_url or $VGRPO_REDIS_URL is set). With RAY_ADDRESS set "
        "(as under `ray job submit`) it joins that cluster; otherwise it starts a local one. Writes "
        "a run directory with the resolved config, metrics.jsonl, a reward curve, sample GIFs before "
        "and after training, checkpoints and a before/after summary. Ctrl-C finishes the current "
        "step, writes a checkpoint and stops what the run started.")
    add_config_args(p)
    p.add_argument("--no-eval", action="store_true", help="skip the before/after evaluation")
    p.set_defaults(func=train)

    r = sub.add_parser(
        "resume", help="continue a run from its last checkpoint",
        description="Continue RUN_DIR from its newest checkpoint, with its saved config, at the same "
        "step, data cursor and KL controller state.")
    r.add_argument("run_dir", help="a run directory written by `vgrpo train`")
    r.add_argument("overrides", nargs="*", metavar="key.path=value",
                   help="overrides, e.g. train.steps=200 to extend the run")
    r.add_argument("--no-eval", action="store_true", help="skip the after-training evaluation")
    r.set_defaults(func=resume)


def train(args) -> int:
    from common.config import load_config

    cfg = load_config(args.config, args.overrides)
    from cluster.driver import check_model_path
    from cluster.run_dir import RunDir

    check_model_path(cfg)  # before the run dir exists: a bad model leaves nothing behind
    return _run(cfg, RunDir.create(cfg), resume=None, evaluate=not args.no_eval)


def resume(args) -> int:
    from cluster.run_dir import RunDir
    from common.config import ConfigError, load_config
    from learner import dist_checkpoint

    run = Path(args.run_dir)
    if not (run / "config.yaml").is_file():
        raise ConfigError(f"{run}: not a run directory (no config.yaml)")
    cfg = load_config(run / "config.yaml", args.overrides)
    root = run / "checkpoints"
    dist_checkpoint.verify_newest(root, cfg.pools.learner.num_actors)  # damaged files: one line, before any actor
    return _run(cfg, RunDir(run), resume=root, evaluate=not args.no_eval)


def _run(cfg, run_dir, resume, evaluate: bool) -> int:
    from rich.console import Console

    from cluster.driver import Driver
    from cluster.evaluate import paired, summary_table
    from cluster.progress import TrainProgress

    console = Console()
    console.print(f"[bold]vgrpo[/] run directory: {run_dir.path}")
    driver = Driver(cfg, run_dir, console=console)
    try:
        with console.status("starting Ray, Redis and the actors…"):
            driver.setup(resume=resume)
        before = driver.evaluate("before") if evaluate and resume is None else None
        with TrainProgress(cfg.train.steps, driver.heads(), console, start_step=driver.step) as progress:
            driver.run(progress)
        driver.checkpoint()
        if driver.stop_reason is not None:
            # a fault the run could not ride out: one line, and how to continue
            console.print(f"error: {driver.stop_reason}")
            console.print(f"stopped at step {driver.step}; continue with: vgrpo resume {run_dir.path}")
            return 1
        if driver.stop_requested.is_set() and driver.step < cfg.train.steps:
            console.print(f"interrupted at step {driver.step}; continue with: vgrpo resume {run_dir.path}")
            return 130
        if evaluate:
            after = driver.evaluate("after")
            summary = {"steps": driver.step, "after": after.to_dict()}
            if before is not None:
                console.print(summary_table(before, after, f"evaluation: {len(after.composite)} fixed "
                                            "(prompt, seed) pairs, ODE sampling, before vs after"))
                summary["before"] = before.to_dict()
                summary["paired"] = [vars(r) | {"z": r.z} for r in paired(before, after)]
            (run_dir.path / "summary.json").write_text(json.dumps(summary, indent=2))
        console.print(f"done: {driver.step} steps; run directory {run_dir.path}")
    finally:
        driver.teardown()
    return 0
