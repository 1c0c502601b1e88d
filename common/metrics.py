"""Every Prometheus metric vgrpo exports, in one catalogue, and a small recording API.

Roles record through `Metrics`; the backend decides where values go:
- `ray`: `ray.util.metrics` inside Ray actors and the driver; Ray's per-node metrics agent
  exports them as `ray_<name>` (counters keep one `_total`). This is the production path.
- `prometheus`: prometheus-client in a plain process (no Ray), optionally serving its own
  `/metrics` endpoint; names are exported unprefixed.
- `memory`: in-process values for tests and runs without Ray; `none`: checks names, keeps nothing.

Every metric carries the labels `role` and `pool`; some add one more (see `CATALOGUE`).
Unknown names and wrong labels raise, so a typo fails where it is made. docs/metrics.md
lists the catalogue and the exported names the Grafana dashboard queries.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

MetricType = Literal["counter", "gauge", "histogram"]
Backend = Literal["ray", "prometheus", "memory", "none"]

BASE_LABELS = ("role", "pool")
RAY_EXPORT_PREFIX = "ray_"  # Ray's metrics agent puts its namespace in front of custom names

_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_FAST_SECONDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
# Versions are integers; bounds between them put each staleness in its own bucket.
_VERSIONS = (0.5, 1.5, 2.5, 3.5, 4.5, 6.5, 8.5, 12.5, 16.5, 32.5, 64.5)


@dataclass(frozen=True)
class MetricSpec:
    name: str
    type: MetricType
    help: str
    labels: tuple[str, ...] = ()            # extra labels beyond role and pool
    buckets: tuple[float, ...] = ()         # histograms only; all > 0 (Ray requires it)

    @property
    def all_labels(self) -> tuple[str, ...]:
        return BASE_LABELS + self.labels


_SPECS = [
    # -- throughput (counters; the dashboard takes rate() per pool)
    MetricSpec("vgrpo_rollouts_total", "counter", "Groups (rollouts of G members) generated."),
    MetricSpec("vgrpo_videos_total", "counter", "Videos generated and decoded."),
    MetricSpec("vgrpo_videos_scored_total", "counter", "Videos scored by the reward role."),
    MetricSpec("vgrpo_train_steps_total", "counter", "Learner optimizer steps taken."),
    MetricSpec("vgrpo_groups_trained_total", "counter", "Groups consumed by learner steps."),
    MetricSpec("vgrpo_stage_seconds", "histogram", "Wall time of one driver loop stage.",
               ("stage",), _SECONDS),
    # -- rewards
    MetricSpec("vgrpo_reward", "gauge",
               "Mean reward of the last scored batch, per head (head=composite for R).",
               ("head",)),
    MetricSpec("vgrpo_advantage_std", "gauge", "Std of the advantages in the last batch."),
    MetricSpec("vgrpo_zero_std_group_ratio", "gauge",
               "Fraction of groups in the last batch whose rewards have zero spread."),
    MetricSpec("vgrpo_invalid_rewards_total", "counter",
               "Videos dropped because a reward head returned a non-finite score.", ("head",)),
    # -- learner
    MetricSpec("vgrpo_loss", "gauge", "Total loss of the last optimizer step."),
    MetricSpec("vgrpo_ratio_mean", "gauge", "Mean importance ratio exp(logp - logp_old)."),
    MetricSpec("vgrpo_clip_fraction", "gauge", "Fraction of ratios outside the clip range."),
    MetricSpec("vgrpo_approx_kl", "gauge", "Approximate KL between old and new policy."),
    MetricSpec("vgrpo_kl", "gauge", "KL regulariser terms (term=anchor: D_anchor, step: D_step).",
               ("term",)),
    MetricSpec("vgrpo_lambda_kl", "gauge", "KL coefficient lambda_KL after the last update."),
    MetricSpec("vgrpo_align_loss", "gauge", "Trajectory-alignment term J_align."),
    MetricSpec("vgrpo_grad_norm", "gauge", "Gradient norm before clipping."),
    # -- versions, staleness, queues, sync
    MetricSpec("vgrpo_policy_version", "gauge", "Policy version this actor holds."),
    MetricSpec("vgrpo_version_lag", "gauge",
               "Versions this actor's policy is behind the learner's."),
    MetricSpec("vgrpo_entry_staleness", "histogram",
               "Versions between a trained entry's policy_version and the learner's.",
               (), _VERSIONS),
    MetricSpec("vgrpo_queue_depth", "gauge", "Items waiting in a driver queue.", ("queue",)),
    MetricSpec("vgrpo_idle_ratio", "gauge", "Fraction of wall time the role waited for work."),
    MetricSpec("vgrpo_weight_sync_seconds", "histogram",
               "Seconds to publish (learner) or load (rollout) one weight version.",
               (), _SECONDS),
    MetricSpec("vgrpo_weight_sync_bytes", "gauge", "Bytes in the last weight push."),
    # -- memory bank
    MetricSpec("vgrpo_bank_entries", "gauge", "Entries held in the memory bank."),
    MetricSpec("vgrpo_bank_bytes", "gauge", "Bytes of blobs held in the memory bank."),
    MetricSpec("vgrpo_bank_evictions_total", "counter", "Bank entries trimmed by capacity."),
    MetricSpec("vgrpo_redis_latency_seconds", "histogram", "Latency of one Redis round trip.",
               ("op",), _FAST_SECONDS),
    # -- health
    MetricSpec("vgrpo_actor_restarts_total", "counter", "Actor restarts observed by the driver."),
    MetricSpec("vgrpo_errors_total", "counter", "Errors caught and retried, by kind.", ("kind",)),
]

# -- training health (cluster/health/checks.py, cluster/health/hook.py)
_SPECS += [
    MetricSpec("vgrpo_health_status", "gauge", "Run health so far: 0 ok, 1 a warning fired, 2 a stop check fired."),
    MetricSpec("vgrpo_health_findings", "gauge",
               "Health findings so far in this run, per check (level: the check's configured warn or stop).",
               ("check", "level")),
    MetricSpec("vgrpo_onpolicy_logratio_absmax", "gauge",
               "Max abs(log r) over the rows the learner's current weights sampled (0 up to numerics)."),
    MetricSpec("vgrpo_onpolicy_clip_fraction", "gauge", "Fraction of on-policy rows outside the clip range."),
    MetricSpec("vgrpo_onpolicy_approx_kl", "gauge", "Approximate KL on on-policy rows."),
    MetricSpec("vgrpo_zero_spread_ratio", "gauge",
               "Fraction of the step's groups with no reward spread, per head (head=composite for R).",
               ("head",)),
    MetricSpec("vgrpo_reward_trend_z", "gauge", "Slope z-score of a reward head over health.window steps.",
               ("head",)),
    MetricSpec("vgrpo_kl_growth", "gauge", "KL growth factor over health.window steps (term=anchor, step).",
               ("term",)),
    MetricSpec("vgrpo_heldout_z", "gauge", "Paired z of the held-out evaluation against the run's first one.",
               ("head",)),
]

CATALOGUE: dict[str, MetricSpec] = {s.name: s for s in _SPECS}

# TrainStats keys (and other per-step stats) → (metric, extra labels).
# `reward_mean/<head>` keys go to vgrpo_reward{head=<head>}.
STAT_KEYS: dict[str, tuple[str, dict[str, str]]] = {
    "loss": ("vgrpo_loss", {}),
    "clipfrac": ("vgrpo_clip_fraction", {}),
    "ratio_mean": ("vgrpo_ratio_mean", {}),
    "approx_kl": ("vgrpo_approx_kl", {}),
    "grad_norm": ("vgrpo_grad_norm", {}),
    "kl/lambda": ("vgrpo_lambda_kl", {}),
    "kl/d_anchor": ("vgrpo_kl", {"term": "anchor"}),
    "kl/d_step": ("vgrpo_kl", {"term": "step"}),
    "loss/align": ("vgrpo_align_loss", {}),
    "adv_std": ("vgrpo_advantage_std", {}),
    "zero_std_frac": ("vgrpo_zero_std_group_ratio", {}),
    "reward_mean": ("vgrpo_reward", {"head": "composite"}),
    "version": ("vgrpo_policy_version", {}),
    "staleness_mean": ("vgrpo_version_lag", {}),
    "idle_ratio": ("vgrpo_idle_ratio", {}),
}
# -- training health: the learner's KL to π_0, on the steps that measure it (health.kl_pi0_every)
STAT_KEYS["kl/d_pi0"] = ("vgrpo_kl", {"term": "pi0"})
_REWARD_HEAD_PREFIX = "reward/"


def spec(name: str) -> MetricSpec:
    try:
        return CATALOGUE[name]
    except KeyError:
        raise KeyError(f"unknown metric {name!r}: add it to common/metrics.py CATALOGUE "
                       "(and docs/metrics.md)") from None


def exported_names(name: str, backend: Backend = "ray") -> list[str]:
    """The series names Prometheus sees for a catalogue metric under a backend."""
    s = spec(name)
    base = (RAY_EXPORT_PREFIX if backend == "ray" else "") + s.name
    if s.type == "counter":
        return [base if base.endswith("_total") else base + "_total"]
    if s.type == "histogram":
        return [base + "_bucket", base + "_sum", base + "_count"]
    return [base]


# -- backends: one object per metric name per process (Ray and prometheus-client both
# register by name, so a second Metrics instance must reuse the first one's objects).

_lock = threading.Lock()
_ray_objects: dict[str, object] = {}
_prom_objects: dict[str, object] = {}
_prom_registry = None
_prom_servers: dict[int, object] = {}


def _ray_metric(s: MetricSpec):
    from ray.util import metrics as rm  # heavy: ray

    with _lock:
        if s.name not in _ray_objects:
            if s.type == "counter":
                obj = rm.Counter(s.name, description=s.help, tag_keys=s.all_labels)
            elif s.type == "gauge":
                obj = rm.Gauge(s.name, description=s.help, tag_keys=s.all_labels)
            else:
                obj = rm.Histogram(s.name, description=s.help, boundaries=list(s.buckets),
                                   tag_keys=s.all_labels)
            _ray_objects[s.name] = obj
        return _ray_objects[s.name]


def prometheus_registry():
    """The CollectorRegistry the prometheus backend records into (one per process)."""
    global _prom_registry
    from prometheus_client import CollectorRegistry  # heavy: prometheus_client

    with _lock:
        if _prom_registry is None:
            _prom_registry = CollectorRegistry()
        return _prom_registry


def _prom_metric(s: MetricSpec):
    import prometheus_client as pc  # heavy: prometheus_client

    reg = prometheus_registry()
    with _lock:
        if s.name not in _prom_objects:
            if s.type == "counter":
                obj = pc.Counter(s.name, s.help, s.all_labels, registry=reg)
            elif s.type == "gauge":
                obj = pc.Gauge(s.name, s.help, s.all_labels, registry=reg)
            else:
                obj = pc.Histogram(s.name, s.help, s.all_labels, buckets=s.buckets, registry=reg)
            _prom_objects[s.name] = obj
        return _prom_objects[s.name]


def serve_prometheus(port: int, addr: str = "127.0.0.1") -> int:
    """Serve this process's prometheus-backend metrics on http://addr:port/metrics.

    Loopback by default: expose it on purpose (addr="0.0.0.0") inside a pod only.
    Returns the bound port (pass port=0 to pick a free one). Idempotent per port.
    """
    from prometheus_client import start_http_server  # heavy: prometheus_client

    with _lock:
        if port and port in _prom_servers:
            return port
    server, _thread = start_http_server(port, addr=addr, registry=prometheus_registry())
    bound = server.server_address[1]
    with _lock:
        _prom_servers[bound] = server
    return bound


class Metrics:
    """Records catalogue metrics for one role and pool.

        m = Metrics(backend="ray", role="rollout", pool="rollout")
        m.inc("vgrpo_videos_total", 8)
        m.set("vgrpo_reward", 0.71, head="vq")
        m.observe("vgrpo_weight_sync_seconds", 1.3)
        m.record_stats(train_stats.values)
    """

    def __init__(self, backend: Backend = "memory", role: str = "driver", pool: str | None = None,
                 serve_port: int | None = None, serve_addr: str = "127.0.0.1"):
        if backend not in ("ray", "prometheus", "memory", "none"):
            raise ValueError(f"metrics backend must be ray, prometheus, memory or none, "
                             f"got {backend!r}")
        if serve_port is not None and backend != "prometheus":
            raise ValueError("serve_port only applies to backend='prometheus'; the ray backend "
                             "is served by Ray's metrics agent")
        self.backend: Backend = backend
        self.role = role
        # The Helm chart sets VGRPO_POOL to the worker group's name on every Ray pod.
        self.pool = pool or os.environ.get("VGRPO_POOL") or role
        self.port: int | None = None
        if serve_port is not None:
            self.port = serve_prometheus(serve_port, serve_addr)
        # memory backend: (name, sorted label items) → value; histograms keep count/sum/buckets
        self._values: dict[tuple[str, tuple[tuple[str, str], ...]], object] = {}

    @classmethod
    def auto(cls, role: str, pool: str | None = None) -> Metrics:
        """Ray metrics when Ray is up in this process, else in-memory."""
        try:
            import ray  # heavy: ray

            up = ray.is_initialized()
        except ImportError:
            up = False
        return cls(backend="ray" if up else "memory", role=role, pool=pool)

    # -- recording

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        s, tags = self._check(name, "counter", labels)
        if value < 0 or not math.isfinite(value):
            raise ValueError(f"{name}: a counter only goes up by a finite amount, got {value}")
        if value == 0:
            return  # Ray rejects inc(0); nothing to record anyway
        self._record(s, tags, float(value))

    def set(self, name: str, value: float, **labels: str) -> None:
        s, tags = self._check(name, "gauge", labels)
        self._record(s, tags, float(value))

    def observe(self, name: str, value: float, **labels: str) -> None:
        s, tags = self._check(name, "histogram", labels)
        self._record(s, tags, float(value))

    def record_stats(self, stats: Mapping[str, float]) -> list[str]:
        """Set the gauges for known stat keys (see STAT_KEYS); returns the keys it skipped."""
        skipped = []
        for key, value in stats.items():
            if key in STAT_KEYS:
                name, labels = STAT_KEYS[key]
            elif key.startswith(_REWARD_HEAD_PREFIX):
                name, labels = "vgrpo_reward", {"head": key[len(_REWARD_HEAD_PREFIX):]}
            else:
                skipped.append(key)
                continue
            self.set(name, float(value), **labels)
        return skipped

    # -- reading (memory backend)

    def value(self, name: str, **labels: str) -> float | dict[str, object]:
        """The recorded value (gauge/counter) or {count, sum, buckets} (histogram)."""
        if self.backend != "memory":
            raise RuntimeError(f"value() reads the memory backend; this one is {self.backend!r}")
        s, tags = self._check(name, spec(name).type, labels)
        key = (s.name, tuple(sorted(tags.items())))
        if key not in self._values:
            raise KeyError(f"{name} has no value for labels {tags}")
        v = self._values[key]
        return dict(v, buckets=dict(v["buckets"])) if isinstance(v, dict) else v

    # -- internals

    def _check(self, name: str, kind: MetricType, labels: Mapping[str, str]):
        s = spec(name)
        if s.type != kind:
            raise TypeError(f"{name} is a {s.type}, not a {kind}")
        if set(labels) != set(s.labels):
            raise ValueError(f"{name} takes labels {list(s.labels)} (role and pool are set by "
                             f"Metrics), got {sorted(labels)}")
        tags = {"role": self.role, "pool": self.pool}
        tags.update({k: str(v) for k, v in labels.items()})
        return s, tags

    def _record(self, s: MetricSpec, tags: dict[str, str], value: float) -> None:
        if self.backend == "none":
            return
        if self.backend == "memory":
            self._record_memory(s, tags, value)
        elif self.backend == "ray":
            obj = _ray_metric(s)
            if s.type == "counter":
                obj.inc(value, tags=tags)
            elif s.type == "gauge":
                obj.set(value, tags=tags)
            else:
                obj.observe(value, tags=tags)
        else:
            obj = _prom_metric(s).labels(**tags)
            if s.type == "counter":
                obj.inc(value)
            elif s.type == "gauge":
                obj.set(value)
            else:
                obj.observe(value)

    def _record_memory(self, s: MetricSpec, tags: dict[str, str], value: float) -> None:
        key = (s.name, tuple(sorted(tags.items())))
        if s.type == "gauge":
            self._values[key] = value
        elif s.type == "counter":
            self._values[key] = self._values.get(key, 0.0) + value
        else:
            h = self._values.setdefault(
                key, {"count": 0, "sum": 0.0, "buckets": dict.fromkeys(s.buckets, 0)})
            h["count"] += 1
            h["sum"] += value
            for b in s.buckets:  # cumulative, as Prometheus counts `le`
                if value <= b:
                    h["buckets"][b] += 1
