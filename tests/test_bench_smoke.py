"""Every benchmark of `make bench` runs in its quickest form (benchmarks/run_all.py: SMOKE), so
that none can break unnoticed. The figures are not judged: benchmarks are not tests."""

from __future__ import annotations

import json
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


# Benchmarks that each run in a child of their own and start a Ray of their own, as a user's run
# of them would (bench_async: cluster.driver.pools.init_ray; bench_dataplane --smoke). They could
# join the session's cluster (RAY_ADDRESS) and save a Ray start, but under `make test` that cluster's
# worker is the longer of the two (tests/suite_groups.py): on the other one they finish sooner.
OWN_CHILD = {"bench_async", "bench_dataplane"}
# The others run one after another in ONE child, each as `python -m benchmarks.NAME ARGS` would
# (runpy as __main__, its own sys.argv, SystemExit and exceptions turned into the exit code the
# interpreter would give), so that torch, diffusers and ray are imported once, not per benchmark.
ONE_CHILD = [n for n in BENCHES if n not in OWN_CHILD]
RUN_IN_ONE_CHILD = """
import contextlib, io, json, runpy, sys, traceback
from benchmarks.run_all import SMOKE
out, names = sys.argv[1], sys.argv[2:]
results = {}
for name in names:
    stdout, stderr = io.StringIO(), io.StringIO()
    sys.argv = [name, *SMOKE[name]]
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            runpy.run_module(f"benchmarks.{name}", run_name="__main__", alter_sys=True)
            rc = 0
        except SystemExit as e:
            rc = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        except BaseException:
            rc = 1
            traceback.print_exc()
    results[name] = {"returncode": rc, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()}
    with open(out, "w") as f:
        json.dump(results, f)
"""
RESULTS = ROOT / "benchmarks" / "results.md"


def _env(**extra) -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra}


@pytest.fixture(scope="module")
def one_child(tmp_path_factory):
    """The ONE_CHILD benchmarks run once, together: (results.md's mtime before, each one's result)."""
    before = RESULTS.stat().st_mtime_ns
    out = tmp_path_factory.mktemp("bench_smoke") / "results.json"
    res = subprocess.run([sys.executable, "-c", RUN_IN_ONE_CHILD, str(out), *ONE_CHILD], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=850)
    got = json.loads(out.read_text()) if out.is_file() else {}
    for name in ONE_CHILD:  # a benchmark the child never reached (it died) fails with the child's output
        got.setdefault(name, {"returncode": res.returncode or -1, "stdout": res.stdout, "stderr": res.stderr})
    return before, got


@pytest.mark.parametrize("name", BENCHES)
def test_benchmark_runs_in_its_quickest_form(name, request):
    if name in OWN_CHILD:
        before = RESULTS.stat().st_mtime_ns
        env = {k: v for k, v in _env().items() if k != "RAY_ADDRESS"}
        res = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", *SMOKE[name]], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=850)
        returncode, stdout, stderr = res.returncode, res.stdout, res.stderr
    else:
        before, got = request.getfixturevalue("one_child")
        returncode, stdout, stderr = (got[name][k] for k in ("returncode", "stdout", "stderr"))
    assert returncode == 0, f"{name} {' '.join(SMOKE[name])}:\n{stdout[-2000:]}\n{stderr[-4000:]}"
    assert stdout.strip(), f"{name} printed nothing"
    assert RESULTS.stat().st_mtime_ns == before  # the committed figures are left alone
