"""The driver's per-step row and its Prometheus export (pure: memory-backend metrics)."""

import math
from collections import defaultdict

import pytest

from cluster.driver.step_record import StepExporter, step_record
from common.metrics import Metrics


def _counts(**kw):
    c = defaultdict(int)
    c.update(kw)
    return c


def _record(step, counts, bank):
    timers = defaultdict(float, generate=3.0, score=1.0, train=2.0, publish=0.5)
    return step_record(step, 4.0, {"loss": 0.1, "staleness_max": 0}, counts, timers, 0, bank)


BANK = {"entries": 8, "bytes": 1024, "fresh": 2, "corrupt": 0, "quarantined": 3, "redis_latency_ms": 1.5}


def test_record_has_throughput_idle_ratios_counts_and_bank():
    r = _record(3, _counts(videos=20, groups_trained=5, rollout_timeouts=1), BANK)
    assert (r["step"], r["version"], r["loss"]) == (3, 3, 0.1)
    assert r["videos_per_s"] == pytest.approx(5.0)
    assert r["idle/rollout"] == pytest.approx(0.25) and r["idle/learner"] == pytest.approx(0.5)
    assert r["groups_trained"] == 5 and r["rollout_timeouts"] == 1 and r["actor_restarts"] == 0
    assert r["bank/fresh"] == 2 and r["bank/redis_latency_ms"] == 1.5 and r["bank/quarantined"] == 3
    assert r["groups_quarantined"] == r["groups_resampled"] == r["groups_dropped"] == 0


def test_counters_advance_by_what_happened_since_the_last_step():
    m = Metrics(backend="memory")
    roles = {r: Metrics(backend="memory", role=r) for r in ("rollout", "reward", "learner")}
    ex = StepExporter(m, roles)
    ex.export(_record(1, c := _counts(videos=8, actor_restarts=1), BANK), c)
    ex.export(_record(2, c := _counts(videos=16, actor_restarts=1), BANK), c)
    assert m.value("vgrpo_actor_restarts_total") == 1    # one restart, exported once
    # the actors export their own work; the driver does not repeat it as pool="driver"
    for name in ("vgrpo_videos_total", "vgrpo_train_steps_total", "vgrpo_loss"):
        with pytest.raises(KeyError):
            m.value(name)
    assert m.value("vgrpo_queue_depth", queue="fresh") == 2
    assert roles["reward"].value("vgrpo_idle_ratio") == pytest.approx(0.75)


def test_unreachable_bank_gives_nan_and_leaves_the_bank_gauges_alone():
    m = Metrics(backend="memory")
    ex = StepExporter(m, {r: Metrics(backend="memory", role=r) for r in ("rollout", "reward", "learner")})
    r = _record(1, c := _counts(), None)
    assert math.isnan(r["bank/fresh"]) and math.isnan(r["bank/bytes"])
    ex.export(r, c)
    with pytest.raises(KeyError):
        m.value("vgrpo_queue_depth", queue="fresh")
