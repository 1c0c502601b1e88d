"""Every benchmark of `make bench` runs in its quickest form (benchmarks/run_all.py: SMOKE), so
that none can break unnoticed. The figures are not judged: benchmarks are not tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # benchmarks/ is not an installed package
    sys.path.insert(0, str(ROOT))

from benchmarks.run_all import BENCHES, SMOKE  # noqa: E402

pytestmark = pytest.mark.timeout(900)


def test_every_benchmark_has_a_quickest_form():
    assert sorted(SMOKE) == sorted(BENCHES)


# Benchmarks whose quickest form joins RAY_ADDRESS (bench_async: cluster.driver.pools.init_ray;
# bench_dataplane --smoke): the session's cluster saves them a Ray start (the others size a
# cluster of their own).
JOINS_RAY = {"bench_async", "bench_dataplane"}


@pytest.mark.parametrize("name", BENCHES)
def test_benchmark_runs_in_its_quickest_form(name, request):
    results = ROOT / "benchmarks" / "results.md"
    before = results.stat().st_mtime_ns
    # the session's cluster first: starting it sets the token-auth mode its clients need
    join = {"RAY_ADDRESS": request.getfixturevalue("ray_address")} if name in JOINS_RAY else {}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **join}
    res = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", *SMOKE[name]], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=850)
    assert res.returncode == 0, f"{name} {' '.join(SMOKE[name])}:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
    assert res.stdout.strip(), f"{name} printed nothing"
    assert results.stat().st_mtime_ns == before  # the committed figures are left alone
