"""`vgrpo eval --curve` on bad targets: one line naming the directory, exit 2, nothing written."""

from __future__ import annotations

import shutil
from pathlib import Path

from cluster.cli import main

ROOT = Path(__file__).resolve().parent.parent


def test_curve_needs_a_run_directory(tmp_path, capsys):
    assert main(["eval", str(tmp_path), "--curve", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path}: --curve needs a run directory" in err
    assert not (tmp_path / "out").exists()


def test_curve_names_a_run_without_checkpoints(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(ROOT / "configs" / "quickstart.yaml", run / "config.yaml")
    assert main(["eval", str(run), "--curve", "--out", str(tmp_path / "out")]) == 2
    assert f"{run}: no checkpoint under {run / 'checkpoints'}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
