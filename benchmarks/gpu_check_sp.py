"""gpu_check's sequence-parallelism and attention-backend section (benchmarks/gpu_check.py runs it).

1. Attention backends: one self-attention at Wan 2.2 A14B width (40 heads × 128, bf16) over the
   TAGRPO config's 10,080 video tokens and 720p × 81 frames' 75,600, through diffusers'
   dispatcher; each installed backend's time as a ratio to SDPA (`native`), side by side in one
   run. A backend whose package is missing is reported as not measured.
2. Ulysses SP: a Wan transformer of two blocks at A14B width over 75,600 tokens on 2 GPUs (NCCL),
   against the same forward on one: max |Δ velocity|, the time ratio and rank 0's peak memory
   ratio. It needs two GPUs (NCCL refuses two ranks on one).

`smoke=True` (gpu_check --smoke-cpu, the tests) runs both at toy size on the CPU (gloo).
"""

from __future__ import annotations

import socket
import time

# latent (frames, height, width) of the SP check: 720p × 81 frames is 21 × 90 × 160 (patch 2: 75,600 tokens)
FULL = {"heads": 40, "head_dim": 128, "ffn": 13824, "lengths": (10_080, 75_600), "latent": (21, 90, 160), "blocks": 2}
SMOKE = {"heads": 2, "head_dim": 8, "ffn": 32, "lengths": (64, 256), "latent": (4, 8, 8), "blocks": 2}
BACKENDS = {"flash": "flash", "flash3": "_flash_3", "sage": "sage"}  # model.attention_backend names


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _time(fn, device: str, reps: int) -> float:
    fn()  # warm-up (kernel selection, lazy init)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / reps


def _attention_time(backend: str, qkv: tuple, device: str, reps: int) -> float:
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    return _time(lambda: dispatch_attention_fn(*qkv, backend=backend), device, reps)


def attention_ratios(report: dict, device: str = "cuda", smoke: bool = False) -> None:
    """Each installed backend's attention time over SDPA's, at each length."""
    import torch

    from common.config import ConfigError
    from rollout_worker.models.kernels import check_backend

    size = SMOKE if smoke else FULL
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    for n in size["lengths"]:
        g = torch.Generator(device).manual_seed(0)
        qkv = tuple(torch.randn(1, n, size["heads"], size["head_dim"], generator=g, device=device, dtype=dtype)
                    for _ in range(3))  # [B, S, H, D], diffusers' layout
        reps = 3 if smoke else 5
        t_sdpa = _attention_time("native", qkv, device, reps)
        label = f"{n / 1000:.0f}k" if n >= 1000 else str(n)
        for name, backend in BACKENDS.items():
            key = f"attention {name}/SDPA @ {label} tokens"
            try:
                check_backend(name)
            except ConfigError:
                report[key] = f"not measured ({name}'s package is not installed)"
                continue
            t = _attention_time(backend, qkv, device, reps)
            report[key] = f"{t / t_sdpa:.2f} ({t * 1e3:.1f} ms / {t_sdpa * 1e3:.1f} ms)"
        report[f"attention SDPA @ {label} tokens"] = f"{t_sdpa * 1e3:.1f} ms ({size['heads']}x{size['head_dim']})"


def _transformer(size: dict, device: str):
    import torch
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    t = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=size["heads"],
                              attention_head_dim=size["head_dim"], in_channels=16, out_channels=16, text_dim=64,
                              freq_dim=32, ffn_dim=size["ffn"], num_layers=size["blocks"])
    return t.to(device, torch.float32 if device == "cpu" else torch.bfloat16).eval()


def _inputs(size: dict, device: str, dtype):
    import torch

    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 16, *size["latent"], generator=g)
    text = torch.randn(1, 16, 64, generator=g)
    return x.to(device, dtype), torch.tensor([500.0], device=device), text.to(device, dtype)


def _sp_rank(rank: int, world: int, port: int, smoke: bool, out) -> None:
    import torch
    import torch.distributed as dist

    from rollout_worker.models.sp import enable_sp, sp_mesh

    device = "cpu" if smoke else "cuda"
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("gloo" if smoke else "nccl", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    size = SMOKE if smoke else FULL
    t = _transformer(size, device)
    x, ts, text = _inputs(size, device, next(t.parameters()).dtype)
    reps = 2 if smoke else 3
    with torch.no_grad():
        if rank == 0:  # the single-GPU reference on rank 0 alone, before the SP group exists
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            ref = t(x, ts, text, return_dict=False)[0]
            t_one = _time(lambda: t(x, ts, text, return_dict=False), device, reps)
            peak_one = torch.cuda.max_memory_allocated() if device == "cuda" else float("nan")
        dist.barrier()
        enable_sp(t, sp_mesh(world, device))
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        got = t(x, ts, text, return_dict=False)[0]
        t_sp = _time(lambda: t(x, ts, text, return_dict=False), device, reps)
        peak_sp = torch.cuda.max_memory_allocated() if device == "cuda" else float("nan")
    if rank == 0:
        out.put((float((got.float() - ref.float()).abs().max()), t_sp / t_one, peak_sp / peak_one,
                 x.shape[2] * x.shape[3] * x.shape[4] // 4))  # tokens: patch (1, 2, 2)
    dist.barrier()
    dist.destroy_process_group()


def sp_check(report: dict, smoke: bool = False) -> None:
    """SP 2 against one device on the same transformer and input (needs 2 GPUs, or CPU at toy size)."""
    import torch
    import torch.multiprocessing as mp

    if not smoke and torch.cuda.device_count() < 2:
        report["Ulysses SP 2 vs 1"] = (f"not measured (needs 2 GPUs for two NCCL ranks; "
                                       f"{torch.cuda.device_count()} visible)")
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_sp_rank, args=(r, 2, port, smoke, q)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    for p in procs:  # a rank stuck in a collective must not outlive the check
        if p.is_alive():
            p.kill()
            p.join()
    if q.empty():
        report["Ulysses SP 2 vs 1"] = f"not measured (a rank failed: exit codes {[p.exitcode for p in procs]})"
        return
    diff, t_ratio, mem_ratio, tokens = q.get()
    report["Ulysses SP 2 vs 1"] = (f"max |dv| {diff:.3g}, time ratio {t_ratio:.2f}, rank-0 peak memory ratio "
                                   f"{mem_ratio:.2f} ({tokens} tokens, {(SMOKE if smoke else FULL)['blocks']} blocks)")
