"""A run's lifecycle, written once: set up, evaluate before, train, checkpoint, say how it ended,
evaluate after, tear down.

`live` is the lifecycle itself; `vgrpo train` and `vgrpo resume` run it through `run_in_dir`
(which adds the run directory's status, trackers and summary), and `vgrpo compare` runs each
(row, seed) through it (cluster/compare/runner.py) with a shared before-evaluation. They differ
only in what they pass, not in the order of the stages.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Literal

from cluster.evaluation.before_after import write_before_after
from cluster.evaluation.evaluate import EvalResult, paired, summary_table
from cluster.health.hook import report_health
from cluster.runs.tracking import Tracker
from common.families import FAMILIES
from learner.checkpoint import is_disk_full


@dataclass
class Ending:
    """How a run ended, and its evaluations."""

    code: int                              # the exit code `vgrpo train` returns
    state: Literal["finished", "stopped"]
    reason: str | None                     # one line: why it stopped (None when finished)
    before: EvalResult | None = None
    after: EvalResult | None = None        # only a finished run is evaluated after
    interrupted: bool = False              # by Ctrl-C or SIGTERM, not by a fault


def ending(driver) -> Ending:
    """A stop the run could not ride out (its code), an interruption before the last step
    (130 for Ctrl-C, 143 for SIGTERM), else finished."""
    if driver.stop_reason is not None:
        return Ending(driver.stop_code, "stopped", driver.stop_reason)
    if driver.stop_requested.is_set() and driver.step < driver.cfg.train.steps:
        by = driver.stopped_by or "Ctrl-C"
        return Ending(130 if by == "Ctrl-C" else 143, "stopped", f"interrupted ({by}) at step {driver.step}",
                      interrupted=True)
    return Ending(0, "finished", None)


def live(driver, *, resume=None, before: Callable[[], EvalResult] | None = None, evaluate_after: bool = True,
         after_gifs: int = 4, progress: Callable[[], AbstractContextManager] = nullcontext,
         starting: AbstractContextManager | None = None, started: Callable[[], None] = lambda: None) -> Ending:
    """Run `driver` from setup to teardown. `before`: measures the before-evaluation (None: none);
    `progress`: a context manager whose value the loop reports to; `starting`: wraps setup (a
    spinner); `started`: called once setup is done (trackers attach there)."""
    try:
        # 1. set up: Ray, the bank, the pools (or what a resume restores)
        with starting or nullcontext():
            driver.setup(resume=resume)
        started()
        # 2. evaluate before (the base policy on the fixed pairs)
        measured = before() if before is not None else None
        # 3. train
        with progress() as p:
            driver.run(p)
        # 4. the last checkpoint; a full disk there stops the run like any fault
        driver.checkpoint()   # a stop signal meanwhile is logged and ignored (Driver._on_signal)
        driver.phase = "after"  # from here a signal aborts (teardown below still runs)
        if driver.checkpoint_failed and driver.stop_reason is None:
            driver.stop_reason = driver.checkpoint_failed
        # 5. how it ended
        end = ending(driver)
        end.before = measured
        # 6. evaluate after, only a finished run
        if end.state == "finished" and evaluate_after:
            end.after = driver.evaluate("after", gifs=after_gifs)
        return end
    finally:
        # 7. tear down exactly what setup started
        driver.teardown()


def run_in_dir(driver, run_dir, console, progress: Callable[[], AbstractContextManager], *, resume=None,
               evaluate: bool = True) -> int:
    """`vgrpo train` / `vgrpo resume`: the lifecycle with the run directory's status, trackers and
    summary; status.json says how it ended, and a new run that failed before it wrote a
    checkpoint is removed again (nothing in it can be resumed). `progress`: the command's progress
    display. Returns the exit code."""
    cfg = driver.cfg
    run_dir.set_status("running")
    state, reason = "stopped", None
    try:
        end = live(driver, resume=resume, evaluate_after=evaluate,
                   before=(lambda: driver.evaluate("before")) if evaluate and resume is None else None,
                   progress=progress,
                   starting=console.status("starting Ray, Redis and the actors…"),
                   started=lambda: run_dir.attach(Tracker.open(cfg, run_dir.path,
                                                               resume_step=driver.step if resume else None)))
        state, reason = end.state, end.reason
        _report(driver, run_dir, console, end, evaluate)
        return end.code
    except BaseException as e:
        reason = "interrupted (Ctrl-C)" if isinstance(e, KeyboardInterrupt) else \
            f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        raise
    finally:
        _close(run_dir, console, fresh=resume is None, state=state, reason=reason)


def _report(driver, run_dir, console, end: Ending, evaluate: bool) -> None:
    """The console's last lines and summary.json: the stop and how to continue, or the
    before/after table, the health table and the before/after grid."""
    if end.state == "stopped" and not end.interrupted:  # a fault the run could not ride out
        def summary() -> None:
            health = report_health(driver.health, driver.step, console)
            run_dir.summary_file.write_text(json.dumps({"steps": driver.step, "health": health}, indent=2))
        _if_room(summary, console, "summary.json not written")
        console.print(f"error: {end.reason}")
        console.print(f"stopped at step {driver.step}; continue with: vgrpo resume {run_dir.location}")
        return
    if end.interrupted:
        console.print(f"interrupted at step {driver.step}; continue with: vgrpo resume {run_dir.location}")
        return
    if evaluate:
        before, after = end.before, end.after
        summary = {"steps": driver.step, "after": after.to_dict()}
        if before is not None:
            console.print(summary_table(before, after, f"evaluation: {len(after.composite)} fixed "
                                        "(prompt, seed) pairs, ODE sampling, before vs after"))
            summary["before"] = before.to_dict()
            summary["paired"] = [vars(r) | {"z": r.z} for r in paired(before, after)]
            write_grid(driver, run_dir, console)
        summary["health"] = report_health(driver.health, driver.step, console, before, after)
        run_dir.summary_file.write_text(json.dumps(summary, indent=2))
        if run_dir.tracker is not None:
            run_dir.tracker.summary({f"{when}/{k}": v for when in ("before", "after") if when in summary
                                     for k, v in summary[when].items()}, driver.step)
    else:
        report_health(driver.health, driver.step, console)
    console.print(f"done: {driver.step} steps; run directory {run_dir.location}")


def write_grid(driver, run_dir, console) -> None:
    """run_dir/before_after.png: the same evaluation pairs before and after training, by eye."""
    (b, per), (a, _) = driver.eval_frames["before"], driver.eval_frames["after"]
    path = write_before_after(run_dir.path / "before_after.png", b, a, per, getattr(driver, "eval_prompts", None),
                              trails=FAMILIES[driver.cfg.model.family].draws_trails)
    console.print(f"before/after grid: {path}")


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
    try:
        write()
    except OSError as e:
        if not is_disk_full(e):
            raise
        console.print(f"note: no space left on device: {what}")
