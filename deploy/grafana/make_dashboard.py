"""Writes vgrpo-dashboard.json: the Grafana dashboard over the metrics in common/metrics.py.

Run `python deploy/grafana/make_dashboard.py` after changing a panel; a test checks that the
committed JSON is this script's output and that every queried name is in the catalogue.
Queries use Ray's exported names (`ray_` prefix, see docs/metrics.md).
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).with_name("vgrpo-dashboard.json")
DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'ray_io_cluster=~"$cluster", pool=~"$pool"'
RI = "$__rate_interval"


def _rate(name: str, by: str = "pool") -> str:
    return f"sum by ({by}) (rate(ray_{name}{{{SEL}}}[{RI}]))"


def _gauge(name: str, by: str = "pool", agg: str = "max") -> str:
    # One series per Ray worker process (WorkerId); fold them per pool.
    return f"{agg} by ({by}) (ray_{name}{{{SEL}}})"


def _events(name: str, by: str) -> str:
    # Event counters (errors, restarts, invalid rewards) have no series until the first event;
    # the panel reads 0 until then instead of "No data".
    return f"{_rate(name, by)} or vector(0)"


def _quantile(q: float, name: str, by: str = "pool") -> str:
    return (f"histogram_quantile({q}, sum by (le, {by}) "
            f"(rate(ray_{name}_bucket{{{SEL}}}[{RI}])))")


# Rows: (title, [(panel title, unit, [(expr, legend)])])
ROWS = [
    ("Throughput", [
        ("Rollouts / s", "ops", [(_rate("vgrpo_rollouts_total"), "{{pool}}")]),
        ("Videos / s", "ops", [(_rate("vgrpo_videos_total"), "{{pool}} generated"),
                               (_rate("vgrpo_videos_scored_total"), "{{pool}} scored")]),
        ("Train steps / s", "ops", [(_rate("vgrpo_train_steps_total"), "{{pool}} steps"),
                                    (_rate("vgrpo_groups_trained_total"), "{{pool}} groups")]),
        ("Stage time p90", "s", [(_quantile(0.9, "vgrpo_stage_seconds", "stage"), "{{stage}}")]),
    ]),
    ("Learner", [
        ("Loss", "none", [(_gauge("vgrpo_loss"), "{{pool}}")]),
        ("Ratio mean", "none", [(_gauge("vgrpo_ratio_mean"), "{{pool}}")]),
        ("Clip fraction", "percentunit", [(_gauge("vgrpo_clip_fraction"), "{{pool}}")]),
        ("KL terms", "none", [(_gauge("vgrpo_kl", "pool, term"), "{{term}}"),
                              (_gauge("vgrpo_approx_kl"), "approx_kl")]),
        ("lambda_KL", "none", [(_gauge("vgrpo_lambda_kl"), "{{pool}}")]),
        ("Grad norm", "none", [(_gauge("vgrpo_grad_norm"), "{{pool}}")]),
        ("Alignment term J_align", "none", [(_gauge("vgrpo_align_loss"), "{{pool}}")]),
    ]),
    ("Rewards", [
        ("Reward per head", "none", [(_gauge("vgrpo_reward", "head", "avg"), "{{head}}")]),
        ("Advantage std", "none", [(_gauge("vgrpo_advantage_std"), "{{pool}}")]),
        ("Zero-spread group ratio", "percentunit",
         [(_gauge("vgrpo_zero_std_group_ratio"), "{{pool}}")]),
        ("Invalid rewards / s", "ops", [(_events("vgrpo_invalid_rewards_total", "head"), "{{head}}")]),
    ]),
    ("Staleness and sync", [
        ("Policy version", "none", [(_gauge("vgrpo_policy_version"), "{{pool}}")]),
        ("Version lag", "none", [(_gauge("vgrpo_version_lag"), "{{pool}}")]),
        ("Staleness of trained entries", "none",
         [(_quantile(0.5, "vgrpo_entry_staleness"), "p50 {{pool}}"),
          (_quantile(0.95, "vgrpo_entry_staleness"), "p95 {{pool}}")]),
        ("Weight sync seconds", "s",
         [(_quantile(0.5, "vgrpo_weight_sync_seconds"), "p50 {{pool}}"),
          (_quantile(0.95, "vgrpo_weight_sync_seconds"), "p95 {{pool}}")]),
        ("Weight push bytes", "bytes", [(_gauge("vgrpo_weight_sync_bytes"), "{{pool}}")]),
        ("Queue depth", "none", [(_gauge("vgrpo_queue_depth", "queue"), "{{queue}}")]),
    ]),
    ("Memory bank", [
        ("Bank entries", "none", [(_gauge("vgrpo_bank_entries"), "{{pool}}")]),
        ("Bank bytes", "bytes", [(_gauge("vgrpo_bank_bytes"), "{{pool}}")]),
        ("Redis latency", "s", [(_quantile(0.5, "vgrpo_redis_latency_seconds", "op"), "p50 {{op}}"),
                                (_quantile(0.99, "vgrpo_redis_latency_seconds", "op"),
                                 "p99 {{op}}")]),
        ("Bank evictions / s", "ops", [(_rate("vgrpo_bank_evictions_total"), "{{pool}}")]),
    ]),
    ("Health", [
        ("Idle ratio", "percentunit",
         [(_gauge("vgrpo_idle_ratio", "role, pool", "avg"), "{{role}} {{pool}}")]),
        ("Actor restarts (window)", "none",
         [(f"sum by (pool) (increase(ray_vgrpo_actor_restarts_total{{{SEL}}}[$__range]))"
           " or vector(0)", "{{pool}}")]),
        ("Errors / s", "ops", [(_events("vgrpo_errors_total", "kind"), "{{kind}}")]),
    ]),
]


def training_health_panels() -> list:
    """The training health checks (cluster/health/checks.py): status and findings, the first-update and
    on-policy numerics, zero-spread groups per head, reward trends, KL growth, held-out drift."""
    return [
        ("Health status (0 ok, 1 warn, 2 stop)", "none", [(_gauge("vgrpo_health_status"), "{{pool}}")]),
        ("Health findings per check", "none",
         [(_gauge("vgrpo_health_findings", "check, level"), "{{check}} ({{level}})")]),
        ("On-policy max abs(log r)", "none", [(_gauge("vgrpo_onpolicy_logratio_absmax"), "{{pool}}")]),
        ("On-policy clip fraction and approx-KL", "none",
         [(_gauge("vgrpo_onpolicy_clip_fraction"), "clip fraction"),
          (_gauge("vgrpo_onpolicy_approx_kl"), "approx-KL")]),
        ("Zero-spread groups per head", "percentunit", [(_gauge("vgrpo_zero_spread_ratio", "head"), "{{head}}")]),
        ("Reward trend z per head", "none", [(_gauge("vgrpo_reward_trend_z", "head", "avg"), "{{head}}")]),
        ("KL growth over the window", "none", [(_gauge("vgrpo_kl_growth", "term"), "{{term}}")]),
        ("Held-out paired z vs the first evaluation", "none",
         [(_gauge("vgrpo_heldout_z", "head", "avg"), "{{head}}")]),
    ]


def add_training_health(rows: list) -> None:
    """Into the "Health" row (after the service panels), or a "Health" row of its own."""
    row = next((r for r in rows if r[0] == "Health"), None)
    if row is None:
        rows.append(("Health", training_health_panels()))
    else:
        row[1].extend(training_health_panels())


add_training_health(ROWS)


def _variable(name: str, label: str, query: str) -> dict:
    return {
        "name": name, "label": label, "type": "query", "datasource": DS,
        "query": {"query": query, "refId": f"{name}-var"}, "definition": query,
        "refresh": 2, "includeAll": True, "multi": True, "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "sort": 1,
    }


def build() -> dict:
    panels, pid, y = [], 1, 0
    for row_title, row_panels in ROWS:
        panels.append({"id": pid, "type": "row", "title": row_title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        pid, y = pid + 1, y + 1
        for i, (title, unit, exprs) in enumerate(row_panels):
            panels.append({
                "id": pid, "type": "timeseries", "title": title, "datasource": DS,
                "gridPos": {"h": 8, "w": 8, "x": 8 * (i % 3), "y": y + 8 * (i // 3)},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom"},
                            "tooltip": {"mode": "multi"}},
                "targets": [{"refId": chr(ord("A") + j), "datasource": DS, "expr": e,
                             "legendFormat": legend} for j, (e, legend) in enumerate(exprs)],
            })
            pid += 1
        y += 8 * ((len(row_panels) + 2) // 3)
    return {
        "uid": "vgrpo-overview", "title": "vgrpo", "tags": ["vgrpo", "ray"],
        "schemaVersion": 39, "version": 1, "editable": True, "refresh": "30s",
        "time": {"from": "now-3h", "to": "now"}, "timezone": "",
        "annotations": {"list": []},
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource",
             "query": "prometheus", "current": {}, "hide": 0, "refresh": 1},
            _variable("cluster", "Ray cluster", "label_values(ray_vgrpo_idle_ratio, ray_io_cluster)"),
            # every pool that exports anything: the worker groups (their actors) and the driver
            _variable("pool", "Pool",
                      'label_values({__name__=~"ray_vgrpo_.+", ray_io_cluster=~"$cluster"}, pool)'),
        ]},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2, ensure_ascii=True) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
