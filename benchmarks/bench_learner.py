"""Learner benchmark (not a test):
`python -m benchmarks.bench_learner [--quick] [--smoke] [--gpu] [--sizes-mb 76 1024] [--bucket-mb 16]`.

1. Step time per sample: Trainer.train_step (losses, anchors, clipping, AdamW) against a bare
   forward+backward of the same transformer on the same rows plus the anchor forwards the
   Trainer runs (the KL anchor, and π_0 when health measures it), in one run (ratio; goal ≤ 1.15).
2. Weight sync: WeightPublisher seconds (object_store and collective, to two rollout actors on a
   local Ray, checksum on as by default) against one memcpy of the same bytes, for the full
   weights and the LoRA adapter of a 76 MB and a 1 GB model (`--sizes-mb`; goal ≤ 3× for the
   full payloads), and each receiver's peak of live receive buckets against the bucket size
   (goal ≤ 2 buckets). Beside it, the transport's floor: the bare transport moving the same
   buckets (no checksum, no load) over the same memcpy, which no publish can beat on this
   machine (on 2 shared CPU cores a gloo broadcast over loopback is itself several memcpys).

The step uses a mid-size Wan transformer (4 layers, 8 heads × 64: 76 MB in fp32) loaded through
the real Wan adapter from a temp dir, with the tiny text encoder and VAE: it runs 9×64×64
videos (48 tokens), so the transformer's compute dominates as it does at real sizes and the
ratio measures the learner's overhead. The sync uses the same transformer with as many blocks
as make each size (LoRA r16). `--smoke`: a 25 MB sync only, seconds (tests run it).
`--gpu`: the small Wan 2.2 of benchmarks/gpu.py in bf16 on CUDA, 33 frames at 240×416, and
the two rollout actors on the same GPU (0.4 GPU each).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import ray
import torch

from common import weights as W
from common.config import RunConfig, WeightSyncConfig
from common.types import Condition, TrainBatch
from common.weights import nbytes, plan
from learner.weight_sync import put_stream, stream_state


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
    cond_all = trainer.conditions(rows)

    lc, pi0 = trainer.method.loss_cfg, trainer.measures_pi0()

    def bare() -> None:  # forward+backward of the same rows in the same micro-batches, and the anchor forwards
        for mb in micro_batches(rows, cfg.optim.micro_batch):
            cond, x, nxt = cond_all.index(mb.cond_idx), mb.x.float(), mb.sigma_next
            if lc.anchor is not None:
                trainer.policy.anchor_velocity(lc.anchor, x, mb.sigma, cond, nxt)
            if pi0:  # the health check's KL to π_0 (Trainer.measures_pi0)
                trainer.policy.anchor_velocity("pi0", x, mb.sigma, cond, nxt)
            v = trainer.policy.velocity(x, mb.sigma, cond, nxt)  # [b, C, F, H, W]
            v.float().pow(2).mean().backward()
        trainer.optimizer.zero_grad(set_to_none=True)

    repeats = 2 if quick else 5
    t_bare = _timed(bare, repeats)
    t_step = _timed(lambda: trainer.train_step(batch), repeats)
    return {"rows": rows.n, "step_s_per_sample": t_step / rows.n, "bare_fwd_bwd_s_per_sample": t_bare / rows.n,
            "ratio": t_step / t_bare}


# the weight-sync benchmark's transformer on CPU: big enough that bytes, not calls, dominate
MID_WAN = {"num_layers": 4, "num_attention_heads": 8, "attention_head_dim": 64, "ffn_dim": 2048}
LAYER_MB, ROOT_MB = 16.8, 8.6  # MID_WAN's fp32 MB per block and outside the blocks


def save_mid_wan(path: str, layers: int = MID_WAN["num_layers"]) -> str:
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    from rollout_worker.models.tiny import tiny_wan_components

    comps = tiny_wan_components("t2v")
    torch.manual_seed(0)
    comps["transformer"] = WanTransformer3DModel(
        patch_size=(1, 2, 2), in_channels=4, out_channels=4, text_dim=16, freq_dim=64, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32, **{**MID_WAN, "num_layers": layers}).eval()
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


@ray.remote(num_cpus=0)
class _Mapper:
    """A bare receiver for the object store's floor: maps each bucket of a payload in turn, as
    load_streamed takes them, and copies it once into memory it keeps (as a receiver must write
    the bytes into its parameters); no check."""

    def __init__(self) -> None:
        self.dst: dict[tuple[int, int], object] = {}

    def take(self, refs: list) -> int:
        import numpy as np

        n = 0
        for i, ref in enumerate(refs):
            for j, a in enumerate(ray.get(ref)):
                flat = a.reshape(-1).view(np.uint8)
                dst = self.dst.get((i, j))
                if dst is None or dst.nbytes != flat.nbytes:
                    dst = self.dst[(i, j)] = np.empty_like(flat)
                np.copyto(dst, flat)
                n += flat.nbytes
        return n


def _floor_s(transport: str, pub, actors: list, mappers: list, state: dict, bucket_bytes: int,
             repeats: int) -> float:
    """The transport alone moving the payload's bytes to both actors, in the same buckets: what
    no publish can beat here. object_store: each bucket put (one copy) and mapped by two bare
    receivers; collective: prebuilt buckets broadcast over the publisher's group, the actors
    receiving them as a stale version (drained: no digest, no load)."""
    if transport == "object_store":
        def once() -> None:
            record = put_stream(stream_state(state, bucket_bytes, 0), "off")
            ray.get([m.take.remote(record.weights.refs) for m in mappers])
        return _timed(once, repeats)
    m, buckets = W.flatten(state, bucket_bytes, 0)   # version 0: older than the actors' own
    md = m.to_dict()

    def once() -> None:
        calls = [a.receive_weights.remote(0, md) for a in actors]
        for w in [pub._group.broadcast(b) for b in buckets]:
            w.wait()
        assert ray.get(calls) == [False] * len(actors)   # drained, not loaded
    return _timed(once, repeats)


def _sync_rows(path: str, quick: bool, gpu: bool, device: str, bucket_mb: float, version: list) -> list[dict]:
    """Each payload (full, LoRA) by each transport to two rollout actors, against a memcpy and
    against the transport's own floor (`_floor_s`)."""
    from learner.weight_sync import WeightPublisher
    from rollout_worker.actor import create_rollout_actors

    cfg = _sync_cfg(path, quick, gpu)  # the actors hold the adapter the payload fills
    payloads = sync_payloads(path, quick, gpu, device)
    actors = create_rollout_actors(cfg, count=2)
    mappers = [_Mapper.remote() for _ in actors]
    repeats, out = (2 if quick else 5), []
    try:
        for kind in ("full", "lora"):
            state = payloads[kind]
            t_copy = _memcpy_s(state, repeats)
            for transport in ("object_store", "collective"):
                ws = WeightSyncConfig(transport=transport, timeout_s=300, bucket_mb=bucket_mb)  # checksum: default
                pub = WeightPublisher(ws, actors, device=device)

                def push(pub=pub, state=state) -> None:
                    version[0] += 1
                    pub.publish(state, version[0])

                push()  # the collective group forms on the first publish
                ray.get([a.weight_buckets.remote(reset=True) for a in actors])
                t = _timed(push, repeats)
                gauges = ray.get([a.weight_buckets.remote() for a in actors])
                t_floor = _floor_s(transport, pub, actors, mappers, state, ws.bucket_bytes, repeats)
                largest = max(b.nbytes for b in plan(state, ws.bucket_bytes, 0).buckets)
                pub.close()
                out.append({"payload": kind, "transport": transport, "bytes": nbytes(state),
                            "checksum": ws.checksum, "sync_s": t, "memcpy_s": t_copy,
                            "ratio": t / max(t_copy, 1e-9), "floor_s": t_floor,
                            "floor_ratio": t_floor / max(t_copy, 1e-9),
                            "over_floor": t / max(t_floor, 1e-9), "bucket_mb": bucket_mb,
                            "largest_bucket_mb": largest / 2**20,
                            "receiver_peak_mb": max(g["peak_bytes"] for g in gauges) / 2**20,
                            "peak_buckets": max(g["peak"] for g in gauges)})
    finally:
        for a in [*actors, *mappers]:
            ray.kill(a)
    return out


