"""A checkpoint's policy written by the learner ranks that hold it (learner/policy_writer.py), in
diffusers' sharded safetensors layout (common/policy_layout.py), with no whole model on any host.

Four gloo ranks set up a widened tiny Wan 2.2 I2V (its high-noise expert trained) as a learner group does
(the lean sharded path), move every weight, and write the policy as a checkpoint does. Each
rank's host allocations during the write (torch storages and Python objects) stay within one
shard plus one bucket, and `vgrpo plan`'s figure for it is within 25% of what was measured. The
folder loads with diffusers' own `from_pretrained` and equals the weights the ranks held; vgrpo's
reader (eval, export) reads it shard by shard, and a damaged shard is one line naming it.
"""

from __future__ import annotations

import json
import socket

import pytest
import torch
import torch.multiprocessing as mp
from diffusers import (
    FlowMatchEulerDiscreteScheduler,
    WanImageToVideoPipeline,
    WanTransformer3DModel,
)
from helpers_dist import save_policy_on_ranks

from cluster.plan.host import POLICY_WRITE, checkpoint_host
from cluster.plan.sizing import plan
from cluster.runs.policy_file import PolicyFiles
from common.config import RunConfig
from common.policy_layout import CONFIG_FILE, WEIGHTS_INDEX, shard_name
from learner.checkpoint import CheckpointError
from rollout_worker.models.tiny import tiny_wan_components

pytestmark = pytest.mark.timeout(600)

WORLD = 4
BUCKET_MB = 1.0
SLACK = 2 * 2**20    # allocations beyond the tensors: Python's first-use caches (DTensor's sharding
                     # propagation, linecache), about 1 MiB measured, headers and JSON


def _wide_wan(path) -> None:
    """Tiny Wan 2.2 I2V whose high-noise expert is wide enough that one weight is megabytes."""
    comps = tiny_wan_components("i2v_a14b")
    torch.manual_seed(0)
    comps["transformer"] = WanTransformer3DModel(   # the high-noise expert, the one trained
        patch_size=(1, 2, 2), num_attention_heads=16, attention_head_dim=64, in_channels=12, out_channels=4,
        text_dim=16, freq_dim=16, ffn_dim=2048, num_layers=3, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
    WanImageToVideoPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), **comps).save_pretrained(path)


