"""`vgrpo train` and `vgrpo resume`: set up, evaluate, train, evaluate, clean up."""

from __future__ import annotations

from cluster.cli.config_cmd import add_config_args
from cluster.driver.preflight import check_model_path, health_warnings, job_run_root, preflight
from cluster.runs.run_dir import RunDir
from common.config import ConfigError, load_config


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
    p.add_argument("--clear-stale-bank", action="store_true",
                   help="delete data a dead run left in bank.namespace (same as bank.clear_stale=true)")
    p.add_argument("--skip-cluster-checks", action="store_true",
                   help="start without the checks on the cluster (role resources, each role's files, CUDA, GPU "
                   "memory, writable storage); same as preflight.skip_cluster_checks=true")
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
    cfg = load_config(args.config, [*args.overrides, *(["bank.clear_stale=true"] if args.clear_stale_bank else []),
                                    *(["preflight.skip_cluster_checks=true"] if args.skip_cluster_checks else [])])
    cfg, moved = job_run_root(cfg)  # under `ray job submit`: never inside Ray's per-job copy of the project
    if moved:
        print(f"vgrpo: {moved}")
    preflight(cfg)  # before the run directory exists: a bad input leaves nothing behind
    check_model_path(cfg)
    for line in health_warnings(cfg):  # settings that fail silently: said before any GPU is spent
        print(f"warning: {line}")
    return _run(cfg, RunDir.create(cfg), resume=None, evaluate=not args.no_eval)


def resume(args) -> int:
    # lazy: torch, safetensors (kept out of vgrpo --help)
    from cluster.driver.saved_state import check_saved_state
    from learner import dist_checkpoint

    run_dir = RunDir.open(args.run_dir)  # a folder, or a run on an object store (s3://…) staged here
    if not (run_dir.path / "config.yaml").is_file():
        raise ConfigError(f"{run_dir.location}: not a run directory (no config.yaml)")
    cfg = load_config(run_dir.path / "config.yaml", args.overrides)
    root = run_dir.checkpoints
    # damaged files: one line, before any actor; one shard per learner process (num_actors × parallel.sp)
    newest = dist_checkpoint.verify_newest(root, cfg.pools.learner.processes)
    notes = check_saved_state(run_dir, newest, cfg)  # every field a resume reads, before Ray starts
    preflight(cfg)
    for line in notes:
        print(f"note: {line}")
    run_dir.video_fps = cfg.log.video_fps
    return _run(cfg, run_dir, resume=root, evaluate=not args.no_eval)


def _run(cfg, run_dir, resume, evaluate: bool) -> int:
    """The run's lifecycle (cluster/driver/lifecycle.py) with this command's console and progress bar."""
    from rich.console import Console  # lazy: rich (kept out of vgrpo --help)

    # lazy: torch, safetensors (kept out of vgrpo --help)
    from cluster.cli.progress import TrainProgress
    from cluster.driver.driver import Driver
    from cluster.driver.lifecycle import run_in_dir

    console = Console()
    console.print(f"[bold]vgrpo[/] run directory: {run_dir.location}"
                  + (f" (staged in {run_dir.path})" if run_dir.remote else ""))
    driver = Driver(cfg, run_dir, console=console)
    progress = lambda: TrainProgress(cfg.train.steps, driver.heads(), console, start_step=driver.step)  # noqa: E731
    return run_in_dir(driver, run_dir, console, progress, resume=resume, evaluate=evaluate)