def store_bytes(sizes_mb: list[float]) -> int:
    """The object store for the sync: room for three payloads of the largest size (the one being
    put, the one the actors still map, slack), at least 256 MiB."""
    return max(256 << 20, int(3 * max(sizes_mb) * 2**20))


def warm_object_store(store: int, chunk: int = 64 << 20) -> tuple[float, float]:
    """Put (and free) throwaway buffers until the object store's whole memory has been written
    once, then a quarter of it again; returns the put rates (GB/s) of the two passes. A put into
    pages the store has not used lately takes a page fault per 4 KiB: on the 2-core VM about
    2 GB/s, against 10-13 GB/s into pages it reuses (`ray.put` of 64 MB arrays, 2 alive). Every
    put of the first pass is of the first kind, which a long run pays once; after it, which kind
    a put meets is up to the store's allocator (stretches of both were seen), so the two rates
    are printed beside the sync's rows."""
    import numpy as np

    buf, live = np.ones(chunk // 8), []

    def put_pass(nbytes: int) -> float:
        nonlocal live
        t0, done = time.perf_counter(), 0
        while done < nbytes:
            live.append(ray.put(buf))
            live = live[-2:]
            done += chunk
        return done / 1e9 / (time.perf_counter() - t0)

    return put_pass(store + 2 * chunk), put_pass(store // 4)


def bench_sync(sizes_mb: list[float], quick: bool, gpu: bool, device: str, bucket_mb: float) -> list[dict]:
    """bench_sync for each payload size: MID_WAN with as many blocks as make it that size (fp32),
    on an object store warmed first (`warm_object_store`)."""
    store = store_bytes(sizes_mb)
    ray.init(num_cpus=2, num_gpus=1 if gpu else 0, resources={"rollout": 2}, include_dashboard=False,
             log_to_driver=False, object_store_memory=store)
    rows, version = [], [0]
    try:
        cold, warm = warm_object_store(store)
        print(f"object store of {store / 2**30:.2f} GiB, written through before timing: put "
              f"{cold:.1f} GB/s on its first pass (fresh pages), {warm:.1f} GB/s on a second")
        for size in sizes_mb:
            with tempfile.TemporaryDirectory() as path:
                if gpu:
                    from benchmarks.gpu import save_wan22_small

                    save_wan22_small(path)
                else:
                    save_mid_wan(path, max(1, round((size - ROOT_MB) / LAYER_MB)))
                rows += _sync_rows(path, quick, gpu, device, bucket_mb, version)
            if gpu:
                break  # one size: the small Wan 2.2
    finally:
        ray.shutdown()
    return rows


def print_sync(rows: list[dict]) -> None:
    """Side by side: sync over memcpy, the transport's floor over memcpy (the same bytes moved by
    the bare transport: the goal is judged against it), sync over that floor, and each
    receiver's most live receive buckets (count, MB) against the largest bucket (bucket_mb, or a
    tensor larger than it, which travels alone)."""
    print(f"{'payload':<8}{'transport':<14}{'MB':>8}{'sync s':>9}{'memcpy s':>10}{'ratio':>7}"
          f"{'floor':>7}{'/floor':>7}{'MB/s':>8}{'bucket MB':>10}{'largest':>9}{'recv peak':>10}{'MB':>8}")
    for r in rows:
        print(f"{r['payload']:<8}{r['transport']:<14}{r['bytes'] / 2**20:8.1f}{r['sync_s']:9.3f}"
              f"{r['memcpy_s']:10.4f}{r['ratio']:7.1f}{r['floor_ratio']:7.1f}{r['over_floor']:7.1f}"
              f"{r['bytes'] / 2**20 / r['sync_s']:8.0f}"
              f"{r['bucket_mb']:10g}{r['largest_bucket_mb']:9.1f}{r['peak_buckets']:10d}"
              f"{r['receiver_peak_mb']:8.1f}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps and repeats")
    ap.add_argument("--smoke", action="store_true", help="the quickest run: a 25 MB sync payload, no step")
    ap.add_argument("--gpu", action="store_true", help="small Wan 2.2 in bf16 on CUDA")
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[76.0, 1024.0],
                    help="full-payload sizes for the weight sync (fp32 MB; default 76 and 1024)")
    ap.add_argument("--bucket-mb", type=float, default=WeightSyncConfig().bucket_mb,
                    help="weight_sync.bucket_mb for the sync (default: the config's)")
    ap.add_argument("--no-step", action="store_true", help="only the weight sync")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.smoke:
        args.quick, args.no_step, args.sizes_mb, args.bucket_mb = True, True, [25.0], 4.0
    from benchmarks.gpu import save_wan22_small

    device = "cpu"
    if args.gpu:
        from benchmarks.gpu import require_cuda

        device = str(require_cuda())
    if not args.no_step:
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
    what = "small Wan 2.2 in bf16 on CUDA" if args.gpu else \
        f"Wan transformers {MID_WAN | {'num_layers': 'sized'}} in float32 on cpu, LoRA r=16"
    print(f"weight sync: {what}; payload sizes {args.sizes_mb} MB; to 2 rollout actors, buckets of "
          f"{args.bucket_mb:g} MB, checksum {WeightSyncConfig().checksum} (the default); "
          "ratio = sync / one memcpy of the payload; floor = the bare transport moving the same buckets "
          "to both actors (object_store: put + mapped and copied once by 2 bare receivers; collective: the broadcast "
          "alone, received and dropped), over the memcpy; /floor = sync / floor")
    rows = bench_sync(args.sizes_mb, args.quick, args.gpu, device, args.bucket_mb)
    for row in rows:
        print(json.dumps(row))
    print_sync(rows)


if __name__ == "__main__":
    main()
