"""The Grafana dashboard against a real scrape: a short run on a local Ray with every role as
its own actor, Ray's metrics agent scraped over HTTP and parsed with prometheus_client's text
parser, and every metric name and label each dashboard query uses found in it.

The catalogue check in test_deploy_dashboard.py only proves the names are declared; this one
proves the running code emits them, from the pools the dashboard filters on.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

from common.config import load_config

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "vgrpo-dashboard.json"
# Added by Prometheus from the pod label ray.io/cluster (the PodMonitor's podTargetLabels,
# checked in test_deploy_chart.py); a scrape of the agent itself cannot carry it.
TARGET_LABELS = {"ray_io_cluster"}
# Counters that exist only once their event happened (a failure); their queries fall back to 0.
EVENT_COUNTERS = {"ray_vgrpo_errors_total", "ray_vgrpo_actor_restarts_total",
                  "ray_vgrpo_invalid_rewards_total"}
# What each actor role must export itself (not the driver), labelled with its own pool.
ACTOR_OWNED = {
    "rollout": {"ray_vgrpo_rollouts_total", "ray_vgrpo_videos_total", "ray_vgrpo_policy_version",
                "ray_vgrpo_stage_seconds_bucket", "ray_vgrpo_weight_sync_seconds_bucket",
                "ray_vgrpo_weight_sync_bytes"},
    "reward": {"ray_vgrpo_videos_scored_total", "ray_vgrpo_reward", "ray_vgrpo_stage_seconds_bucket"},
    "learner": {"ray_vgrpo_train_steps_total", "ray_vgrpo_groups_trained_total", "ray_vgrpo_loss",
                "ray_vgrpo_kl", "ray_vgrpo_grad_norm", "ray_vgrpo_advantage_std",
                "ray_vgrpo_weight_sync_bytes", "ray_vgrpo_stage_seconds_bucket"},
}
_METRIC = re.compile(r"\b(ray_vgrpo_[a-zA-Z0-9_]+)(\{[^}]*\})?")
_BY = re.compile(r"\bby\s*\(([^)]*)\)")
_SELECTOR_LABEL = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")


def query_needs(expr: str) -> dict[str, set[str]]:
    """{series name: label names the query reads from it} (selectors, `by`, and `le`)."""
    by = {x.strip() for group in _BY.findall(expr) for x in group.split(",") if x.strip()}
    needs: dict[str, set[str]] = {}
    for name, selector in _METRIC.findall(expr):
        labels = set(_SELECTOR_LABEL.findall(selector or "")) | by
        needs.setdefault(name, set()).update(labels - TARGET_LABELS)
    return needs


def dashboard_needs() -> list[tuple[str, str, dict[str, set[str]]]]:
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dash["panels"]:
        for t in panel.get("targets", []):
            out.append((panel["title"], t["expr"], query_needs(t["expr"])))
    return out


def test_query_needs_reads_names_and_labels():
    expr = ('histogram_quantile(0.9, sum by (le, stage) (rate(ray_vgrpo_stage_seconds_bucket'
            '{ray_io_cluster=~"$cluster", pool=~"$pool"}[5m])))')
    assert query_needs(expr) == {"ray_vgrpo_stage_seconds_bucket": {"le", "stage", "pool"}}
    assert query_needs('max by (pool, term) (ray_vgrpo_kl{pool=~"a"})') == {
        "ray_vgrpo_kl": {"pool", "term"}}


def scrape(url: str) -> list[tuple[str, dict[str, str]]]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()  # no token: see docs/metrics.md
    return [(s.name, dict(s.labels)) for fam in text_string_to_metric_families(text)
            for s in fam.samples if "vgrpo" in s.name]


def missing_from(samples, needs: dict[str, set[str]]) -> list[str]:
    out = []
    for name, labels in needs.items():
        if not any(n == name and labels <= set(lab) for n, lab in samples):
            out.append(f"{name} with labels {sorted(labels)}")
    return out


def missing_actor_series(samples, pools: dict[str, str], old_workers: set[str]) -> list[str]:
    """Actor-owned series from worker processes of this run (not from earlier tests' actors)."""
    out = []
    for role, names in ACTOR_OWNED.items():
        for name in names:
            if not any(n == name and lab.get("role") == role and lab.get("pool") == pools[role]
                       and lab.get("WorkerId") not in old_workers for n, lab in samples):
                out.append(f"{name}{{role={role}, pool={pools[role]}}}")
    return out


def wait_for(url: str, check, timeout_s: float = 90.0):
    """Scrape until `check(samples)` returns no missing series (Ray reports every ~10 s).

    Samples add up over the scrapes, as Prometheus keeps what it scraped: Ray's agent may drop
    a gauge that was not set again for a while."""
    deadline = time.monotonic() + timeout_s
    seen: dict[tuple[str, tuple], dict[str, str]] = {}
    while True:
        for name, labels in scrape(url):
            seen[(name, tuple(sorted(labels.items())))] = labels
        samples = [(name, labels) for (name, _), labels in seen.items()]
        missing = check(samples)
        if not missing or time.monotonic() > deadline:
            return samples, missing
        time.sleep(2)  # polling interval of a deadline-bounded wait, not a synchronisation


def metrics_url() -> str:
    import ray

    node = next(n for n in ray.nodes() if n["Alive"])
    return f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"


def test_every_dashboard_query_finds_its_series_after_a_short_run(ray_session, tmp_path):
    from cluster.driver.driver import Driver
    from cluster.runs.run_dir import RunDir

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red square moving left\na blue square moving up\n")
    cfg = load_config("configs/quickstart.yaml", [
        f"train.prompts={prompts}", "train.mode=async", "train.steps=3", "train.groups_per_step=2",
        "train.eval_seeds=1", "train.checkpoint_every=3", "sampler.group_size=4", "schedule.steps=6",
        "bank.capacity=2", "optim.micro_batch=4", f"run.root={tmp_path}", "run.name=metrics"])
    url = metrics_url()
    old_workers = {lab.get("WorkerId") for _, lab in scrape(url)}
    driver = Driver(cfg, RunDir.create(cfg))
    try:
        driver.setup()
        driver.run()
        assert driver.step == 3
        queries = dashboard_needs()
        assert len(queries) >= 30

        def check(samples):
            missing = []
            for title, _expr, needs in queries:
                required = {n: labels for n, labels in needs.items() if n not in EVENT_COUNTERS}
                missing += [f"{title}: {m}" for m in missing_from(samples, required)]
            return missing + missing_actor_series(samples, {r: r for r in ACTOR_OWNED}, old_workers)

        samples, missing = wait_for(url, check)
        assert not missing, "not in Ray's scrape:\n" + "\n".join(missing)
    finally:
        driver.teardown()
    # Event counters are queried with a 0 fallback, so they show data before their first event.
    for title, expr, needs in queries:
        if set(needs) & EVENT_COUNTERS:
            assert expr.rstrip().endswith("or vector(0)"), title
    # The driver no longer speaks for the pools: their work is not exported as pool="driver".
    driver_names = {n for n, lab in samples if lab.get("pool") == "driver"}
    assert not driver_names & (ACTOR_OWNED["rollout"] | ACTOR_OWNED["learner"]) - {
        "ray_vgrpo_weight_sync_seconds_bucket", "ray_vgrpo_stage_seconds_bucket"}


def test_an_actor_labels_its_metrics_with_its_pods_pool(ray_session):
    """On KubeRay every pod has VGRPO_POOL=<its worker group>; an actor placed there inherits
    it. Here the actor gets it through its runtime_env, as a pod's environment would give it."""
    import ray

    from common.types import Condition
    from rollout_worker.actor import RolloutActor

    cfg = load_config("configs/quickstart.yaml", ["sampler.group_size=2", "schedule.steps=2"])
    actor = RolloutActor.options(
        resources={"rollout": 1}, num_cpus=0,
        runtime_env={"env_vars": {"VGRPO_POOL": "rollout-h100", "OMP_NUM_THREADS": "1"}},
    ).remote(cfg, 0)
    try:
        group = ray.get(actor.generate.remote(Condition(id="c0", prompt="a red square moving left"), 7))
        assert len(group.members) == 2

        def check(samples):
            want = [("ray_vgrpo_videos_total", "rollout"), ("ray_vgrpo_rollouts_total", "rollout"),
                    ("ray_vgrpo_stage_seconds_bucket", "rollout")]
            return [f"{n}{{role={r}, pool=rollout-h100}}" for n, r in want
                    if not any(s == n and lab.get("role") == r and lab.get("pool") == "rollout-h100"
                               for s, lab in samples)]

        _, missing = wait_for(metrics_url(), check)
        assert not missing, missing
    finally:
        ray.kill(actor)
