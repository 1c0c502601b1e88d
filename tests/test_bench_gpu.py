"""The benchmarks' --gpu form: a clear error without CUDA, and GPU sizes that build with the real classes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # benchmarks/ is not an installed package
    sys.path.insert(0, str(ROOT))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("module", ["benchmarks.run_all", "benchmarks.bench_sampler", "benchmarks.bench_bank"])
def test_gpu_form_without_cuda_is_one_clear_error(module, tmp_path):
    out = tmp_path / "r.md"
    res = subprocess.run([sys.executable, "-m", module, "--gpu", *(["--out", str(out)] if "run_all" in module else [])],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode == 2
    assert "--gpu: CUDA is not available on this machine" in res.stderr
    assert "Traceback" not in res.stderr and not out.exists()


def test_gpu_sizes_build_with_the_real_classes():
    from benchmarks.gpu import hunyuan15_small_transformer, param_count, wan22_small_transformer

    with torch.device("meta"):  # shapes and parameter counts without allocating
        wan, hy = wan22_small_transformer(), hunyuan15_small_transformer()
    assert type(wan).__name__ == "WanTransformer3DModel" and 150e6 < param_count(wan) < 300e6
    assert type(hy).__name__ == "HunyuanVideo15Transformer3DModel" and 300e6 < param_count(hy) < 1e9


def test_gpu_learner_config_is_valid_and_on_the_gpu_sizes():
    from benchmarks.bench_learner import _cfg
    from benchmarks.gpu import WAN_VIDEO

    cfg = _cfg("/models/wan22-small", "lora", quick=False, gpu=True)
    m = cfg.model
    assert (m.family, m.dtype, m.boundary_ratio) == ("wan", "bfloat16", 0.875)
    assert (m.num_frames, m.height, m.width) == tuple(WAN_VIDEO.values())
    assert cfg.pools.rollout.num_gpus > 0 and cfg.schedule.steps == 16
