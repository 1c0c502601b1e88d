"""`vgrpo sde-report` prints the table and writes the plot."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from cluster.cli.sde_report import regime_stds

ROOT = Path(__file__).resolve().parents[1]


def test_regimes_show_the_papers_three_behaviours():
    a, b, c = (regime_stds(r, 16, 1.0, 0.7, 3e-3) for r in "abc")
    assert a["sage"][0] == 0.0  # the σ_1 trick collapses sage's first interval
    assert b["flow"][0] > 2.5 * b["sage"][0] and 1.0 < b["sage"][0] < 1.4  # clamped Flow explodes
    assert c["flow"][0] == a["flow"][0] and c["sage"][0] == b["sage"][0]  # defaults
    assert all(f > s for f, s in zip(c["flow"][1:], c["sage"][1:], strict=True))  # excess noise energy


def test_cli_prints_table_and_writes_png(tmp_path):
    out = tmp_path / "std.png"
    res = subprocess.run([sys.executable, "-m", "cluster.cli", "sde-report", "--steps", "16", "--shift", "1",
                          "--eta", "0.7", "--out", str(out)], capture_output=True, text=True, cwd=ROOT,
                         timeout=120, env={"COLUMNS": "120", "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr
    assert "3.195" in res.stdout and "1.207" in res.stdout  # regime b, first step
    assert "w sage" in res.stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    bad = subprocess.run([sys.executable, "-m", "cluster.cli", "sde-report", "--steps", "0"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert bad.returncode == 2 and "--steps" in bad.stderr and "Traceback" not in bad.stderr
