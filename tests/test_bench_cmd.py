"""`vgrpo bench` finds the benchmarks from the package's checkout, from any directory, and
cluster/ never imports benchmarks/ (it is not an installed package)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


PACKAGES = ("cluster", "common", "rollout_worker", "reward_worker", "learner", "memory_bank")


def test_bench_runs_from_another_directory(tmp_path):
    # As an editable install gives: the packages on the path (linked to the checkout), benchmarks/
    # not importable, and the command run from an unrelated directory.
    site, elsewhere = tmp_path / "site", tmp_path / "elsewhere"
    site.mkdir()
    elsewhere.mkdir()
    for pkg in PACKAGES:
        (site / pkg).symlink_to(ROOT / pkg, target_is_directory=True)
    env = {**os.environ, "PYTHONPATH": str(site)}
    res = subprocess.run([sys.executable, "-m", "cluster.cli", "bench", "no_such_bench"], cwd=elsewhere,
                         env=env, capture_output=True, text=True, timeout=120)
    # the runner itself answered: it found benchmarks/run_all.py and named the benchmarks it has
    assert res.returncode == 2, res.stderr
    assert "unknown benchmark(s) ['no_such_bench']; choose from ['bench_sampler'" in res.stderr
    assert list(elsewhere.iterdir()) == []


def test_cluster_never_imports_benchmarks():
    found = []
    for path in (ROOT / "cluster").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "benchmarks"]
    assert found == []
