"""Learner benchmark (not a test): `python -m benchmarks.bench_learner [--quick] [--gpu]`.

1. Step time per sample: Trainer.train_step (losses, anchors, clipping, AdamW) against a bare
   forward+backward of the same transformer on the same rows plus the anchor forward the KL
   strategy needs, in one run (ratio; goal ≤ 1.15).
2. Weight sync: WeightPublisher seconds (object_store and collective, to two rollout actors on a
   local Ray) against a memcpy of the same bytes, for the full weights and for the LoRA adapter.

Both use a mid-size Wan transformer (4 layers, 8 heads × 64: 67 MB in fp32, LoRA r16 2 MB)
loaded through the real Wan adapter from a temp dir, with the tiny text encoder and VAE: the
step runs 9×64×64 videos (48 tokens), so the transformer's compute dominates as it does at
real sizes and the ratio measures the learner's overhead; the sync measures bandwidth rather
than Ray's fixed cost per call.
`--gpu`: the small Wan 2.2 of benchmarks/gpu.py in bf16 on CUDA, 33 frames at 240×416, and
the two rollout actors on the same GPU (0.4 GPU each).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from common.config import RunConfig
from common.types import Condition, TrainBatch
from common.weights import nbytes


def _cfg(path: str, finetune: str, quick: bool, gpu: bool = False) -> RunConfig:
    if gpu:
        from benchmarks.gpu import wan22_small_overrides
        from common.config import apply_overrides, validate

        data = apply_overrides(_cfg(path, finetune, quick).model_dump(mode="json"), [
            *wan22_small_overrides(path), f"schedule.steps={8 if quick else 16}", "optim.lora_rank=32",
            "optim.micro_batch=8", "pools.rollout.num_gpus=0.4"])
        return validate(data, "bench_learner --gpu")
    return RunConfig.model_validate({
        "model": {"family": "wan", "path": path, "num_frames": 9, "height": 64, "width": 64,
                  "max_sequence_length": 16},
        "schedule": {"steps": 4 if quick else 8}, "sde": {"scheme": "sage"},
        "sampler": {"group_size": 4, "train_steps": "all", "ode_last_steps": 1},
        "optim": {"finetune": finetune, "micro_batch": 4, "lora_rank": 4},
        "kl": {"strategy": "dual"},
        "pools": {"rollout": {"num_actors": 2, "num_cpus": 0.5, "torch_threads": 1, "max_restarts": 0}},
    })


def _timed(fn, repeats: int) -> float:
    from benchmarks.gpu import sync

    fn()  # warm-up
    sync()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()  # CUDA runs asynchronously: time the work, not the launches
    return (time.perf_counter() - t0) / repeats


def bench_step(path: str, quick: bool, device: str = "cpu") -> dict:
    from learner.rows import build_rows, micro_batches
    from learner.trainer import Trainer
    from rollout_worker.models import build_model
    from rollout_worker.sampler import sample_group

    gpu = device != "cpu"
    cfg = _cfg(path, "lora", quick, gpu)
    model = build_model(cfg, device)
    groups = []
    for c in range(2):
        g = sample_group(model, Condition(id=f"b{c}", prompt=f"bench prompt {c}"), cfg, seed=c, policy_version=0)
        g.composite = torch.randn(g.size, generator=torch.Generator().manual_seed(c))
        groups.append(g)
    batch = TrainBatch(fresh=groups)
    trainer = Trainer(cfg, model, device=device).setup()
    rows = build_rows(batch, cfg)
    cond_all = trainer.encode(rows)

    lc = trainer.loss_cfg

    def bare() -> None:  # forward+backward of the same rows in the same micro-batches, and the anchor forwards
        for mb in micro_batches(rows, cfg.optim.micro_batch):
            cond = cond_all.index(mb.cond_idx)
            if lc.anchor is not None:
                trainer.policy.anchor_velocity(lc.anchor, mb.x.float(), mb.sigma, cond)
            if lc.needs_prev:
                trainer.policy.anchor_velocity("prev", mb.x.float(), mb.sigma, cond)
            v = trainer.policy.velocity(mb.x.float(), mb.sigma, cond)  # [b, C, F, H, W]
            v.float().pow(2).mean().backward()
        trainer.optimizer.zero_grad(set_to_none=True)

    repeats = 2 if quick else 5
    t_bare = _timed(bare, repeats)
    t_step = _timed(lambda: trainer.train_step(batch), repeats)
    return {"rows": rows.n, "step_s_per_sample": t_step / rows.n, "bare_fwd_bwd_s_per_sample": t_bare / rows.n,
            "ratio": t_step / t_bare}


# the weight-sync benchmark's transformer on CPU: big enough that bytes, not calls, dominate
MID_WAN = {"num_layers": 4, "num_attention_heads": 8, "attention_head_dim": 64, "ffn_dim": 2048}


def save_mid_wan(path: str) -> str:
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    from rollout_worker.models.tiny import tiny_wan_components

    comps = tiny_wan_components("t2v")
    torch.manual_seed(0)
    comps["transformer"] = WanTransformer3DModel(
        patch_size=(1, 2, 2), in_channels=4, out_channels=4, text_dim=16, freq_dim=64, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32, **MID_WAN).eval()
    WanPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), **comps).save_pretrained(path)
    return path


def _sync_cfg(path: str, quick: bool, gpu: bool) -> RunConfig:
    """The weight-sync config: on CPU the mid-size model's LoRA is r16 (the payload and the actors agree)."""
    cfg = _cfg(path, "lora", quick, gpu)
    if not gpu:
        cfg = cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"lora_rank": 16})})
    return cfg


