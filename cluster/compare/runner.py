"""The comparison's runner and report files: every (row, seed) of a matrix as a Driver run, in
one Ray cluster in this process, then compare.md / compare.json / curves.png.

Each run has its own run directory under OUT (OUT/<row>/seed<k>), evaluated before and after on
the fixed (prompt, seed) pairs. `parallel: N` keeps N runs in flight at once, each in its own
thread; the records do not depend on N. A finished run (compare_run.json next to an identical
config.yaml) is reused, so an interrupted comparison continues where it stopped.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.compare.stats import seed_targets
from cluster.driver import pools
from cluster.driver.pools import local_cpus, local_resources
from cluster.driver.preflight import check_model_path
from cluster.runs.run_dir import RunDir
from common.config import save_config

RUN_RECORD = "compare_run.json"


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "row"


def machine() -> str:
    return (f"{platform.node()}: {platform.machine()}, {os.cpu_count()} cores, "
            f"Python {platform.python_version()}")


def _before_key(cfg) -> str:
    # the before-evaluation depends only on the base model, the schedule, the eval set and the rewards
    d = cfg.model_dump(mode="json")
    return json.dumps([d["model"], d["schedule"], d["rewards"], d["train"]["eval_prompts"],
                       d["train"]["eval_seeds"]], sort_keys=True)


class BeforeCache:
    """Before-evaluations by key, measured once: the first run to need a key measures it, and a
    run that needs it meanwhile (another thread) waits for that result instead of measuring again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done: dict[str, Any] = {}
        self._pending: dict[str, threading.Event] = {}

    def get(self, key: str, measure):
        while True:
            with self._lock:
                if key in self._done:
                    return self._done[key]
                event = self._pending.get(key)
                mine = event is None
                if mine:
                    event = self._pending[key] = threading.Event()
            if not mine:
                event.wait()  # the measuring run finished or failed; look again
                continue
            try:
                value = measure()
                with self._lock:
                    self._done[key] = value
                return value
            finally:
                with self._lock:
                    del self._pending[key]
                event.set()


