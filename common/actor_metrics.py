"""Metrics each role exports from its own process, labelled with its own pool.

Every rollout, reward and learner actor records what it did through `Metrics` with
`role=<its role>` and `pool=$VGRPO_POOL` (the KubeRay worker group; the Helm chart sets it per
group, and Ray's worker processes inherit it from the pod). Locally, with no VGRPO_POOL, the
pool is the role. Ray's metrics agent on each pod exports them, so one PodMonitor sees every
pool.

The actors take these as decorators on their verbs, one line each, so the verbs' bodies stay
free of metric code:

    @exports_generate
    def generate(self, condition, seed, group_id=None) -> Group: ...

A decorator times the verb, lets it run unchanged, and records from what it returned. A metric
that cannot be recorded logs a warning and never fails the verb.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from common.metrics import Metrics

log = logging.getLogger(__name__)

_cache: dict[tuple[str, str | None, str], Metrics] = {}


def role_metrics(role: str, pool: str | None = None) -> Metrics:
    """This process's Metrics for `role`: the Ray backend when Ray is up here, else in memory.

    pool=None takes $VGRPO_POOL, else the role (see common.metrics.Metrics)."""
    try:
        import ray  # heavy: ray

        backend = "ray" if ray.is_initialized() else "memory"
    except ImportError:
        backend = "memory"
    key = (role, pool, backend)
    if key not in _cache:
        _cache[key] = Metrics(backend=backend, role=role, pool=pool)
    return _cache[key]


Recorder = Callable[[Metrics, Any, Any, float, tuple, dict], None]


def _exports(role: str, record: Recorder):
    def decorate(fn):
        @functools.wraps(fn)
        def verb(self, *args, **kwargs):
            t0 = time.perf_counter()
            out = fn(self, *args, **kwargs)
            try:
                record(role_metrics(role), self, out, time.perf_counter() - t0, args, kwargs)
            except Exception as e:  # metrics must never fail the work they describe
                log.warning("%s metrics for %s not recorded: %s: %s", role, fn.__name__,
                            type(e).__name__, e)
            return out
        return verb
    return decorate


def _payload_bytes(payload: Any) -> int:
    return sum(int(t.numel() * t.element_size()) for t in (payload or {}).values()
               if hasattr(t, "element_size"))


# -- rollout


def _generated(m: Metrics, actor, group, seconds: float, args, kwargs) -> None:
    m.inc("vgrpo_rollouts_total", 1)
    m.inc("vgrpo_videos_total", len(group.members))
    m.observe("vgrpo_stage_seconds", seconds, stage="generate")
    m.set("vgrpo_policy_version", group.policy_version)


def _loaded(m: Metrics, actor, loaded: bool, seconds: float, args, kwargs) -> None:
    if loaded:  # a stale push is ignored and costs nothing worth timing
        m.observe("vgrpo_weight_sync_seconds", seconds)
        payload = args[0] if args else kwargs.get("payload")
        if isinstance(payload, dict):
            m.set("vgrpo_weight_sync_bytes", _payload_bytes(payload))
        elif callable(getattr(payload, "nbytes", None)):  # PackedWeights (the object-store path)
            m.set("vgrpo_weight_sync_bytes", payload.nbytes())
    m.set("vgrpo_policy_version", actor.version())


exports_generate = _exports("rollout", _generated)
exports_weight_load = _exports("rollout", _loaded)


# -- reward


def _scored(m: Metrics, actor, scores, seconds: float, args, kwargs) -> None:
    values = scores.values
    m.inc("vgrpo_videos_scored_total", int(values.shape[0]))
    m.observe("vgrpo_stage_seconds", seconds, stage="score")
    valid = scores.valid
    m.inc("vgrpo_invalid_rewards_total", int((~valid).sum()), head=actor.cfg.name)
    if bool(valid.any()):
        means = values[valid].float().mean(dim=0)
        for head, v in zip(scores.heads, means.tolist(), strict=True):
            if math.isfinite(v):
                m.set("vgrpo_reward", v, head=head)


exports_score = _exports("reward", _scored)


# -- learner (rank 0 speaks for the group: its stats are already all-reduced)


def _trained(m: Metrics, rank, stats: dict, seconds: float, args, kwargs) -> None:
    if rank.rank != 0:
        return
    m.inc("vgrpo_train_steps_total", 1)
    batch = args[0] if args else kwargs.get("batch")
    m.inc("vgrpo_groups_trained_total", len(getattr(batch, "fresh", ()) or ()))
    m.observe("vgrpo_stage_seconds", seconds, stage="train")
    m.record_stats(stats)


def _payload(m: Metrics, rank, payload, seconds: float, args, kwargs) -> None:
    if payload is not None:  # rank 0's gathered weights: what a push sends
        m.set("vgrpo_weight_sync_bytes", _payload_bytes(payload))


def _recorded(m: Metrics, rank, record, seconds: float, args, kwargs) -> None:
    if record is not None:  # rank 0's object-store push: the bytes the actors will load
        m.observe("vgrpo_stage_seconds", seconds, stage="publish")
        m.set("vgrpo_weight_sync_bytes", record.weights.nbytes())


def _published(m: Metrics, rank, report, seconds: float, args, kwargs) -> None:
    if report is not None:
        m.observe("vgrpo_stage_seconds", seconds, stage="publish")
        m.observe("vgrpo_weight_sync_seconds", report.seconds)
        m.set("vgrpo_weight_sync_bytes", report.nbytes)


exports_train_step = _exports("learner", _trained)
exports_weights_payload = _exports("learner", _payload)
exports_publish = _exports("learner", _published)
exports_weights_record = _exports("learner", _recorded)


# -- memory bank (in whichever process commits: the driver)


def count_bank_evictions(n: int) -> None:
    """Entries a commit removed to keep the bank within capacity or its byte bound."""
    if n:
        try:
            role_metrics("bank", pool="driver").inc("vgrpo_bank_evictions_total", n)
        except Exception as e:
            log.warning("bank eviction metric not recorded: %s: %s", type(e).__name__, e)
