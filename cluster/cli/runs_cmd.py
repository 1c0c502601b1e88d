"""`vgrpo runs [ROOT]`: the run directories under ROOT, each with its step, status, last reward,
before/after result, training health and wall time."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import yaml

from cluster.runs.run_dir import is_stale
from common import storage
from common.config import ConfigError


def register(sub) -> None:
    p = sub.add_parser("runs", help="list run directories and how each stands",
                       description="List the run directories under ROOT (default: runs, the default "
                       "run.root): step reached of train.steps, status (running, finished, or stopped "
                       "and why), the last training reward, the before → after evaluation composite, "
                       "the training health (ok, or the checks that warned or stopped) and the wall time.")
    p.add_argument("root", nargs="?", default="runs", help="folder holding run directories (default: runs)")
    p.add_argument("--json", action="store_true", help="one JSON object per run, for scripts")
    p.set_defaults(func=run)


def _last_row(metrics: Path) -> dict[str, Any]:
    last: dict[str, Any] = {}
    if metrics.is_file():
        for line in metrics.read_text(encoding="utf-8").splitlines():
            if line.strip():
                try:
                    last = json.loads(line)
                except ValueError:  # a line cut short by a kill: the previous one stands
                    continue
    return last


def describe(path) -> dict[str, Any]:
    """What `vgrpo runs` shows for one run directory (a Path, or a storage.Uri on an object store)."""
    path = storage.location(path)
    try:
        cfg = yaml.safe_load((path / "config.yaml").read_text(encoding="utf-8")) or {}
        steps = (cfg.get("train") or {}).get("steps")
    except (OSError, ValueError, AttributeError, yaml.YAMLError):  # a hand-edited config: list it anyway
        steps = None
    last = _last_row(path / "metrics.jsonl")
    status = _read_json(path / "status.json")
    state, reason = status.get("state", "unknown"), status.get("reason")
    if is_stale(status):
        state, reason = "stopped", "the process ended without saying why (killed or crashed)"
    sessions = status.get("sessions") or []
    wall = sum((end if end is not None else (time.time() if state == "running" else start)) - start
               for start, end in sessions) if sessions else last.get("time_s")
    summary = _read_json(path / "summary.json")
    return {"run": path.name, "path": str(path), "step": last.get("step", 0), "steps": steps,
            "status": state, "reason": reason, "reward": last.get("reward_mean"),
            "before": (summary.get("before") or {}).get("composite_mean"),
            "after": (summary.get("after") or {}).get("composite_mean"), "wall_s": wall,
            "health": health_status(path, summary)}


def _read_json(f) -> dict[str, Any]:
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def health_status(path: Path, summary: dict[str, Any]) -> str | None:
    """`ok`, `warn: <checks>` or `stop: <check>` from RUN_DIR/health.json (or summary.json's
    health section); None for a run without health checks."""
    from cluster.health.hook import read_health  # lazy: torch, rich (kept out of vgrpo --help)

    h = read_health(path) or summary.get("health")
    if not isinstance(h, dict) or not isinstance(h.get("checks"), dict):
        return None
    fired = {name: c.get("level") for name, c in h["checks"].items() if isinstance(c, dict) and c.get("fired")}
    status = h.get("status", "ok")
    names = [n for n, lvl in fired.items() if lvl == status] if status != "ok" else []
    return status + (f": {', '.join(names)}" if names else "")


def find_runs(root) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir() and (p / "config.yaml").is_file())


def _num(v: float | None) -> str:
    return "—" if v is None else f"{v:.3f}"


def _wall(s: float | None) -> str:
    if s is None:
        return "—"
    h, rem = divmod(int(s), 3600)
    return f"{h}:{rem // 60:02d}:{rem % 60:02d}"


def run(args) -> int:
    root = storage.location(args.root)  # a folder, or a prefix on an object store (s3://…)
    if not root.is_dir():
        raise ConfigError(f"{root}: no such folder; pass the run.root your runs were written to")
    rows = [describe(p) for p in find_runs(root)]
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    # lazy: rich (kept out of vgrpo --help)
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"runs in {root}")
    for col in ("run", "step", "status", "reward", "before → after", "health", "wall time"):
        table.add_column(col, justify="left" if col in ("run", "status", "health") else "right")
    for r in rows:
        status = r["status"] + (f": {r['reason']}" if r["reason"] else "")
        result = "—" if r["after"] is None else f"{_num(r['before'])} → {_num(r['after'])}"
        table.add_row(r["run"], f"{r['step']}/{r['steps']}", status, _num(r["reward"]), result, r["health"] or "—",
                      _wall(r["wall_s"]))
    Console(width=200).print(table)
    if not rows:
        print(f"no run directories in {root}")
    return 0
