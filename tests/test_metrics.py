"""The metric catalogue and its backends: memory, prometheus-client (served), Ray actors."""

from __future__ import annotations

import time
import urllib.request

import pytest

from common.metrics import CATALOGUE, STAT_KEYS, Metrics, exported_names, spec

ISSUE_METRICS = [  # issue 9's list, by name
    "vgrpo_rollouts_total", "vgrpo_videos_total", "vgrpo_reward", "vgrpo_advantage_std",
    "vgrpo_zero_std_group_ratio", "vgrpo_ratio_mean", "vgrpo_clip_fraction", "vgrpo_kl",
    "vgrpo_lambda_kl", "vgrpo_grad_norm", "vgrpo_loss", "vgrpo_policy_version",
    "vgrpo_version_lag", "vgrpo_entry_staleness", "vgrpo_queue_depth", "vgrpo_idle_ratio",
    "vgrpo_weight_sync_seconds", "vgrpo_bank_entries", "vgrpo_bank_bytes",
    "vgrpo_redis_latency_seconds", "vgrpo_invalid_rewards_total", "vgrpo_actor_restarts_total",
]


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def test_catalogue_is_complete_and_ray_safe():
    for name in ISSUE_METRICS:
        assert name in CATALOGUE
    for s in CATALOGUE.values():
        assert s.name.startswith("vgrpo_")
        assert s.help.isascii(), f"{s.name}: Ray rejects non-ASCII descriptions"
        assert (s.type == "counter") == s.name.endswith("_total"), s.name
        if s.type == "histogram":
            assert s.buckets and all(b > 0 for b in s.buckets) and list(s.buckets) == sorted(s.buckets)
        else:
            assert not s.buckets
    for name, labels in STAT_KEYS.values():
        assert set(labels) == set(spec(name).labels)


def test_exported_names():
    assert exported_names("vgrpo_videos_total") == ["ray_vgrpo_videos_total"]
    assert exported_names("vgrpo_videos_total", "prometheus") == ["vgrpo_videos_total"]
    assert exported_names("vgrpo_lambda_kl") == ["ray_vgrpo_lambda_kl"]
    assert exported_names("vgrpo_weight_sync_seconds")[0] == "ray_vgrpo_weight_sync_seconds_bucket"


def test_memory_backend_records():
    m = Metrics(backend="memory", role="learner", pool="learner-a")
    m.inc("vgrpo_videos_total", 4)
    m.inc("vgrpo_videos_total", 3)
    m.inc("vgrpo_videos_total", 0)
    m.set("vgrpo_lambda_kl", 0.5)
    m.set("vgrpo_lambda_kl", 0.25)
    m.set("vgrpo_reward", 0.7, head="vq")
    m.observe("vgrpo_entry_staleness", 2)
    m.observe("vgrpo_entry_staleness", 0)
    assert m.value("vgrpo_videos_total") == 7.0
    assert m.value("vgrpo_lambda_kl") == 0.25
    assert m.value("vgrpo_reward", head="vq") == 0.7
    h = m.value("vgrpo_entry_staleness")
    assert h["count"] == 2 and h["sum"] == 2.0
    assert h["buckets"][0.5] == 1 and h["buckets"][2.5] == 2 and h["buckets"][1.5] == 1
    assert m.pool == "learner-a"


def test_record_stats_maps_trainstats_keys():
    m = Metrics(backend="memory", role="learner")
    skipped = m.record_stats({"loss": 1.5, "clipfrac": 0.1, "ratio_mean": 1.01, "grad_norm": 3.0,
                              "kl/lambda": 0.2, "kl/d_anchor": 0.03, "kl/d_step": 0.004,
                              "loss/align": 0.5, "reward/mq": 0.6, "lr": 1e-4})
    assert skipped == ["lr"]
    assert m.value("vgrpo_loss") == 1.5
    assert m.value("vgrpo_clip_fraction") == 0.1
    assert m.value("vgrpo_kl", term="anchor") == 0.03
    assert m.value("vgrpo_kl", term="step") == 0.004
    assert m.value("vgrpo_align_loss") == 0.5
    assert m.value("vgrpo_reward", head="mq") == 0.6


