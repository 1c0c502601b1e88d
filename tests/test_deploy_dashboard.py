"""The Grafana dashboard: well formed, templated, and querying only metrics the code exports."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from common.metrics import CATALOGUE, exported_names

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "vgrpo-dashboard.json"
ROWS = {"Throughput", "Learner", "Rewards", "Staleness and sync", "Memory bank", "Health"}
TEMPLATED = {"type": "prometheus", "uid": "${datasource}"}
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


@pytest.fixture(scope="module")
def dash() -> dict:
    return json.loads(DASHBOARD.read_text())


def all_panels(dash: dict) -> list[dict]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out += p.get("panels", [])  # a collapsed row holds its panels
    return out


def metric_names(expr: str) -> set[str]:
    """Identifiers in a PromQL expression that name vgrpo series (labels and functions don't)."""
    return {t for t in _NAME.findall(re.sub(r'"[^"]*"', '""', expr)) if "vgrpo" in t}


def unknown_names(expr: str) -> set[str]:
    known = {n for m in CATALOGUE for n in exported_names(m, "ray")}
    return metric_names(expr) - known


def test_committed_json_is_the_generators_output():
    spec = importlib.util.spec_from_file_location(
        "make_dashboard", ROOT / "deploy" / "grafana" / "make_dashboard.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert DASHBOARD.read_text() == mod.render(), "run python deploy/grafana/make_dashboard.py"


def test_panel_ids_unique_and_rows_present(dash):
    ids = [p["id"] for p in all_panels(dash)]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {ids}"
    rows = [p["title"] for p in all_panels(dash) if p["type"] == "row"]
    assert set(rows) == ROWS


def test_every_target_has_expr_and_refid(dash):
    n = 0
    for p in all_panels(dash):
        if p["type"] == "row":
            continue
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert all(refs) and len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["expr"].strip(), p["title"]
            n += 1
    assert n >= 30


def test_every_panel_uses_the_templated_datasource(dash):
    for p in all_panels(dash):
        if p["type"] == "row":
            continue
        assert p["datasource"] == TEMPLATED, p["title"]
        for t in p["targets"]:
            assert t.get("datasource", TEMPLATED) == TEMPLATED, p["title"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("cluster", "pool"):
        assert variables[name]["datasource"] == TEMPLATED
        assert not unknown_names(variables[name]["query"]["query"])
    for p in all_panels(dash):
        for t in p.get("targets", []):
            assert '=~"$cluster"' in t["expr"] and '=~"$pool"' in t["expr"], t["expr"]


def test_every_queried_metric_exists_in_the_catalogue(dash):
    queried = set()
    for p in all_panels(dash):
        for t in p.get("targets", []):
            names = metric_names(t["expr"])
            assert names, f"{p['title']}: no vgrpo metric in {t['expr']}"
            assert not unknown_names(t["expr"]), f"{p['title']}: unknown {unknown_names(t['expr'])}"
            queried |= names
    # ...and every catalogue metric is on the dashboard.
    shown = {m for m in CATALOGUE if set(exported_names(m, "ray")) & queried}
    assert shown == set(CATALOGUE), f"not on the dashboard: {sorted(set(CATALOGUE) - shown)}"


def test_name_check_catches_unexported_names():
    # The Ray exporter adds `ray_`; a counter has one `_total`; only histograms have `_bucket`.
    assert unknown_names('rate(vgrpo_videos_total{pool=~"$pool"}[5m])') == {"vgrpo_videos_total"}
    assert unknown_names("rate(ray_vgrpo_videos_total_total[5m])") == {"ray_vgrpo_videos_total_total"}
    assert unknown_names("ray_vgrpo_loss_bucket") == {"ray_vgrpo_loss_bucket"}
    assert unknown_names("ray_vgrpo_weigth_sync_seconds_bucket") == {"ray_vgrpo_weigth_sync_seconds_bucket"}
    assert not unknown_names('ray_vgrpo_kl{term="vgrpo_x"}')
