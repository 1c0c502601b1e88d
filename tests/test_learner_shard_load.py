"""The lean sharded learner setup (learner/shard_load.py) against today's reference path, on two
gloo ranks with real diffusers classes saved by their own save_pretrained: the same weights
before, the same loss and the same updated weights (and anchors) after one step, for Wan 2.2
I2V (two experts; only the trained high-noise one is built) and HunyuanVideo 1.5, and a setup
that holds about half the model per rank where the reference path holds all of it."""

from __future__ import annotations

import socket

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from diffusers import (
    FlowMatchEulerDiscreteScheduler,
    WanImageToVideoPipeline,
    WanTransformer3DModel,
)
from helpers_dist import lean_against_reference, resume_across_writers
from test_learner_lean import _save

from common.config import ConfigError, RunConfig, load_config
from common.types import Condition, Scores, TrainBatch
from learner.actor import make_trainer
from rollout_worker.models import build_model
from rollout_worker.models.tiny import tiny_wan_components
from rollout_worker.sampler import sample_group

pytestmark = pytest.mark.timeout(600)

IMAGE = torch.from_numpy(np.random.default_rng(3).integers(0, 256, (16, 16, 3), dtype=np.uint8))


def _cfg(family: str, path, **over) -> RunConfig:
    model = {"family": family, "task": "i2v", "path": str(path), "num_frames": 5, "height": 16, "width": 16,
             "guidance_scale": 2.0, "dtype": "bfloat16"}
    if family == "wan":
        model.update(max_sequence_length=16, train_experts="high_noise")
    return RunConfig.model_validate({
        "model": model, "schedule": {"steps": 3, "shift": 1.0},
        "sampler": {"group_size": 2, "train_steps": "all"},
        "optim": {"finetune": "full", "lr": 1e-3, "micro_batch": 1, "ema_decay": 0.9},
        "kl": {"strategy": "fixed", "schedule": "constant", "lam": 0.1},
        "pools": {"learner": {"num_cpus": 0.5, "torch_threads": 1}}, **over})


def _batch(cfg: RunConfig, path) -> None:
    rollout = build_model(cfg, "cpu")
    if cfg.model.family == "wan":
        assert rollout.transformer_2 is not None   # the rollout runs both experts
    group = sample_group(rollout, Condition("c0", "a red cat", image=IMAGE), cfg, seed=1, policy_version=0)
    group.scores = Scores(["R"], torch.tensor([[0.2], [0.9]]))
    group.composite = torch.tensor([0.2, 0.9])
    for m in group.members:
        m.frames = None
    torch.save(TrainBatch([group], version=0), path)


