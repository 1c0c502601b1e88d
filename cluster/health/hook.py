"""The driver's side of the health checks (cluster/health/checks.py): feed each step's record to the
monitor, run the held-out ODE evaluation every `health.eval_every` steps, report findings in the
console, the step's row, Prometheus and RUN_DIR/health.json, and stop the run on a `stop` finding.

The driver calls it in a few lines; everything that needs Ray is in `heldout_eval`, which
samples the held-out EvalSet (cluster/evaluation/eval_set.py, first frames included).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cluster.evaluation.eval_set import EvalSet
from cluster.evaluation.evaluate import EvalResult, score_pairs
from cluster.health.checks import CHECKS, Finding, HealthMonitor, health_table
from common import storage
from common.config import RunConfig
from learner.advantages import SPREAD_PREFIX

HEALTH_FILE = "health.json"
# record key → (metric, labels) for the gauges of the health row in the dashboard
GAUGES = {"logratio_onpolicy_absmax": ("vgrpo_onpolicy_logratio_absmax", {}),
          "clipfrac_onpolicy": ("vgrpo_onpolicy_clip_fraction", {}),
          "approx_kl_onpolicy": ("vgrpo_onpolicy_approx_kl", {}),
          "health/status": ("vgrpo_health_status", {}),
          "health/kl_growth/anchor": ("vgrpo_kl_growth", {"term": "anchor"}),
          "health/kl_growth/pi0": ("vgrpo_kl_growth", {"term": "pi0"}),
          "health/kl_growth/step": ("vgrpo_kl_growth", {"term": "step"})}


class DriverHealth:
    def __init__(self, cfg: RunConfig, run_dir, note: Callable[[str], None], stop_exc: type[Exception],
                 skipped_in_a_row: Callable[[], int] | None = None):
        """skipped_in_a_row: the driver's count of steps skipped in a row (its DriverState, which a
        checkpoint keeps, so a resume goes on counting); None: the monitor counts the rows it sees."""
        self.cfg, self.run_dir, self.note, self.stop_exc = cfg, run_dir, note, stop_exc
        self.skipped_in_a_row = skipped_in_a_row
        self.monitor = HealthMonitor(cfg)
        self.on = cfg.health.enabled
        self.held_out_lines: list[str] = []  # held-out findings, carried into the next step's row
        self._evals: EvalSet | None = None   # the held-out pairs, loaded at the first evaluation

    # --- every step ------------------------------------------------------------------------

    def on_step(self, record: dict[str, Any], metrics=None) -> None:
        """Check the step's record and add the health keys to it (before it is logged)."""
        if not self.on:
            return
        first = self.monitor.numerics is None
        found = self.monitor.observe(record, self.skipped_in_a_row() if self.skipped_in_a_row else None)
        record.update(self.monitor.record_keys(found))
        if self.held_out_lines:
            record["health/findings"] = self.held_out_lines + record.get("health/findings", [])
            self.held_out_lines = []
        self._report(found, metrics)
        if metrics is not None:
            export(metrics, record, self.monitor)
        if found or (first and self.monitor.numerics is not None):
            self.write()  # the first update's measurement is what a later run's preflight reads

    def raise_if_stopped(self) -> None:
        if self.on and self.monitor.stop_reason is not None:
            raise self.stop_exc(self.monitor.stop_reason)

    # --- held out ----------------------------------------------------------------------------

    def heldout(self, step: int, rollouts: list, heads, metrics, start: bool = False,
                policy: Callable[[], Any] | None = None) -> None:
        """At the start of the run (the baseline) and every health.eval_every steps after it:
        the rollout actors sample the held-out pairs, scored with the run's RewardHeads.
        policy: returns the weights to evaluate (a WeightsRecord) where the actors hold others,
        or None (default): the weights they hold."""
        every = self.cfg.health.eval_every
        if not self.on or every == 0 or (not start and step % every) \
                or any(s == step for s, _ in self.monitor.evals):
            return
        if start and step + every > self.cfg.train.steps:
            return  # no held-out evaluation would follow to compare with
        evals = self.eval_set()  # outside the try: a bad prompt set is the user's to fix, not skipped
        try:
            result = heldout_eval(rollouts, heads, evals, policy() if policy is not None else None)
        except Exception as e:  # a dead actor or a reward timeout: the loop's own handling deals with it
            self.note(f"health: held-out evaluation at step {step} skipped: {type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else ''}")
            return
        found = self.monitor.observe_eval(step, result)
        self.held_out_lines += [f.line() for f in found]
        self.note(f"health: held-out evaluation at step {step}: composite {result.composite.mean():.3f} "
                  f"on {len(result.composite)} pairs")
        self._report(found, metrics)
        for key, z in self.monitor.values.items():
            if key.startswith("heldout_z/"):
                metrics.set("vgrpo_heldout_z", _bounded(z, 0.0), head=key.split("/", 1)[1])
        self.write()
        self.raise_if_stopped()

    def eval_set(self) -> EvalSet:
        """The held-out pairs: health.eval_prompts (else train.eval_prompts) × health.eval_seeds."""
        if self._evals is None:
            h = self.cfg.health
            self._evals = EvalSet.load(h.eval_prompts or self.cfg.train.eval_prompts, h.eval_seeds,
                                       self.cfg.model, self.cfg.data)
        return self._evals

    def final(self, before, after, step: int) -> None:
        if self.on and before is not None and after is not None:
            self._report(self.monitor.final(before, after, step), None)

    # --- surfaces ----------------------------------------------------------------------------

    def _report(self, found: list[Finding], metrics) -> None:
        for f in found:
            self.note(f.line())
        if metrics is not None:  # every check that is on, 0 until it fires: each series exists
            for check in CHECKS:
                if (level := self.cfg.health.level(check)) != "off":
                    n = sum(1 for f in self.monitor.findings if f.check == check)
                    metrics.set("vgrpo_health_findings", float(n), check=check, level=level)

    def summary(self) -> dict[str, Any]:
        return self.monitor.summary()

    def write(self) -> Path:
        path = Path(self.run_dir.path) / HEALTH_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.summary(), indent=2, default=_nan_safe))
        tmp.replace(path)
        return path


