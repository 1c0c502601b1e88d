"""One optimizer step as the driver reports it: the metrics.jsonl row and its Prometheus export."""

from __future__ import annotations

from typing import Any

from common.metrics import Metrics

COUNTS = ("groups_produced", "groups_trained", "groups_refilled", "invalid_members", "actor_restarts",
          "rollout_timeouts", "updates_skipped", "groups_dropped", "groups_quarantined", "groups_resampled",
          "groups_superseded")
BANK_KEYS = ("entries", "bytes", "fresh", "corrupt", "quarantined", "redis_latency_ms")
# Prometheus counter <- the driver's running count it follows. Rollout, reward and learner
# actors export their own work from their own pools (common/actor_metrics.py); the driver
# exports only what it alone sees.
COUNTERS = (("vgrpo_actor_restarts_total", "actor_restarts"),)
DRIVER_STATS = ("reward_mean", "staleness_mean")   # composite R and version lag, driver-computed
ROLE_TIMERS = {"rollout": "generate", "reward": "score", "learner": "train"}


def step_record(step: int, elapsed: float, stats: dict[str, Any], counts: dict[str, int],
                timers: dict[str, float], videos_at_start: int, bank: dict[str, float] | None) -> dict[str, Any]:
    """The row for one step: the learner's stats plus throughput, stage times, idle ratios,
    counters and the bank's state (NaN when Redis could not be asked)."""
    record = {"step": step, "version": step, "time_s": round(elapsed, 3), **stats}
    record["videos_per_s"] = (counts["videos"] - videos_at_start) / max(elapsed, 1e-9)
    for k in ("generate", "score", "train", "publish"):
        record[f"time/{k}"] = round(timers[k], 3)
    # idle ratio per role: the share of wall time it was not working for the loop
    for role, timer in ROLE_TIMERS.items():
        record[f"idle/{role}"] = max(0.0, 1.0 - timers[timer] / max(elapsed, 1e-9))
    for k in COUNTS:
        record[k] = counts[k]
    bank = bank or dict.fromkeys(BANK_KEYS, float("nan"))
    record.update({f"bank/{k}": bank[k] for k in BANK_KEYS})
    return record


class StepExporter:
    """Sets the gauges and advances the counters of docs/metrics.md from each step's record."""

    def __init__(self, metrics: Metrics, role_metrics: dict[str, Metrics]):
        self.metrics, self.role_metrics = metrics, role_metrics
        self.exported: dict[str, int] = {}   # what each counter has been advanced to

    def export(self, record: dict[str, Any], counts: dict[str, int]) -> None:
        m = self.metrics
        m.record_stats({k: record[k] for k in DRIVER_STATS if k in record})
        for name, key in COUNTERS:
            delta = counts[key] - self.exported.get(key, 0)
            if delta:
                m.inc(name, delta)
            self.exported[key] = counts[key]
        if record["bank/fresh"] == record["bank/fresh"]:  # NaN while Redis is unreachable
            m.set("vgrpo_queue_depth", record["bank/fresh"], queue="fresh")
            m.set("vgrpo_bank_entries", record["bank/entries"])
            m.set("vgrpo_bank_bytes", record["bank/bytes"])
            m.observe("vgrpo_redis_latency_seconds", record["bank/redis_latency_ms"] / 1000, op="stats")
        m.observe("vgrpo_entry_staleness", record["staleness_max"])
        for role in ROLE_TIMERS:
            self.role_metrics[role].set("vgrpo_idle_ratio", record[f"idle/{role}"])