def test_bad_names_types_and_labels_raise():
    m = Metrics(backend="none", role="rollout")
    with pytest.raises(KeyError, match="unknown metric 'vgrpo_nope'"):
        m.set("vgrpo_nope", 1.0)
    with pytest.raises(TypeError, match="is a counter"):
        m.set("vgrpo_videos_total", 1.0)
    with pytest.raises(ValueError, match=r"takes labels \['head'\]"):
        m.set("vgrpo_reward", 1.0)
    with pytest.raises(ValueError, match="takes labels"):
        m.set("vgrpo_loss", 1.0, head="x")
    with pytest.raises(ValueError, match="only goes up"):
        m.inc("vgrpo_videos_total", -1)
    with pytest.raises(ValueError, match="backend"):
        Metrics(backend="statsd")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="serve_port"):
        Metrics(backend="memory", serve_port=0)


def test_pool_defaults_to_env(monkeypatch):
    monkeypatch.setenv("VGRPO_POOL", "rollout-h100")
    assert Metrics(backend="none", role="rollout").pool == "rollout-h100"
    monkeypatch.delenv("VGRPO_POOL")
    assert Metrics(backend="none", role="rollout").pool == "rollout"


def test_prometheus_backend_serves_on_loopback():
    m = Metrics(backend="prometheus", role="driver", pool="head", serve_port=0)
    m.inc("vgrpo_rollouts_total", 2)
    m.set("vgrpo_queue_depth", 5, queue="scored")
    m.observe("vgrpo_redis_latency_seconds", 0.002, op="push")
    text = _scrape(f"http://127.0.0.1:{m.port}/metrics")
    assert 'vgrpo_rollouts_total{pool="head",role="driver"} 2.0' in text
    assert 'vgrpo_queue_depth{pool="head",queue="scored",role="driver"} 5.0' in text
    assert 'vgrpo_redis_latency_seconds_bucket{le="0.0025",op="push",pool="head",role="driver"} 1.0' in text


def test_ray_actor_metrics_reach_the_node_exporter(ray_session):
    ray = ray_session

    @ray.remote(num_cpus=0, resources={"learner": 1})
    class Recorder:
        def record(self) -> str:
            from common.metrics import Metrics

            m = Metrics(backend="ray", role="learner", pool="learner")
            m.set("vgrpo_lambda_kl", 0.25)
            m.inc("vgrpo_train_steps_total", 3)
            m.observe("vgrpo_weight_sync_seconds", 0.2)
            return m.backend

    actor = Recorder.remote()
    assert ray.get(actor.record.remote()) == "ray"
    node = next(n for n in ray.nodes() if n["Alive"])
    url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    want = [*exported_names("vgrpo_lambda_kl"), *exported_names("vgrpo_train_steps_total"),
            *exported_names("vgrpo_weight_sync_seconds")]
    deadline, text = time.monotonic() + 45, ""
    while time.monotonic() < deadline:  # the agent exports on Ray's report interval
        text = _scrape(url)
        # wait for this actor's value, not just the names: an earlier learner of the shared session
        # may export vgrpo_lambda_kl with the same labels before this one's report lands
        if all(f"\n{w}{{" in text for w in want) and any(
                x.startswith("ray_vgrpo_lambda_kl{") and x.endswith(" 0.25") for x in text.splitlines()):
            break
        time.sleep(1)
    ray.kill(actor)
    for w in want:
        assert f"\n{w}{{" in text, f"{w} not exported by Ray's metrics agent"
    # other learner actors of the shared Ray session (an earlier real run) may still be listed
    lines = [x for x in text.splitlines() if x.startswith("ray_vgrpo_lambda_kl{")]
    assert any('role="learner"' in x and 'pool="learner"' in x and x.endswith(" 0.25") for x in lines), lines


def test_docs_list_every_metric():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "metrics.md").read_text()
    for name in CATALOGUE:
        assert f"| `{name}` |" in doc, f"docs/metrics.md lacks a row for {name}"