class ActiveDrivers:
    """The Drivers in flight, so Ctrl-C (handled in the main thread; a Driver in a worker thread
    installs no handler) stops each at the end of its step, and no new run starts."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._drivers: set = set()
        self.stopping = threading.Event()

    def add(self, driver) -> None:
        with self._lock:
            self._drivers.add(driver)
            if self.stopping.is_set():
                driver.stop_requested.set()

    def discard(self, driver) -> None:
        with self._lock:
            self._drivers.discard(driver)

    def stop_all(self) -> None:
        with self._lock:
            self.stopping.set()
            for d in self._drivers:
                d.stop_requested.set()


def run_one(cfg, before_cache: BeforeCache | None = None, note=print,
            active: ActiveDrivers | None = None) -> dict[str, Any] | None:
    """Train one run through the run's lifecycle (cluster/driver/lifecycle.py); its record, or None
    when it was interrupted. The before-evaluation is shared between runs of the same base."""
    # lazy: torch, safetensors (kept out of vgrpo --help)
    from cluster.driver.driver import Driver
    from cluster.driver.lifecycle import live
    from cluster.evaluation.evaluate import EvalResult

    run_dir = RunDir.create(cfg)
    driver = Driver(cfg, run_dir)
    if active is not None:
        active.add(driver)
    t0 = time.monotonic()
    measure = lambda: driver.evaluate("before", gifs=0)  # noqa: E731
    try:
        end = live(driver, before=lambda: (before_cache or BeforeCache()).get(_before_key(cfg), measure),
                   after_gifs=1)
    finally:
        if active is not None:
            active.discard(driver)
    if end.interrupted:
        return None
    if end.state == "stopped":  # the run could not go on: a failed run, not Ctrl-C
        raise RuntimeError(f"stopped at step {driver.step}: {end.reason}")
    heads = list(end.after.heads)
    record = {"row": None, "seed": cfg.train.seed, "heads": heads, "steps": driver.step,
              "before": end.before.record(), "after": end.after.record(),
              "wall_s": round(time.monotonic() - t0, 1)}
    EvalResult.from_record(record["before"], heads)  # the record reads back as it will be read
    return record


def _fit_parallel(cfg, parallel: int, note) -> int:
    """How many runs the Ray cluster can hold at once, at most `parallel`.

    A cluster this command starts is sized for `parallel` runs: N × (each run's CPUs and role
    resources). Ray's CPUs are scheduling tokens, not cores: in sync mode a run's rollout actor and
    learner take turns, so N runs keep about N cores busy while asking Ray for 2N CPUs; every actor
    still runs torch on one thread. A cluster joined here (RAY_ADDRESS, or one already up) is not
    resized: N is cut to what it holds, since a run whose actors cannot be placed would wait and fail."""
    import ray  # lazy: ray (kept out of vgrpo --help)

    total = ray.cluster_resources()
    need = {"CPU": float(local_cpus(cfg)), **local_resources(cfg)}
    fits = min(int(total.get(k, 0.0) // v) for k, v in need.items() if v > 0)
    if fits < parallel:
        note(f"the Ray cluster holds {max(fits, 1)} run(s) at once ({dict(total)}), not {parallel}: "
             f"running {max(fits, 1)} at a time")
    return max(1, min(parallel, fits))


def run_matrix(matrix, out: Path, rows: list[str] | None = None, note=print,
               share_before: bool = True, parallel: int | None = None) -> dict[str, Any]:
    """Every (row, seed) of `matrix`, `parallel` at once (default: the matrix's); returns
    {"runs", "metrics", "failed", "interrupted"}, runs and metrics in plan order (row, then seed).

    First every row runs `matrix.seeds` seeds. With `most_seeds` above that, a second stage follows:
    each row whose paired interval (against the reference, or in a claim) is wider than ±0.02 runs
    the seeds its measured spread says it needs, at most `most_seeds` (compare_stats.seed_targets),
    and the partner row with it, so the pair stays paired; repeated until no row asks for more.

    The before-evaluation is the base policy on the fixed pairs with ODE sampling, the same for
    every row; with `share_before` it is measured once and reused.
    """
    rows = rows or list(matrix.rows)
    pairs = [(a, b) for a, b in matrix.pairs() if a in rows and b in rows]
    parallel = parallel or matrix.parallel
    cfgs: dict[tuple[str, int], Any] = {}

    def cfg_of(row: str, s: int):
        if (row, s) not in cfgs:
            cfgs[(row, s)] = matrix.config(row, s, [f"run.root={out / slug(row)}", f"run.name=seed{s}"])
        return cfgs[(row, s)]

    counts = {row: matrix.seeds for row in rows}
    # one cluster for every run, sized for `parallel` of them; a Driver leaves it running
    handle = pools.init_ray(cfg_of(rows[0], 0), copies=parallel)
    state = _Round(done={}, failed={}, before_cache=BeforeCache() if share_before else None,
                   active=ActiveDrivers(), parallel=parallel)
    try:
        while True:
            plan = [(row, s) for row in rows for s in range(counts[row])]
            _run_round(plan, cfg_of, state, note)
            if state.active.stopping.is_set() or matrix.most_seeds <= matrix.seeds:
                break
            runs = [state.done[k] for k in plan if k in state.done]
            targets = seed_targets(runs, pairs, counts, matrix.most_seeds)
            grow = {r: n for r, n in targets.items() if n > counts[r]}
            if not grow:
                break
            note("the intervals wider than ±0.02 ask for more seeds: "
                 + ", ".join(f"{r} {counts[r]} → {n}" for r, n in grow.items())
                 + f" (at most {matrix.most_seeds})")
            counts = targets
    finally:
        handle.shutdown()
    interrupted = state.active.stopping.is_set()
    if interrupted:
        note("interrupted: writing the table of the finished runs")
    keys = [(row, s) for row in rows for s in range(counts[row]) if (row, s) in state.done]
    runs = [state.done[k] for k in keys]
    metrics: dict[str, list] = {}
    for row, s in keys:
        cfg = cfg_of(row, s)
        metrics.setdefault(row, []).append(RunDir(Path(cfg.run.root) / cfg.run.name).read_metrics())
    return {"runs": runs, "metrics": metrics, "failed": state.failed, "interrupted": interrupted}


@dataclass
class _Round:
    """What the rounds of one comparison share."""

    done: dict[tuple[str, int], dict[str, Any]]
    failed: dict[str, str]
    before_cache: BeforeCache | None
    active: ActiveDrivers
    parallel: int
    warmed: bool = False


def _run_round(plan: list[tuple[str, int]], cfg_of, state: _Round, note) -> None:
    """Run the (row, seed) pairs of `plan` not yet done, reusing finished run directories."""
    todo: list[tuple[int, str, int]] = []
    for i, (row, s) in enumerate(plan):
        if (row, s) in state.done or f"{row} seed {s}" in state.failed:
            continue
        cfg = cfg_of(row, s)
        path = Path(cfg.run.root) / cfg.run.name
        if (path / RUN_RECORD).is_file() and _same_config(cfg, path, save_config):
            state.done[(row, s)] = json.loads((path / RUN_RECORD).read_text())
            note(f"[{i + 1}/{len(plan)}] {row} seed {s}: reusing {path}")
        else:
            todo.append((i, row, s))
    todo = run_order(todo)
    lock = threading.Lock()
    active = state.active

    def worker() -> None:
        while not active.stopping.is_set():
            with lock:
                if not todo:
                    return
                i, row, s = todo.pop(0)
            cfg = cfg_of(row, s)
            path = Path(cfg.run.root) / cfg.run.name
            if path.exists():
                shutil.rmtree(path)  # a half-finished or differently configured run: start over
            note(f"[{i + 1}/{len(plan)}] {row} seed {s}: training {cfg.train.steps} steps → {path}")
            try:
                rec = run_one(cfg, state.before_cache, note, active)
            except Exception as e:  # one failed run does not lose the others
                with lock:
                    state.failed[f"{row} seed {s}"] = f"{type(e).__name__}: {e}"
                note(f"  {row} seed {s} failed: {type(e).__name__}: {e}")
                continue
            if rec is None:
                active.stop_all()
                continue
            rec["row"] = row
            (path / RUN_RECORD).write_text(json.dumps(rec))
            with lock:
                state.done[(row, s)] = rec
            d = rec["after"]["composite"]
            note(f"  {row} seed {s} done in {rec['wall_s']:.0f}s; after: composite {sum(d) / len(d):.3f}")

    if not todo:
        return
    first = cfg_of(*plan[0])
    if not state.warmed:
        _warm_imports(first)
        state.parallel = _fit_parallel(first, state.parallel, note)
        state.warmed = True
    _run_threads(worker, min(state.parallel, len(todo)), active, note)


def run_order(todo: list[tuple[int, str, int]]) -> list[tuple[int, str, int]]:
    """(plan index, row, seed) in the order to run them: seed by seed, every row at each seed, so a
    comparison cut short (Ctrl-C, a deadline) still has every row at the seeds it finished, paired."""
    return sorted(todo, key=lambda t: (t[2], t[0]))


def _warm_imports(cfg) -> None:
    """What Driver.setup imports and loads first, done once in this thread before the runs start:
    diffusers' lazy module is not thread-safe, and two Drivers loading the model for the first time
    at once failed with "cannot import name 'WanTransformer3DModel' from 'diffusers'"."""
    # lazy: torch, ray (kept out of vgrpo --help)
    import cluster.evaluation.evaluate  # noqa: F401
    import learner.actor  # noqa: F401
    import memory_bank.connect  # noqa: F401
    import reward_worker.actor  # noqa: F401
    import rollout_worker.actor  # noqa: F401

    check_model_path(cfg)  # the toy model: builds its transformer (diffusers); others: path checks


def _run_threads(worker, n: int, active: ActiveDrivers, note) -> None:
    """n worker threads; Ctrl-C in the main thread stops every run at the end of its step (a
    second Ctrl-C aborts)."""
    def on_sigint(signum, frame) -> None:
        if active.stopping.is_set():
            raise KeyboardInterrupt
        active.stop_all()
        note("Ctrl-C: every run in flight finishes its current step and stops (Ctrl-C again to abort)")

    main = threading.current_thread() is threading.main_thread()
    prev = signal.signal(signal.SIGINT, on_sigint) if main else None
    threads = [threading.Thread(target=worker, name=f"vgrpo-compare-{k}", daemon=True) for k in range(n)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(timeout=1.0)  # wakes the main thread for Ctrl-C
    finally:
        if prev is not None:
            signal.signal(signal.SIGINT, prev)


def _same_config(cfg, path: Path, save_config) -> bool:
    with tempfile.TemporaryDirectory() as d:
        save_config(cfg, Path(d) / "c.yaml")
        want = (Path(d) / "c.yaml").read_text()
    have = path / "config.yaml"
    return have.is_file() and have.read_text() == want


def write_report(matrix, result: dict[str, Any], out: Path, command: str, elapsed_s: float,
                 parallel: int | None = None) -> Path:
    # lazy: torch, rich (kept out of vgrpo --help)
    from cluster.compare.report import (
        claims_section,
        cost_ratios,
        costs,
        gains,
        markdown_table,
        paired_table,
        plot_curves,
        ranking_section,
    )

    rows = [r for r in matrix.rows if r in result["metrics"]]
    gpus = {r: matrix.config(r, 0).pools.rollout.num_gpus for r in rows}  # per rollout actor
    heads = result["runs"][0]["heads"] if result["runs"] else []
    curves = plot_curves({r: result["metrics"][r] for r in rows}, heads, out / "curves.png",
                         title=f"{matrix.title}: training reward, mean over seeds") if rows else None
    budget = ", ".join(f"`{b}`" for b in matrix.budget) or "the base config's"
    text = [f"# {matrix.title}\n",
            f"Command: `{command}`  ",
            f"Matrix: `{matrix.source}` (base `{matrix.base_name}`); budget: {budget}; "
            f"{_seeds_line(matrix)}; {parallel or matrix.parallel} run(s) at once.  ",
            f"Machine: {machine()}; wall time {elapsed_s / 60:.1f} min.\n",
            markdown_table(result["runs"], result["metrics"], rows, gpus)]
    g = gains(result["runs"]) if result["runs"] else {}
    cost = costs(g, result["metrics"], rows, gpus)
    ratios = cost_ratios(result["runs"], result["metrics"], rows, matrix.reference, gpus)
    ranking = ranking_section(cost, matrix.reference, ratios)
    if ranking:
        text.append(ranking)
    paired_md = paired_table(result["runs"], matrix.reference, rows)
    if paired_md:
        text.append(paired_md)
    claims_md, claims_data = claims_section(result["runs"], matrix.claims)
    if claims_md:
        text.append(claims_md)
    if curves:
        text.append(f"\nTraining reward curves: `{curves.name}`.\n")
    text.append("\nRows:\n")
    text += [f"- **{r}**: {' '.join(f'`{o}`' for o in matrix.rows[r]) or '(the base)'}" for r in matrix.rows]
    if result["failed"]:
        text.append("\nFailed runs:\n")
        text += [f"- {k}: {v}" for k, v in result["failed"].items()]
    if result["interrupted"]:
        text.append("\nInterrupted: the tables cover the runs that finished.")
    md = out / "compare.md"
    md.write_text("\n".join(text) + "\n", encoding="utf-8")
    _write_json(out / "compare.json", matrix, result, rows, g, claims_data, cost, ratios)
    return md


def _write_json(path: Path, matrix, result: dict[str, Any], rows: list[str], g, claims_data, cost,
                ratios) -> None:
    """compare.json: the tables' numbers as plain data."""
    # lazy: torch, rich (kept out of vgrpo --help)
    from cluster.compare.report import paired_rows

    paired = ({row: {k: p.to_dict() for k, p in per_key.items() if p is not None}
               for row, per_key in paired_rows(result["runs"], matrix.reference, rows).items()}
              if matrix.reference else {})
    path.write_text(json.dumps(
        {"matrix": str(matrix.source), "seeds": matrix.seeds, "most_seeds": matrix.most_seeds,
         "budget": matrix.budget,
         "gains": {r: {k: {"mean": v[0], "se": v[1], "n": v[2], "se_over_pairs": v[3]} for k, v in kv.items()}
                   for r, kv in g.items()},
         "reference": matrix.reference, "paired": paired,
         "resolution": {r: pk["composite"].get("half_width") for r, pk in paired.items()},
         "claims": claims_data,
         "cost": {r: c.to_dict() for r, c in cost.items()},
         "cost_ratio": {r: c.to_dict() for r, c in ratios.items()},
         "failed": result["failed"], "interrupted": result["interrupted"]}, indent=2))


def _seeds_line(matrix) -> str:
    if matrix.most_seeds <= matrix.seeds:
        return f"{matrix.seeds} seed(s) per row"
    return (f"{matrix.seeds} seeds per row, then up to {matrix.most_seeds} for a row whose paired interval "
            "was wider than ±0.02 (the seeds column says how many it ran)")
