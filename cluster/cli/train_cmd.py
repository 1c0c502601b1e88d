"""`vgrpo train` and `vgrpo resume`: set up, evaluate, train, evaluate, clean up."""

from __future__ import annotations

import json

from cluster.cli.config_cmd import add_config_args
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
    from cluster.driver.preflight import check_model_path, health_warnings, preflight
    from cluster.runs.run_dir import RunDir

    cfg = load_config(args.config, [*args.overrides, *(["bank.clear_stale=true"] if args.clear_stale_bank else [])])
    preflight(cfg)  # before the run directory exists: a bad input leaves nothing behind
    check_model_path(cfg)
    for line in health_warnings(cfg):  # settings that fail silently: said before any GPU is spent
        print(f"warning: {line}")
    return _run(cfg, RunDir.create(cfg), resume=None, evaluate=not args.no_eval)


def resume(args) -> int:
    from cluster.driver.preflight import preflight
    from cluster.runs.run_dir import RunDir
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


def check_saved_state(run_dir, ckpt, cfg) -> list[str]:
    """Every file a resume reads, as the record it should be (cluster/driver/saved_state.py):
    extra.json as a DriverState, trainer.pt's structure and shapes, the bank dump's counts,
    status.json and metrics.jsonl. One line naming the file and the field (exit 2) before
    anything starts; returns the notes (a stale `running` status, a torn last metrics line)."""
    from cluster.driver import saved_state
    from cluster.driver.state import DriverState
    from learner.checkpoint import EXTRA_FILE, STATE_FILE, read_extra

    saved = DriverState.from_saved(read_extra(ckpt / EXTRA_FILE), str(ckpt / EXTRA_FILE))
    if (ckpt / STATE_FILE).is_file():  # a sharded checkpoint's shards are checked by its ranks
        saved_state.check_trainer_state(ckpt, cfg, saved.step)
    saved_state.check_bank_index(ckpt)
    status = saved_state.check_status(run_dir.status_file)
    notes = [n for n in (saved_state.check_not_running(run_dir.status_file, status),
                         run_dir.metrics_rows()[1]) if n]
    return notes


def _run(cfg, run_dir, resume, evaluate: bool) -> int:
    """Set up, train, evaluate; status.json says how it ended. A new run that fails before it
    wrote a checkpoint is removed again (nothing in it can be resumed)."""
    from rich.console import Console

    from cluster.driver.driver import Driver
    from cluster.runs.tracking import Tracker

    console = Console()
    console.print(f"[bold]vgrpo[/] run directory: {run_dir.location}"
                  + (f" (staged in {run_dir.path})" if run_dir.remote else ""))
    driver = Driver(cfg, run_dir, console=console)
    run_dir.set_status("running")
    state, reason = "stopped", None
    try:
        with console.status("starting Ray, Redis and the actors…"):
            driver.setup(resume=resume)
        run_dir.attach(Tracker.open(cfg, run_dir.path, resume_step=driver.step if resume else None))
        code, state, reason = _train(cfg, run_dir, driver, console, resume, evaluate)
        return code
    except BaseException as e:
        reason = "interrupted (Ctrl-C)" if isinstance(e, KeyboardInterrupt) else \
            f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        raise
    finally:
        try:
            driver.teardown()
        finally:
            _close(run_dir, console, fresh=resume is None, state=state, reason=reason)


def _close(run_dir, console, fresh: bool, state: str, reason: str | None) -> None:
    """Close the trackers; record how the run ended, or remove a new run that never checkpointed."""
    if run_dir.tracker is not None:
        run_dir.tracker.close("finished" if state == "finished" else
                              "interrupted" if reason and "interrupted" in reason else "failed")
    if fresh and state != "finished" and not run_dir.has_checkpoint():
        run_dir.remove()
        console.print(f"removed {run_dir.location}: the run failed before its first checkpoint")
    else:
        _if_room(lambda: run_dir.set_status(state, reason), console,
                 "status.json still says running: `vgrpo runs` and `vgrpo resume` read it as stale")


def _if_room(write, console, what: str) -> None:
    """A write after the run stopped: on a full disk (the stop's line said so) a note, not a traceback."""
    from learner.checkpoint import is_disk_full

    try:
        write()
    except OSError as e:
        if not is_disk_full(e):
            raise
        console.print(f"note: no space left on device: {what}")


def _train(cfg, run_dir, driver, console, resume, evaluate: bool) -> tuple[int, str, str | None]:
    """(exit code, final state, reason) of the training and evaluation proper."""
    from cluster.cli.progress import TrainProgress
    from cluster.evaluation.evaluate import paired, summary_table
    from cluster.health.hook import report_health

    before = driver.evaluate("before") if evaluate and resume is None else None
    with TrainProgress(cfg.train.steps, driver.heads(), console, start_step=driver.step) as progress:
        driver.run(progress)
    driver.checkpoint()
    if driver.checkpoint_failed and driver.stop_reason is None:  # a full disk at the last checkpoint
        driver.stop_reason = driver.checkpoint_failed
    if driver.stop_reason is not None:
        # a fault the run could not ride out: one line, and how to continue
        def summary() -> None:
            health = report_health(driver.health, driver.step, console)
            run_dir.summary_file.write_text(json.dumps({"steps": driver.step, "health": health}, indent=2))
        _if_room(summary, console, "summary.json not written")
        console.print(f"error: {driver.stop_reason}")
        console.print(f"stopped at step {driver.step}; continue with: vgrpo resume {run_dir.location}")
        return driver.stop_code, "stopped", driver.stop_reason
    if driver.stop_requested.is_set() and driver.step < cfg.train.steps:
        console.print(f"interrupted at step {driver.step}; continue with: vgrpo resume {run_dir.location}")
        by = driver.stopped_by or "Ctrl-C"
        return (130 if by == "Ctrl-C" else 143), "stopped", f"interrupted ({by}) at step {driver.step}"
    if evaluate:
        after = driver.evaluate("after")
        summary = {"steps": driver.step, "after": after.to_dict()}
        if before is not None:
            console.print(summary_table(before, after, f"evaluation: {len(after.composite)} fixed "
                                        "(prompt, seed) pairs, ODE sampling, before vs after"))
            summary["before"] = before.to_dict()
            summary["paired"] = [vars(r) | {"z": r.z} for r in paired(before, after)]
            _write_before_after(driver, run_dir, console)
        summary["health"] = report_health(driver.health, driver.step, console, before, after)
        run_dir.summary_file.write_text(json.dumps(summary, indent=2))
        if run_dir.tracker is not None:
            run_dir.tracker.summary({f"{when}/{k}": v for when in ("before", "after") if when in summary
                                     for k, v in summary[when].items()}, driver.step)
    else:
        report_health(driver.health, driver.step, console)
    console.print(f"done: {driver.step} steps; run directory {run_dir.location}")
    return 0, "finished", None


def _write_before_after(driver, run_dir, console) -> None:
    """run_dir/before_after.png: the same evaluation pairs before and after training, by eye."""
    from cluster.evaluation.before_after import write_before_after

    (b, per), (a, _) = driver.eval_frames["before"], driver.eval_frames["after"]
    path = write_before_after(run_dir.path / "before_after.png", b, a, per, getattr(driver, "eval_prompts", None),
                              trails=driver.cfg.model.family == "toy")  # the square's path: what MQ and TA score
    console.print(f"before/after grid: {path}")
