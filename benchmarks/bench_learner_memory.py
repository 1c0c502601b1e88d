"""The lean learner's memory, `vgrpo plan` against measured, term by term (CPU, real classes).

`python -m benchmarks.bench_learner_memory [--ranks 2] [--check]` saves a Wan 2.2 I2V checkpoint
with two experts at reduced depth but a real block layout (diffusers' save_pretrained), samples
one group with the real sampler, then runs `--ranks` gloo learner ranks on the lean path
(learner/shard_load.py: built on meta, sharded, each rank reading its own rows). Each rank
measures, as live tensor storage bytes (common/tensor_bytes.py, not RSS):

- setup peak: while its trainer is made (fp32 master shard, EMA per shard, one weight's rows);
- step peak: what setup left resident plus the peak of one train step (gathered blocks,
  gradients, AdamW's moments, activations);
- checkpoint save: what a sharded save allocates (no copy of the shards);
- cpu offload, host resident: the masters, gradients, AdamW state and EMA a rank keeps under
  learner.cpu_offload after a step (the GPU then holds none of them).

and prints each next to the plan's figure. --check exits 1 unless every term is within 25%
(the checkpoint save: at most 5% of the shard, the plan's figure being no copy at all).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
from pathlib import Path

TOLERANCE = 0.25
WIDTH, HEADS, FFN, LAYERS = 256, 4, 1024, 4  # wide enough that each term is well above the rest


def _save_checkpoint(path: Path) -> None:
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        WanImageToVideoPipeline,
        WanTransformer3DModel,
    )

    from rollout_worker.models.tiny import tiny_wan_components

    comps = tiny_wan_components("i2v_a14b")
    for k in ("transformer", "transformer_2"):
        comps[k] = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=HEADS, attention_head_dim=WIDTH // HEADS, in_channels=12,
            out_channels=4, text_dim=16, freq_dim=64, ffn_dim=FFN, num_layers=LAYERS, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", rope_max_seq_len=256)
    WanImageToVideoPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), **comps).save_pretrained(path)


def config(path: Path, ranks: int, **learner):
    from common.config import RunConfig

    return RunConfig.model_validate({
        "model": {"family": "wan", "task": "i2v", "path": str(path), "num_frames": 9, "height": 64, "width": 64,
                  "dtype": "bfloat16", "guidance_scale": 1.0, "max_sequence_length": 16,
                  "train_experts": "high_noise"},
        "schedule": {"steps": 2, "shift": 1.0},
        "sampler": {"group_size": 2, "train_steps": "all"},
        "optim": {"finetune": "full", "micro_batch": 1, "ema_decay": 0.9},
        "kl": {"strategy": "none"}, "align": {"enabled": False},
        "pools": {"learner": {"num_actors": ranks, "num_cpus": 0.5, "torch_threads": 1}},
        "learner": learner})


def _batch(cfg, out: Path) -> None:
    import numpy as np
    import torch

    from common.types import Condition, Scores, TrainBatch
    from rollout_worker.models import build_model
    from rollout_worker.sampler import sample_group

    image = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8))
    group = sample_group(build_model(cfg, "cpu"), Condition("c0", "a red cat", image=image), cfg, seed=1,
                         policy_version=0)
    group.scores = Scores(["R"], torch.tensor([[0.2], [0.9]]))
    group.composite = torch.tensor([0.2, 0.9])
    for m in group.members:
        m.frames = None
    torch.save(TrainBatch([group], version=0), out)


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def _rank(rank: int, world: int, port: int, cfg_json: str, offload_json: str, batch: str, root: str,
          out: str) -> None:
    import torch

    from common.config import RunConfig
    from common.tensor_bytes import LiveTensorBytes, tensor_leaves
    from learner import dist_checkpoint, fsdp
    from learner.actor import make_trainer

    mesh = fsdp.init_distributed(rank, world, "127.0.0.1", port, "cpu", timeout_s=600).fsdp  # sp 1
    data = torch.load(batch, weights_only=False)
    cpu = torch.device("cpu")

    def reduce(t):
        t = t.clone()
        torch.distributed.all_reduce(t)
        return t

    res = {}
    with LiveTensorBytes() as setup:
        trainer = make_trainer(RunConfig.model_validate_json(cfg_json), cpu, mesh)
    res["setup peak"] = setup.peak
    with LiveTensorBytes() as step:
        trainer.train_step(data, rank=rank, world_size=world, reduce=reduce)
    res["step peak"] = setup.now + step.peak
    state = trainer.state_dict()
    res["shard"] = _local_bytes(t for t in tensor_leaves(state))
    with LiveTensorBytes() as save:
        dist_checkpoint.save(root, 1, state, {"cursor": 0}, keep=1)
    res["checkpoint save"] = save.peak
    del trainer, state
    off = make_trainer(RunConfig.model_validate_json(offload_json), cpu, mesh)
    off.train_step(data, rank=rank, world_size=world, reduce=reduce)
    pol = off.policy
    res["cpu offload, host resident"] = (
        _local_bytes(pol.params.values()) + _local_bytes(p.grad for p in pol.params.values() if p.grad is not None)
        + _local_bytes(t for s in off.optimizer.state.values() for t in s.values() if t.dim() > 0)
        + _local_bytes(t for a in pol.anchors.values() for t in a.values()))
    Path(f"{out}.{rank}").write_text(json.dumps(res), encoding="utf-8")
    fsdp.shutdown_process_group("barrier_only")


def planned(cfg, offload_cfg) -> dict[str, float]:
    from cluster.plan.sizing import (
        arch,
        learner_memory,
        learner_offloaded,
        learner_peak,
        learner_setup,
    )

    a = arch(cfg)
    return {"setup peak": sum(learner_setup(cfg, a).values()),
            "step peak": learner_peak(learner_memory(cfg, a), cfg.model.gradient_checkpointing),
            "checkpoint save": 0.0, "cpu offload, host resident": learner_offloaded(offload_cfg, a)}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--check", action="store_true", help=f"exit 1 unless every term is within {TOLERANCE:.0%}")
    args = ap.parse_args(argv)
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        _save_checkpoint(tmp / "ckpt")
        cfg = config(tmp / "ckpt", args.ranks)
        off = config(tmp / "ckpt", args.ranks, cpu_offload=True)
        _batch(cfg, tmp / "batch.pt")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(_rank, args=(args.ranks, port, cfg.model_dump_json(), off.model_dump_json(),
                                        str(tmp / "batch.pt"), str(tmp / "runs"), str(tmp / "out")),
                           nprocs=args.ranks, start_method="spawn", join=True)
        measured = [json.loads((tmp / f"out.{r}").read_text(encoding="utf-8")) for r in range(args.ranks)]
        plan = planned(cfg, off)  # from the checkpoint's own config.json and files
    ok = True
    print(f"lean learner, {args.ranks} gloo ranks, Wan 2.2 I2V experts of width {WIDTH}, ffn {FFN}, "
          f"{LAYERS} blocks (MiB per rank; measured: the largest rank)")
    print(f"  {'term':<28}{'plan':>10}{'measured':>10}{'ratio':>8}")
    for term, want in plan.items():
        got = max(m[term] for m in measured)
        if term == "checkpoint save":  # the plan's figure is no copy: allow 5% of the shard
            good = got <= 0.05 * max(m["shard"] for m in measured)
            ratio = "-"
        else:
            good = abs(got / want - 1) <= TOLERANCE
            ratio = f"{got / want:.2f}"
        ok &= good
        print(f"  {term:<28}{want / 2**20:10.2f}{got / 2**20:10.2f}{ratio:>8}{'' if good else '  OFF'}")
    if args.check and not ok:
        print(f"bench_learner_memory: a term is off the plan by more than {TOLERANCE:.0%}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
