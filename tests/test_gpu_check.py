"""benchmarks/gpu_check.sh: the no-GPU path, --check-imports, and its train/replay, attention-backend and
sequence-parallel sections at toy size on CPU."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rollout_worker.models.kernels import PACKAGE

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def _run(*args: str, prelude: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    if prelude is None:
        cmd = ["bash", str(SCRIPT), *args]
    else:  # the same entry point, in an interpreter where `prelude` ran first
        cmd = [sys.executable, "-c", f"{prelude}\nimport sys\nfrom benchmarks.gpu_check import main\n"
               f"sys.exit(main({list(args)!r}))"]
        env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_prints_one_line_and_exits_0(tmp_path):
    out = tmp_path / "results.md"
    res = _run("--out", str(out))
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("\n") == 1 and res.stdout.startswith("gpu_check: skipped, no CUDA GPU")
    assert not out.exists()


def test_check_imports_lists_what_is_missing_in_one_line():
    res = _run("--check-imports")
    assert (res.returncode, res.stdout) == (0, "gpu_check imports: all present\n")  # no Ray or Redis pulled in
    block = ("import sys\nclass _Block:\n    def find_spec(self, name, path=None, target=None):\n"
             "        if name.split('.')[0] in ('peft', 'diffusers'):\n"
             "            raise ImportError(f'No module named {name!r}', name=name)\n"
             "sys.meta_path.insert(0, _Block())")
    res = _run("--check-imports", prelude=block)
    assert res.returncode == 1
    assert res.stdout == "gpu_check imports: missing peft, diffusers\n"


def test_train_and_replay_path_runs_at_toy_size_on_cpu():
    from benchmarks.gpu_check import KEY_WIDTH

    res = _run("--smoke-cpu")
    assert res.returncode == 0, res.stderr[-2000:]
    lines = {line[:KEY_WIDTH].strip(): line[KEY_WIDTH:].strip() for line in res.stdout.splitlines()}
    assert float(lines["log r on replay (max |log r|)"]) < 1e-6
    assert "sampler/ODE ratio" in lines and "train step" in lines
    # the SP and attention-backend section, at toy size on the CPU (gloo)
    for n in (64, 256):
        assert lines[f"attention SDPA @ {n} tokens"].endswith("ms (2x8)")
        for name, (module, _) in PACKAGE.items():
            got = lines[f"attention {name}/SDPA @ {n} tokens"]
            if importlib.util.find_spec(module) is None:
                assert got == f"not measured ({name}'s package is not installed)"
            else:
                assert float(got.split()[0]) > 0
    sp = lines["Ulysses SP 2 vs 1"]
    assert sp.startswith("max |dv| ") and float(sp.split()[2].rstrip(",")) < 1e-5 and "64 tokens" in sp