def sync_payloads(path: str, quick: bool, gpu: bool, device: str) -> dict:
    """The full transformer weights and the LoRA adapter the learner publishes, for the model in `path`."""
    from learner.trainer import Trainer
    from rollout_worker.models import build_model

    cfg = _sync_cfg(path, quick, gpu)
    model = build_model(cfg, device)
    full = {k: v.detach().clone() for k, v in model.trainable_module().state_dict().items()}
    return {"full": full, "lora": Trainer(cfg, model, device=device).setup().weights_payload()}


def _memcpy_s(state: dict, repeats: int) -> float:
    dst = {k: torch.empty_like(v) for k, v in state.items()}
    return _timed(lambda: [dst[k].copy_(v) for k, v in state.items()], repeats)


def bench_sync(path: str, payloads: dict, quick: bool, gpu: bool = False) -> list[dict]:
    import ray

    from common.config import WeightSyncConfig
    from learner.weight_sync import WeightPublisher
    from rollout_worker.actor import create_rollout_actors

    cfg = _sync_cfg(path, quick, gpu)  # the actors hold the adapter the payload fills
    ray.init(num_cpus=2, num_gpus=1 if gpu else 0, resources={"rollout": 2}, include_dashboard=False,
             log_to_driver=False)
    try:
        actors = create_rollout_actors(cfg, count=2)
        # with optim.finetune=lora the rollout actors inject the same adapter themselves
        repeats, out, version = (2 if quick else 5), [], 0
        for kind in ("full", "lora"):
            state = payloads[kind]
            for transport in ("object_store", "collective"):
                pub = WeightPublisher(WeightSyncConfig(transport=transport, timeout_s=60), actors)

                def push(pub=pub, state=state) -> None:
                    nonlocal version
                    version += 1
                    pub.publish(state, version)

                t = _timed(push, repeats)
                pub.close()
                out.append({"payload": kind, "transport": transport, "bytes": nbytes(state),
                            "sync_s": t, "memcpy_s": _memcpy_s(state, repeats)})
        return out
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps and repeats")
    ap.add_argument("--gpu", action="store_true", help="small Wan 2.2 in bf16 on CUDA")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from benchmarks.gpu import save_wan22_small

    device = "cpu"
    if args.gpu:
        from benchmarks.gpu import require_cuda

        device = str(require_cuda())
    with tempfile.TemporaryDirectory() as path:
        if args.gpu:
            save_wan22_small(path)
        else:
            save_mid_wan(path)
        cfg = _cfg(path, "lora", args.quick, args.gpu)
        m = cfg.model
        print(f"config: {'small Wan 2.2 (2 experts, 4 layers, 12x128 heads)' if args.gpu else f'mid-size Wan {MID_WAN}'} "
              f"{m.dtype} on {device}, {m.num_frames}x{m.height}x{m.width}, T={cfg.schedule.steps} all trained, "
              f"2 groups x G={cfg.sampler.group_size}, LoRA r={cfg.optim.lora_rank}, micro-batch {cfg.optim.micro_batch}, "
              f"KL {cfg.kl.strategy}; weight sync to 2 rollout actors on a local Ray")
        step = bench_step(path, args.quick, device)
        print(json.dumps({"step": step}, indent=2))
    with tempfile.TemporaryDirectory() as path:
        if not args.gpu:
            save_mid_wan(path)
            print(f"weight sync: Wan transformer {MID_WAN} in float32 on cpu; LoRA r=16")
        else:
            save_wan22_small(path)
        payloads = sync_payloads(path, args.quick, args.gpu, device)
        for row in bench_sync(path, payloads, args.quick, args.gpu):
            row["ratio"] = row["sync_s"] / max(row["memcpy_s"], 1e-9)
            row["sync_mb_s"] = row["bytes"] / 2**20 / row["sync_s"]
            print(json.dumps(row))


if __name__ == "__main__":
    main()
