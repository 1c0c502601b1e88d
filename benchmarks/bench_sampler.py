"""Sampler overhead: time per group of `sample_group` vs a plain ODE loop over the same model.

    python -m benchmarks.bench_sampler [--quick] [--smoke] [--gpu]

Then the saving of encoding a condition once per actor (rollout_worker/condition_cache.py): a
group of a condition seen before, against one that runs the encoders again.

Both paths encode once, draw the noise, run T batched velocity calls over G members and
decode; the sampler adds the SDE noise, the log-probs and the recording. The goal is a
ratio ≤ 1.05 (the transformer should dominate); on tiny CPU models fixed costs weigh more.
`--gpu` runs small Wan 2.2 (two experts) and HunyuanVideo 1.5 transformers in bf16 on CUDA
(benchmarks/gpu.py).
Not a test: it prints a table.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common.config import RunConfig
from common.sde import Schedule
from common.types import Condition
from rollout_worker.condition_cache import ConditionCache
from rollout_worker.models.base import VideoModel
from rollout_worker.sampler import sample_group

COND = Condition(id="bench", prompt="a red ball bouncing")


@torch.no_grad()
def plain_ode_group(model: VideoModel, cfg: RunConfig, seed: int) -> torch.Tensor:
    """The baseline: encode, shared noise, T Euler steps over G members, decode."""
    G, schedule = cfg.sampler.group_size, Schedule.from_config(cfg.schedule)
    images = None if COND.image is None else COND.image[None]
    cond = model.encode([COND.prompt], images).repeat(G)
    x = model.initial_noise(1, torch.Generator().manual_seed(seed)).expand(G, *model.latent_shape).clone()
    for k in range(schedule.steps):
        s, s1 = schedule.pair(k)
        x = x - (s - s1) * model.velocity(x, torch.full((G,), s, device=model.device), cond)
    return model.decode(x)


def time_pair(fa, fb, repeats: int) -> tuple[float, float, float]:
    """Median times of fa and fb, and the median of their per-repeat ratios b/a.

    The two run alternately, so a load change on a shared machine hits both alike.
    """
    from benchmarks.gpu import sync

    fa(), fb()  # warm-up
    ta, tb = [], []
    for _ in range(repeats):
        for fn, out in ((fa, ta), (fb, tb)):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()  # CUDA runs asynchronously: time the work, not the launches
            out.append(time.perf_counter() - t0)
    return statistics.median(ta), statistics.median(tb), statistics.median(b / a for a, b in zip(ta, tb, strict=True))


def bench(name: str, model: VideoModel, cfg: RunConfig, repeats: int) -> None:
    t_plain, t_sampler, ratio = time_pair(lambda: plain_ode_group(model, cfg, 0),
                                          lambda: sample_group(model, COND, cfg, seed=0, policy_version=0),
                                          repeats)
    m = cfg.model
    print(f"{name:<16} {cfg.sde.scheme:<6} G={cfg.sampler.group_size:<3} T={cfg.schedule.steps:<3} "
          f"{m.num_frames}x{m.height}x{m.width} {str(model.dtype).replace('torch.', ''):<8} {model.device.type:<4} "
          f"plain {t_plain * 1e3:8.1f} ms   sampler {t_sampler * 1e3:8.1f} ms   "
          f"ratio {ratio:5.3f}  (goal ≤ 1.05)")


def bench_encode_once(name: str, model: VideoModel, cfg: RunConfig, repeats: int) -> None:
    cache = ConditionCache(cfg.sampler.cond_cache_entries, cfg.sampler.cond_cache_mb * 2**20)
    t_miss, t_hit, ratio = time_pair(lambda: sample_group(model, COND, cfg, seed=0, policy_version=0),
                                     lambda: sample_group(model, COND, cfg, seed=0, policy_version=0, cache=cache),
                                     repeats)
    print(f"{name:<16} encode every group {t_miss * 1e3:8.1f} ms   encoded once {t_hit * 1e3:8.1f} ms   "
          f"ratio {ratio:5.3f}  ({cache.stats.hits} hits, {cache.stats.misses} miss)")


def toy_case() -> tuple[VideoModel, RunConfig] | None:
    try:
        from rollout_worker.models.toy import ToyVideoModel
    except ImportError:
        print("toy       skipped: rollout_worker/models/toy.py is not there yet")
        return None
    cfg = RunConfig.model_validate({"sampler": {"group_size": 8, "train_steps": "all"}})
    return ToyVideoModel.from_config(cfg), cfg


def wan_case() -> tuple[VideoModel, RunConfig]:
    from rollout_worker.models.tiny import tiny_wan_components
    from rollout_worker.models.wan import WanVideoModel

    cfg = RunConfig.model_validate({
        "model": {"family": "wan", "num_frames": 9, "height": 32, "width": 32, "guidance_scale": 4.0,
                  "max_sequence_length": 32},
        "sampler": {"group_size": 8, "train_steps": "all"}})
    return WanVideoModel.from_components(tiny_wan_components("t2v"), cfg.model), cfg


def gpu_cases(device) -> list[tuple[VideoModel, RunConfig]]:
    from benchmarks.gpu import (
        HUNYUAN_VIDEO,
        WAN_VIDEO,
        hunyuan15_small_components,
        wan22_small_components,
    )
    from rollout_worker.models.hunyuan15 import Hunyuan15VideoModel
    from rollout_worker.models.wan import WanVideoModel

    out = []
    for family, comps, video, cls in (("wan", wan22_small_components, WAN_VIDEO, WanVideoModel),
                                      ("hunyuan15", hunyuan15_small_components, HUNYUAN_VIDEO, Hunyuan15VideoModel)):
        cfg = RunConfig.model_validate({
            "model": {"family": family, "dtype": "bfloat16", "guidance_scale": 4.0, "max_sequence_length": 32,
                      **video, **({"boundary_ratio": 0.875} if family == "wan" else {})},
            "schedule": {"steps": 16}, "sampler": {"group_size": 8, "train_steps": "all"}})
        c = comps()
        for key in ("transformer", "transformer_2"):
            if key in c:
                c[key] = c[key].to(torch.bfloat16)
        out.append((cls.from_components(c, cfg.model, device), cfg))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    ap.add_argument("--smoke", action="store_true", help="the quickest run: the toy model, one repeat")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--gpu", action="store_true", help="small Wan 2.2 / HunyuanVideo 1.5 transformers on CUDA")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    repeats = 1 if args.smoke else 5 if args.quick else 15
    if args.gpu:
        from benchmarks.gpu import require_cuda

        cases = gpu_cases(require_cuda())
    else:
        cases = [toy_case()] if args.smoke else [toy_case(), wan_case()]
    print(f"config: one group per call, shared initial noise, every step stochastic and recorded "
          f"(train_steps=all); {repeats} alternating repeats after a warm-up, median times and "
          f"median per-repeat ratio")
    for case in cases:
        if case is not None:
            bench(type(case[0]).__name__.replace("VideoModel", "").lower(), *case, repeats)
    print("encode once per condition (sampler.cond_cache_entries): the same group, its condition encoded "
          "in the call or taken from the actor's cache")
    for case in cases:
        if case is not None:
            bench_encode_once(type(case[0]).__name__.replace("VideoModel", "").lower(), *case, repeats)


if __name__ == "__main__":
    main()