def _cfg(path) -> RunConfig:
    return RunConfig.model_validate({
        "model": {"family": "wan", "task": "i2v", "path": str(path), "num_frames": 5, "height": 16, "width": 16,
                  "guidance_scale": 2.0, "dtype": "bfloat16", "max_sequence_length": 16, "train_experts": "high_noise"},
        "schedule": {"steps": 3, "shift": 1.0}, "sampler": {"group_size": 2},
        "optim": {"finetune": "full", "micro_batch": 1}, "kl": {"strategy": "none"},
        "weight_sync": {"bucket_mb": BUCKET_MB},
        "pools": {"learner": {"num_actors": WORLD, "num_gpus": 0, "num_cpus": 0.5, "torch_threads": 1}}})


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(config, base dir, policy dir, each rank's measured peak) of one four-rank save."""
    tmp = tmp_path_factory.mktemp("policy")
    _wide_wan(tmp / "base")
    cfg = _cfg(tmp / "base")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    policy = tmp / "step_00000001" / "policy"
    out = str(tmp / "result")
    mp.start_processes(save_policy_on_ranks, args=(WORLD, port, cfg.model_dump_json(), str(policy), out),
                       nprocs=WORLD, start_method="spawn", join=True)
    peaks = []
    for r in range(WORLD):
        got = torch.load(f"{out}.{r}", weights_only=False)
        peaks.append(got["tensor_peak"] + got["python_peak"])
    return cfg, tmp / "base", policy, peaks


def test_each_rank_writes_its_own_shards_in_diffusers_layout(saved):
    _, _, policy, _ = saved
    files = []
    assert sorted(p.name for p in policy.iterdir()) == ["transformer"]   # the trained expert alone
    for expert in ("transformer",):
        index = json.loads((policy / expert / WEIGHTS_INDEX).read_text())
        shards = sorted(set(index["weight_map"].values()))
        n = len(shards)
        assert shards == [shard_name(k, n) for k in range(1, n + 1)]
        assert sorted(p.name for p in (policy / expert).iterdir()) == sorted([CONFIG_FILE, WEIGHTS_INDEX, *shards])
        assert index["metadata"]["vgrpo.weights"] == "live" and index["metadata"]["total_size"] == sum(
            (policy / expert / f).stat().st_size for f in shards) - sum(
            8 + int.from_bytes((policy / expert / f).read_bytes()[:8], "little") for f in shards)
        assert json.loads((policy / expert / CONFIG_FILE).read_text())["_class_name"] == "WanTransformer3DModel"
        files += [policy / expert / f for f in shards]
    # every rank wrote one: four runs of about equal bytes
    assert len(files) == WORLD
    sizes = sorted(f.stat().st_size for f in files)
    assert sizes[-1] < 1.6 * sum(sizes) / WORLD


def test_the_folder_loads_with_diffusers_and_equals_the_trained_weights(saved):
    _, base, policy, _ = saved
    for expert in ("transformer",):
        theirs = WanTransformer3DModel.from_pretrained(policy / expert)   # diffusers' own loader
        before = WanTransformer3DModel.from_pretrained(base, subfolder=expert)
        params = dict(before.named_parameters())
        loaded = theirs.state_dict()
        assert loaded.keys() == before.state_dict().keys()
        for k, w in before.state_dict().items():
            # the learner read the file's weight in model.dtype, held it in fp32, moved it; the policy is bf16
            want = ((w.to(torch.bfloat16).float() * 1.5 + 0.01) if k in params else w).to(torch.bfloat16)
            assert torch.equal(loaded[k].to(torch.bfloat16), want), (expert, k)


def test_each_ranks_host_peak_is_within_one_shard_and_a_bucket_and_the_plan_says_so(saved):
    cfg, _, policy, peaks = saved
    shards = [f.stat().st_size for f in policy.rglob("*.safetensors")]
    largest = max(v.numel() for v in WanTransformer3DModel.from_pretrained(policy / "transformer").parameters())
    assert largest * 2 > 1.5 * 2**20   # one weight is megabytes: the measure is of the tensors, not the noise
    figure = checkpoint_host(cfg, plan(cfg))[POLICY_WRITE]
    for r, peak in enumerate(peaks):
        assert peak <= min(shards) + BUCKET_MB * 2**20 + SLACK, (r, peak, min(shards))
        assert abs(figure - peak) <= 0.25 * peak, (r, figure, peak)


def test_vgrpo_reads_it_shard_by_shard_and_names_a_damaged_shard(saved, tmp_path):
    import shutil

    _, _, policy, _ = saved
    files = PolicyFiles(policy.parent)
    assert files.experts == ["transformer"] and files.meta["vgrpo.weights"] == "live"
    parts = list(files.parts())
    assert len(parts) == WORLD
    names = [k for p in parts for k in p]
    assert sorted(names) == sorted(files.names()) and len(names) == len(set(names))
    copy = tmp_path / "step_00000001"
    shutil.copytree(policy.parent, copy)
    shard = sorted((copy / "policy" / "transformer").glob("*.safetensors"))[-1]
    whole = shard.read_bytes()
    shard.write_bytes(whole[:-100])
    with pytest.raises(CheckpointError, match=f"^{shard}: truncated or damaged safetensors file"):
        PolicyFiles(copy)
    # bytes that make a weight NaN (safetensors has no checksum): named with the tensor as it is read
    start = 8 + int.from_bytes(whole[:8], "little")
    shard.write_bytes(whole[:start] + b"\xff\xff" + whole[start + 2:])
    files = PolicyFiles(copy)
    with pytest.raises(CheckpointError, match=f"^{shard}: tensor '.*' holds NaN/inf"):
        files.read_all()