def _nan_safe(v: Any) -> Any:
    return None if isinstance(v, float) and not math.isfinite(v) else str(v)


def _bounded(v: Any, neutral: float = math.nan) -> float:
    """A gauge value: `neutral` when not measured (yet), ±inf (an exact trend) clipped to ±1e6."""
    if not isinstance(v, (int, float)) or math.isnan(v):
        return neutral
    return max(-1e6, min(1e6, float(v)))


def export(metrics, record: dict[str, Any], monitor: HealthMonitor | None = None) -> None:
    """The health gauges of one step's record. A trend, growth or held-out z not measured yet
    (a window not full, one held-out evaluation) is exported as its neutral value (z 0, growth 1),
    so every series the dashboard queries exists from the first step (Ray drops NaN gauges)."""
    for key, (name, labels) in GAUGES.items():
        v = _bounded(record.get(key), 1.0 if key.startswith("health/kl_growth/") else math.nan)
        if not math.isnan(v):
            metrics.set(name, v, **labels)
    heads = ["composite", *(k[len("reward/"):] for k in record if k.startswith("reward/"))]
    for head in heads:
        metrics.set("vgrpo_reward_trend_z", _bounded(record.get(f"health/trend_z/{head}"), 0.0), head=head)
        if monitor is not None and not monitor.evals[1:]:  # before the second held-out evaluation
            metrics.set("vgrpo_heldout_z", 0.0, head=head)
    for key, v in record.items():
        if key.startswith(SPREAD_PREFIX) and isinstance(v, (int, float)):
            metrics.set("vgrpo_zero_spread_ratio", _bounded(v), head=key[len(SPREAD_PREFIX):])


def heldout_eval(rollouts: list, heads, evals, weights=None):
    """Deterministic (ODE) samples of the fixed held-out pairs (`evals`, an EvalSet: I2V pairs
    with their first frames) with the weights the rollout actors hold, or `weights` (a
    WeightsRecord) loaded for this evaluation alone; scored by the reward role from the actors (no
    GIFs, no video: cheaper than Driver.evaluate); `heads`: the run's RewardHeads, for the composite."""
    scores, _ = score_pairs(rollouts, evals, weights=weights)  # scored by the actors: no frames come back
    return EvalResult(scores.heads, scores.values.numpy(), heads.composite(scores).numpy())


def report_health(h: DriverHealth, step: int, console, before=None, after=None) -> dict[str, Any] | None:
    """At the end of a run: the before/after hacking check, RUN_DIR/health.json, the console
    table; returns the summary.json section (None with health.enabled=false)."""
    if not h.on:
        return None
    h.final(before, after, step)
    h.write()
    summary = h.summary()
    console.print(health_table(summary))
    return summary


def read_health(run_path: Path) -> dict[str, Any] | None:
    """A run directory's health section (health.json), or None when it has none or it is damaged."""
    try:
        data = json.loads((storage.location(run_path) / HEALTH_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