def _two_ranks(cfg: RunConfig, batch_path, tmp_path, offload: bool = False) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "result")
    mp.start_processes(lean_against_reference,
                       args=(port, cfg.model_dump_json(), batch_path and str(batch_path), out, offload),
                       nprocs=2, start_method="spawn", join=True)
    return [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("family,variant,finetune", [("wan", "i2v_a14b", "full"), ("hunyuan15", "i2v", "full"),
                                                     ("wan", "i2v_a14b", "lora")])
def test_a_lean_step_equals_the_reference_step(tmp_path, family, variant, finetune):
    """LoRA: the frozen base is sharded and read per rank too, the adapters drawn from the seed
    on the CPU as on a loaded model."""
    _save(family, variant, tmp_path / "ckpt")
    cfg = _cfg(family, tmp_path / "ckpt")
    if finetune == "lora":
        cfg.optim = cfg.optim.model_copy(update={"finetune": "lora", "lora_rank": 4})
    _batch(cfg, tmp_path / "batch.pt")
    ref, lean = _two_ranks(cfg, tmp_path / "batch.pt", tmp_path)[0].values()
    _same_step(ref, lean, family, finetune)


def _same_step(ref: dict, lean: dict, family: str, finetune: str) -> None:
    anchors = ["ema", "pi0"] if finetune == "full" else ["ema", "moving", "pi0"]
    assert lean["sharded"] and lean["master_dtypes"] == ["torch.float32"] and lean["anchors"] == anchors
    # Wan 2.2: the frozen low-noise expert, which the checkpoint has, is built by neither path
    assert lean["experts"] == ref["experts"] == ["transformer"]
    assert lean["before"].keys() == ref["before"].keys()
    for n, w in ref["before"].items():
        assert torch.equal(lean["before"][n], w), n        # the masters: the file's weights in bf16, as fp32
    for k in ("loss", "loss/policy", "loss/kl", "loss/align", "grad_norm", "kl/d_anchor"):
        assert lean["stats"][k] == pytest.approx(ref["stats"][k], abs=1e-6, rel=0), k
    # σ = 1, 2/3, 1/3: Wan 2.2 trains the two above its boundary (0.6), HunyuanVideo all three
    assert ref["stats"]["num_rows"] == lean["stats"]["num_rows"] == 2 * (2 if family == "wan" else 3)
    moved = 0
    for n, w in ref["after"].items():
        torch.testing.assert_close(lean["after"][n], w, rtol=0, atol=1e-6)
        moved += int(not torch.equal(w, ref["before"][n]))
    assert moved > len(ref["after"]) // 2                  # the step did update the weights compared
    for a in ("ema", "pi0"):
        for n, w in ref["anchor_values"][a].items():
            torch.testing.assert_close(lean["anchor_values"][a][n], w, rtol=0, atol=1e-6)


def test_cpu_offload_gives_the_same_step(tmp_path):
    """learner.cpu_offload: every FSDP2 unit under CPUOffloadPolicy (the masters, grads and AdamW
    state in host memory), and the step is the reference path's."""
    _save("wan", "i2v_a14b", tmp_path / "ckpt")
    cfg = _cfg("wan", tmp_path / "ckpt")
    _batch(cfg, tmp_path / "batch.pt")
    got = _two_ranks(cfg, tmp_path / "batch.pt", tmp_path, offload=True)[0]
    assert got["lean"]["offload"] == got["reference"]["offload"] == ["OffloadPolicy"]
    assert got["lean_offload"]["offload"] == ["CPUOffloadPolicy"]
    _same_step(got["reference"], got["lean_offload"], "wan", "full")


def _wide_wan(path) -> tuple[int, int]:
    """Tiny Wan 2.2 I2V with experts wide and deep enough that their weights dwarf every other
    tensor; returns one expert's parameter count and its largest parameter's."""
    comps = tiny_wan_components("i2v_a14b")
    for k in ("transformer", "transformer_2"):
        comps[k] = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=32, in_channels=12, out_channels=4,
            text_dim=16, freq_dim=16, ffn_dim=256, num_layers=8, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
    WanImageToVideoPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), **comps).save_pretrained(path)
    sizes = [p.numel() for p in comps["transformer"].parameters()]
    return sum(sizes), max(sizes)


def test_a_lean_rank_holds_half_the_model_during_setup(tmp_path):
    """Counted as tensor storage bytes allocated and alive (common/tensor_bytes.py), not RSS. With
    no anchor and no EMA the trained state at setup is the fp32 masters: 4 bytes a parameter,
    half of them per rank. The reference path holds the whole expert (bf16 + its fp32 masters)."""
    n, largest = _wide_wan(tmp_path / "ckpt")
    full_fp32 = 4 * n
    cfg = _cfg("wan", tmp_path / "ckpt", kl={"strategy": "none"}, optim={"finetune": "full", "micro_batch": 1})
    ranks = _two_ranks(cfg, None, tmp_path)
    for r in ranks:
        assert r["reference"]["setup_peak"] >= full_fp32         # the old path: every rank, the whole model
        # half the masters, plus the one weight being read (its rows in the file's and model.dtype)
        assert r["lean"]["setup_peak"] <= 0.5 * full_fp32 + 3 * 4 * largest, (r["lean"]["setup_peak"], full_fp32)
        assert r["lean"]["setup_peak"] <= 0.6 * full_fp32
        assert r["lean"]["setup_peak"] >= 0.45 * full_fp32       # the probe does see the rank's shard


