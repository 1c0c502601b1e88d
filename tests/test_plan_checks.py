"""`vgrpo plan` checks the config it sizes, and `vgrpo train`'s preflight refuses what it refuses:
the stored steps per member counted as the real sampler draws them, the bank's bytes per member
as the real codec writes them, the VAE's FLOPs as torch counts them at full size, and every
refusal one line naming the field, the figure and the fix (exit 2, no run directory)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from cluster.cli import main
from common.config import load_config

ROOT = Path(__file__).resolve().parents[1]
WAN, HUNYUAN = ROOT / "configs" / "wan22_i2v_tagrpo.yaml", ROOT / "configs" / "hunyuan15_t2v_sage.yaml"
pytestmark = pytest.mark.timeout(600)

# --- what each member stores: the sampler's own draw -------------------------------------------

TINY = ["model.num_frames=5", "model.height=16", "model.width=16", "model.max_sequence_length=16",
        "sampler.group_size=4", "schedule.steps=8", "schedule.shift=3.0"]
DRAWS = {  # (tiny model variant, overrides): every rule that decides which steps a member trains
    "wan22 high-noise expert, threshold": ("i2v_a14b", ["model.task=i2v", "model.boundary_ratio=0.6",
                                                         "model.train_experts=high_noise",
                                                         "sampler.train_steps=threshold", "sampler.sigma_threshold=0.8"]),
    "wan22 high-noise expert, fraction": ("i2v_a14b", ["model.task=i2v", "model.boundary_ratio=0.6",
                                                        "model.train_experts=high_noise", "sampler.train_fraction=0.6"]),
    "one expert, all but the ODE tail": ("t2v", ["sampler.train_steps=all", "sampler.ode_last_steps=3"]),
    "flow, fraction per group": ("t2v", ["sde.scheme=flow", "sampler.train_fraction=0.5",
                                         "sampler.step_draw=per_group", "align.enabled=false"]),
}


@pytest.mark.parametrize("case", list(DRAWS))
def test_stored_steps_per_member_are_the_steps_the_real_sampler_trains(case):
    from cluster.plan.steps import stored_steps_per_member
    from common.types import Condition
    from rollout_worker.models.tiny import tiny_wan_model
    from rollout_worker.sampler import sample_group

    variant, overrides = DRAWS[case]
    cfg = load_config(overrides=["model.family=wan", *TINY, *overrides])
    model = tiny_wan_model(cfg.model.model_dump(), variant)
    image = torch.zeros(16, 16, 3, dtype=torch.uint8) if cfg.model.task == "i2v" else None
    group = sample_group(model, Condition(id="c", prompt="a cat", image=image), cfg, seed=3, policy_version=0)
    trained = [len(m.step_indices) for m in group.members]
    k = stored_steps_per_member(cfg)
    assert trained == [k] * cfg.sampler.group_size
    assert 0 < k < cfg.schedule.steps  # each rule leaves some steps untrained


# --- what a member weighs: the real codec -------------------------------------------------------

@pytest.mark.parametrize("config", [WAN, HUNYUAN], ids=["wan22", "hunyuan15"])
def test_member_bytes_are_what_the_codec_writes_for_the_stored_steps(config):
    """One member of the config's real shapes with its stored steps, encoded by memory_bank.codec
    and counted as MemoryBank.push_group counts it. Today's codec keeps the I2V first frame in
    every member; the agreed format keeps it once per group (the plan's condition)."""
    from cluster.plan.bank import bank_size
    from common.types import Condition, Trajectory
    from memory_bank import codec

    cfg = load_config(config)
    b = bank_size(cfg)
    k, shape = b.steps_per_member, b.latent
    dtype = torch.bfloat16 if cfg.sampler.latent_dtype == "bfloat16" else torch.float32
    image = torch.zeros(cfg.model.height, cfg.model.width, 3, dtype=torch.uint8) if cfg.model.task == "i2v" else None
    from common.sde import Schedule, scheme_from_config

    schedule = Schedule.from_config(cfg.schedule)
    traj = Trajectory(
        condition=Condition(id="c0", prompt="a prompt of ordinary length " * 4, image=image),
        group_id="g0", member=0, seed=1, spec=scheme_from_config(cfg, schedule).spec(schedule),
        guidance_scale=cfg.model.guidance_scale, policy_version=0,
        step_indices=list(range(k)),
        x=torch.zeros(k, *shape, dtype=dtype), x_next=torch.zeros(k, *shape, dtype=dtype),
        logp_old=torch.zeros(k), final_latents=torch.zeros(*shape, dtype=dtype),
        mu_old=torch.zeros(k, *shape) if cfg.records_mu_old else None, frames=None)
    meta, blob = codec.encode("0" * 32, traj, ["h"], torch.zeros(1), 0.0, cond_key="1" * 32)
    written = len(blob) + sum(len(f) + len(v.encode()) for f, v in meta.items())
    assert written <= b.member <= 1.01 * written  # the condition is a record of its own, once per group


# One group of the Hunyuan config's real shapes into its bank section: tests/test_bank_real_shapes.py


# --- the VAE's FLOPs: the probe against torch's count at full size -----------------------------

@pytest.mark.parametrize("family", ["wan", "hunyuan15"])
def test_vae_flops_probe_matches_a_full_size_count(family):
    from torch.utils.flop_counter import FlopCounterMode

    from cluster.plan.vae import _vae_class, latent_shape, vae_config, vae_flops

    cfg = load_config(overrides=[f"model.family={family}", "model.num_frames=17", "model.height=256",
                                 "model.width=256"])
    with torch.device("meta"):
        vae = _vae_class(family).from_config(vae_config(cfg))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        vae.decode(torch.empty(1, *latent_shape(cfg), device="meta"))
    full = counter.get_total_flops()
    assert full > 1e12
    assert 0.95 < vae_flops(cfg, "decode") / full < 1.15  # the probe errs high, by a few percent


# --- refusals: one line naming the field, the figure and the fix --------------------------------

REFUSED = {  # config, overrides, the refusal's start
    "bank below its headroom": (HUNYUAN, ["bank.max_bytes=2147483648"],
                                "bank.max_bytes = 2147483648 holds 0.61 training steps, below bank.headroom_steps = 2"),
    "headroom raised": (WAN, ["bank.headroom_steps=5"], "bank.max_bytes = 8589934592 holds 4.00 training steps"),
    "group slower than its timeout": (HUNYUAN, ["sampler.timeout_s=900"],
                                      "sampler.timeout_s = 900 is below 3x the 952.5 s the work takes"),
    "publish with checksum": (WAN, ["weight_sync.timeout_s=120"], "weight_sync.timeout_s = 120 is below 3x"),
    "collective below a micro-batch": (WAN, ["learner.collective_timeout_s=10"],
                                       "learner.collective_timeout_s = 10 is below 3x"),
    # each learner rank reads only its own rows (3.6 GB of the 28.6 GB expert at 8 ranks)
    "slow storage": (WAN, ["plan.storage_gb_s=0.002"], "learner.load_timeout_s = 3600 is below 3x the 1786"),
    "checkpoint": (WAN, ["learner.checkpoint_timeout_s=60"], "learner.checkpoint_timeout_s = 60 is below 3x"),
    # one learner rank holds the whole 14B expert, its fp32 masters and AdamW: 283 GiB a step
    "single learner rank": (WAN, ["pools.learner.num_actors=1"],
                            "pools.learner: the plan's learner peak (train step, with gradient checkpointing) of 283.1 GiB"),
    # on an 80 GB GPU, the whole group in one forward and UMT5 kept on the GPU leave under 10% free
    "rollout margin": (WAN, ["plan.gpu=H100", "sampler.forward_batch_size=null", "model.text_encoder_offload=false"],
                       "pools.rollout: the plan's rollout peak (while generating) of 85.6 GiB"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_plan_refuses_in_one_line(case, capsys):
    config, overrides, start = REFUSED[case]
    assert main(["plan", "-c", str(config), *overrides]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.count("\n") == 0 and err.startswith(f"error: {start}"), err
    assert "set " in err  # the fix
    field = start.split(" = ")[0].split(":")[0]
    assert f"FAIL {field}" in captured.out  # the report still printed, the failing line marked


def _values(tmp_path, **groups_memory) -> Path:
    values = yaml.safe_load((ROOT / "deploy" / "helm" / "vgrpo" / "values.yaml").read_text())
    for name, memory in groups_memory.items():
        if name == "redis":
            values["redis"]["maxmemory"] = memory
        else:
            values["workerGroups"][name]["memory"] = memory
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def test_plan_refuses_pods_below_the_plan(tmp_path, capsys):
    assert main(["plan", "-c", str(WAN), "--values", str(_values(tmp_path, rollout="64Gi"))]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: workerGroups.rollout.memory = 64Gi is below the plan's 84.3 GiB "
                          "(1 rollout x 68.3 GiB + /dev/shm 16Gi); set it to at least 85Gi"), err
    assert main(["plan", "-c", str(WAN), "--values", str(_values(tmp_path, learner="16Gi"))]) == 2
    assert "workerGroups.learner.memory = 16Gi is below the plan's 20.3 GiB (1 learner x 4.3 GiB + /dev/shm 16Gi)" in capsys.readouterr().err
    assert main(["plan", "-c", str(WAN), "--values", str(_values(tmp_path, redis="8gb"))]) == 2
    assert capsys.readouterr().err.startswith("error: redis.maxmemory = 8gb is below bank.max_bytes = 8589934592")


@pytest.mark.parametrize("config", [WAN, HUNYUAN], ids=["wan22", "hunyuan15"])
def test_the_shipped_configs_pass_on_the_gpu_they_name(config, capsys):
    cfg = load_config(config)
    assert cfg.plan.gpu == "H200"
    assert main(["plan", "-c", str(config)]) == 0
    out = capsys.readouterr().out
    assert f"on {cfg.plan.gpu} " in out.splitlines()[0] and out.strip().endswith(f"plan: GPU memory, bank, timeouts and pods ok for {cfg.plan.gpu}")
    for line in ("per step", "per group", "stored steps per member", "host RAM per process",
                 "sampler.timeout_s", "workerGroups.rollout.memory", "redis.maxmemory"):
        assert line in out, line
    assert "FAIL" not in out


def test_train_preflight_refuses_what_the_plan_refuses(tmp_path, capsys):
    runs = tmp_path / "runs"
    code = main(["train", "-c", str(HUNYUAN), "train.prompts=toy-train", "train.eval_prompts=toy-eval",
                 f"run.root={runs}", "sampler.timeout_s=900"])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: sampler.timeout_s = 900 is below 3x"), err
    assert not runs.exists()  # refused before the run directory
    # a plan peak over the GPU: one learner rank fully fine-tuning the 8.3B transformer (fp32
    # masters, grads and AdamW on one GPU) is refused before Ray starts or a directory is made
    code = main(["train", "-c", str(HUNYUAN), "train.prompts=toy-train", "train.eval_prompts=toy-eval",
                 f"run.root={runs}", "pools.learner.num_actors=1", "optim.finetune=full"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0, err
    assert err.startswith("error: pools.learner: the plan's learner peak (train step, "), err
    assert not runs.exists()


def test_train_preflight_checks_the_pods_the_config_names():
    """plan.pods (the chart writes it, tests/test_deploy_chart.py) is checked at train time."""
    from cluster.driver.preflight import check_plan
    from common.config import ConfigError

    pods = "plan.pods={groups: {rollout: {memory: 64Gi, roles: {rollout: 1}}}, shm: 16Gi}"
    with pytest.raises(ConfigError, match=r"^workerGroups\.rollout\.memory = 64Gi is below the plan's 84\.3 GiB"):
        check_plan(load_config(WAN, [pods]))
    check_plan(load_config(WAN, [pods.replace("64Gi", "96Gi")]))  # the chart's value passes
    check_plan(load_config("configs/quickstart.yaml", ["bank.max_bytes=1048576"]))  # toy: no plan, not sized
