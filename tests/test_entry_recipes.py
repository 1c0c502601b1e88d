"""The three entry recipes (issue 47): each config loads, names a released checkpoint the plan
sizes without weights, and `vgrpo plan` fits it with 10% of the GPU free at every role's peak
and at every shared device's; the one-GPU recipe's three roles are summed on their one device."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.cli import main
from cluster.plan.checks import gpu_checks
from cluster.plan.devices import device_total, role_peaks, shared_devices
from cluster.plan.sizing import GB, GPUS, arch, plan
from cluster.plan.vae import latent_shape
from common.config import load_config
from common.families import release_of

ROOT = Path(__file__).resolve().parents[1]
ONE_GPU, NODE, TI2V = (str(ROOT / f"configs/{n}.yaml") for n in
                       ("wan21_t2v_1p3b_1gpu", "wan21_t2v_1p3b_node", "wan22_ti2v_5b"))
pytestmark = pytest.mark.timeout(600)


def _gpus(cfg) -> float:
    """GPUs the pools ask for (one reward actor per model per replica)."""
    p = cfg.pools
    return (p.rollout.processes * p.rollout.num_gpus + p.learner.processes * p.learner.num_gpus
            + max(1, p.reward.num_actors) * len(cfg.rewards.models) * p.reward.num_gpus)


def _fits_with_margin(cfg) -> dict[str, float]:
    """Every role's peak per process and every shared device's total, at most 90% of the GPU."""
    p = plan(cfg)
    cap = GPUS[p.gpu][1] * GB
    peaks, free, reserved = role_peaks(cfg, p), cfg.plan.min_free, cfg.plan.gpu_reserved_gib * GB
    assert free == 0.10
    for role, need in peaks.items():
        assert need <= (1 - free) * cap, (role, need / GB)
    for dev in shared_devices(cfg):
        total = device_total(peaks, dev, reserved)
        assert total <= (1 - free) * cap, (dev.roles, total / GB)
    return peaks


@pytest.mark.parametrize("config", [ONE_GPU, NODE, TI2V], ids=["1gpu", "node", "ti2v_5b"])
def test_each_entry_recipe_loads_and_its_plan_fits_on_the_gpu_it_names(config, capsys):
    cfg = load_config(config)
    assert release_of(cfg.model.family, cfg.model.path) is not None  # sized from the declaration, no weights
    assert cfg.plan.gpu == "H100" and _gpus(cfg) == (1 if config == ONE_GPU else 8)
    _fits_with_margin(cfg)
    assert main(["plan", "-c", config]) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out and "does NOT fit" not in out.split("GPU memory per device")[1]
    assert "below the 10% margin" not in out
    for role in ("rollout", "reward", "learner"):  # printed per role ...
        assert any(line.strip().startswith(role) and "free)" in line
                   for line in out.split("GPU memory per device")[1].splitlines()), role


def test_the_one_gpu_recipe_shares_one_device_and_the_plan_sums_the_three_roles(capsys):
    cfg = load_config(ONE_GPU)
    m = cfg.model
    assert (m.path, m.num_frames, m.height, m.width, cfg.schedule.steps) == (
        "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", 33, 240, 416, 20)
    assert (cfg.optim.finetune, cfg.optim.lora_rank) == ("lora", 32)
    assert cfg.weight_sync.transport == "object_store"  # NCCL cannot join two processes on one GPU
    (dev,) = shared_devices(cfg)
    assert dev.roles == ["rollout", "reward", "learner"]
    peaks = _fits_with_margin(cfg)
    total = device_total(peaks, dev, cfg.plan.gpu_reserved_gib * GB)
    assert total > sum(peaks.values())  # ... and per device: the three peaks and their CUDA contexts
    assert main(["plan", "-c", ONE_GPU]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("GPU 0:"))
    assert "rollout + reward + learner" in line and f"{total / GB:.1f} GiB  (fits)" in line, line
    # each role alone fits, the three together do not: the device line says so
    # (and the text encoder kept on the GPU between encodes: model.text_encoder_offload=false)
    big = ["model.gradient_checkpointing=false", "optim.micro_batch=2", "model.text_encoder_offload=false"]
    bad = load_config(ONE_GPU, big)
    p = plan(bad)
    peaks = role_peaks(bad, p)
    reserved = bad.plan.gpu_reserved_gib * GB
    assert all(v < 80 * GB for v in peaks.values()) and device_total(peaks, shared_devices(bad)[0], reserved) > 80 * GB
    assert main(["plan", "-c", ONE_GPU, *big]) == 2  # printed, then refused in one line as train's preflight does
    out, err = capsys.readouterr()
    (msg,) = err.strip().splitlines()
    assert msg.startswith("error: pools: rollout + reward + learner share GPU 0") and "gpu_reserved_gib" in msg, msg
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("GPU 0:"))
    assert "(does NOT fit)" in line and "below the 10% margin" in line, line
    assert any(ln.startswith("  FAIL GPU 0 shared by rollout + reward + learner") for ln in out.splitlines()), out
    # each role alone passes its own check: only the device sum refuses
    assert [c.field for c in gpu_checks(bad, p) if not c.ok] == ["GPU 0"]
    assert main(["plan", "-c", ONE_GPU, *big, "preflight.skip_gpu_memory_check=true"]) == 0


def test_the_node_recipe_is_a_full_fine_tune_at_480p_81_frames():
    cfg = load_config(NODE)
    assert (cfg.model.num_frames, cfg.model.height, cfg.model.width, cfg.optim.finetune) == (81, 480, 832, "full")
    assert not shared_devices(cfg)
    a = arch(cfg)
    assert a.tokens == 21 * 30 * 52 and 1.3e9 < a.params < 1.5e9 and a.layers == 30 and a.width == 1536


@pytest.mark.parametrize("task", ["t2v", "i2v"])
def test_the_ti2v_5b_recipe_sizes_the_5b_with_its_vae_and_per_token_timesteps(task, capsys):
    cfg = load_config(TI2V, [f"model.task={task}"])
    a = arch(cfg)
    assert a.token_timesteps and a.layers == 30 and a.width == 3072 and 4.9e9 < a.params < 5.1e9
    assert latent_shape(cfg) == (48, 31, 44, 80) and a.tokens == 31 * 22 * 40  # 48 channels, 16x
    _fits_with_margin(cfg)
    assert main(["plan", "-c", TI2V, f"model.task={task}"]) == 0
    assert "FAIL" not in capsys.readouterr().out


def test_per_token_timesteps_cost_activation_memory():
    """TI2V-5B's per-token modulations are fp32 [S, 6, d] per block: the plan counts them."""
    from dataclasses import replace

    from cluster.plan.sizing import activation_bytes

    a = arch(load_config(TI2V))
    without = replace(a, token_timesteps=False)
    for ckpt in (True, False):
        extra = activation_bytes(a, 2, 2, ckpt) - activation_bytes(without, 2, 2, ckpt)
        assert extra >= 2 * a.tokens * a.width * 24