def test_a_threshold_on_the_frozen_expert_is_refused_in_one_line(tmp_path):
    """Wan 2.2, train_experts=high_noise: a σ threshold below the boundary asks to train steps the
    frozen low-noise expert runs (the learner does not even build it). Refused naming the field:
    by `vgrpo train`'s preflight from the config's boundary (or a local checkpoint's), and by
    the learner from the checkpoint's when it builds."""
    from cluster.driver.preflight import check_experts

    tagrpo = load_config("configs/wan22_i2v_tagrpo.yaml")        # threshold 0.9 = boundary 0.9: fine
    assert tagrpo.sampler.sigma_threshold == tagrpo.model.boundary_ratio == 0.9
    check_experts(tagrpo)
    low = load_config(overrides=["model.family=wan", "model.boundary_ratio=0.9", "model.train_experts=high_noise",
                                 "sampler.train_steps=threshold", "sampler.sigma_threshold=0.5",
                                 "schedule.steps=4", "schedule.shift=1.0"])
    with pytest.raises(ConfigError, match=r"^sampler\.sigma_threshold = 0\.5 asks to train steps at σ = "
                                          r"0\.75, .* the frozen low-noise expert .*model\.train_experts=all$"):
        check_experts(low)
    check_experts(low.model_copy(update={"model": low.model.model_copy(update={"train_experts": "all"})}))
    _save("wan", "i2v_a14b", tmp_path / "ckpt")                  # boundary_ratio 0.6 in model_index.json
    cfg = _cfg("wan", tmp_path / "ckpt", sampler={"group_size": 2, "train_steps": "threshold",
                                                  "sigma_threshold": 0.3})
    for refuse in (lambda: check_experts(cfg), lambda: make_trainer(cfg, torch.device("cpu"))):
        with pytest.raises(ConfigError, match=r"sampler\.sigma_threshold = 0\.3 asks to train steps at σ = 0\.333.*"
                                              r"boundary_ratio 0\.6\)"):
            refuse()
    ok = cfg.model_copy(update={"sampler": cfg.sampler.model_copy(update={"sigma_threshold": 0.6})})
    assert make_trainer(ok, torch.device("cpu")).version == 0


def test_checkpoints_without_a_copy_and_resume_across_writers(tmp_path):
    """A checkpoint written before the lean learner (reference path, every shard cloned) resumes
    on the lean path to the same next step; the lean path's own save allocates no copy of the
    shards (counted in live tensor bytes; the old writer allocates them all) and resumes alike."""
    _save("wan", "i2v_a14b", tmp_path / "ckpt")
    cfg = _cfg("wan", tmp_path / "ckpt")
    _batch(cfg, tmp_path / "batch.pt")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "result")
    mp.start_processes(resume_across_writers, args=(port, cfg.model_dump_json(), str(tmp_path / "batch.pt"),
                                                    str(tmp_path / "runs"), out), nprocs=2, start_method="spawn",
                       join=True)
    for r in (torch.load(f"{out}.{k}", weights_only=False) for k in range(2)):
        for a, b in (("ref_second", "lean_from_old_second"), ("lean_third", "fresh_third")):
            for k in ("loss", "loss/policy", "loss/kl", "grad_norm", "version"):
                assert r[a][k] == pytest.approx(r[b][k], abs=1e-6, rel=0), (a, k)
        assert r["lean_third"]["version"] == 3.0
        assert r["old_save_peak"] >= 0.9 * r["state_bytes"] > 0     # the old writer: a copy of every shard
        assert r["new_save_peak"] <= 0.05 * r["state_bytes"]       # now: none
        assert r["files"] == ["extra.json", "meta.json", "rank00000.pt", "rank00001.pt"]
