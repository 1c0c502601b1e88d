"""End-to-end throughput, async vs sync on the same cores (not a test).

    python -m benchmarks.bench_async [--quick] [--steps N] [--gpu] [KEY=VALUE ...]

Runs the quickstart (toy model, every role its own Ray actor, embedded Redis) for the same
number of optimizer steps in `sync` and then `async` mode, on one local Ray cluster, and prints
videos/s of each, their ratio, and the idle ratio of each role (wall time it was not working).
`--gpu` swaps the toy model for the small Wan 2.2 of benchmarks/gpu.py (bf16, 33×240×416) with
the rollout and learner actors sharing one GPU (0.5 each); the toy rewards still score the videos.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time


def run_mode(mode: str, steps: int, root: str, extra: list[str] = ()) -> dict:
    from cluster.driver.driver import Driver
    from cluster.runs.run_dir import RunDir
    from common.config import load_config

    cfg = load_config("configs/quickstart.yaml", [f"train.mode={mode}", f"train.steps={steps}",
                                                  f"run.root={root}", f"run.name={mode}",
                                                  f"train.checkpoint_every={steps + 1}", *extra])
    run_dir = RunDir.create(cfg)
    driver = Driver(cfg, run_dir)
    try:
        driver.setup()
        t0 = time.monotonic()
        driver.run()
        wall = time.monotonic() - t0
    finally:
        driver.teardown()
    last = json.loads(run_dir.metrics_file.read_text().splitlines()[-1])
    return {"mode": mode, "steps": steps, "wall_s": wall, "videos": driver.counts["videos"],
            "videos_per_s": driver.counts["videos"] / wall,
            **{f"idle_{r}": last[f"idle/{r}"] for r in ("rollout", "reward", "learner")},
            "staleness_max": max(json.loads(x)["staleness_max"] for x in run_dir.metrics_file.read_text().splitlines())}


def main(argv: list[str] | None = None) -> None:
    import ray

    from cluster.driver.pools import init_ray
    from common.config import load_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="6 steps per mode")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per mode (default 20)")
    ap.add_argument("--gpu", action="store_true", help="small Wan 2.2 on one CUDA GPU")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                    help="config overrides on the quickstart for both modes, e.g. train.groups_per_step=4")
    args = ap.parse_args(argv)
    steps = args.steps or (6 if args.quick else 20)
    if args.gpu:
        from benchmarks.gpu import require_cuda

        require_cuda()
    with tempfile.TemporaryDirectory() as root:
        extra = list(args.overrides)
        if args.gpu:
            from benchmarks.gpu import save_wan22_small, wan22_small_overrides

            extra += [*wan22_small_overrides(save_wan22_small(f"{root}/wan22_small")), "schedule.steps=16",
                     "pools.rollout.num_gpus=0.5", "pools.learner.num_gpus=0.5", "optim.micro_batch=8"]
        cfg = load_config("configs/quickstart.yaml", extra)
        handle = init_ray(cfg)
        try:
            rows = [run_mode(m, steps, root, extra) for m in ("sync", "async")]
        finally:
            handle.shutdown()
            ray.shutdown()
    model = "small Wan 2.2 (bf16, 33x240x416) on 1 GPU" if args.gpu else "the toy model on CPU"
    print(f"config: configs/quickstart.yaml {' '.join(args.overrides)} with {model}, {steps} optimizer steps per "
          f"mode, {cfg.train.groups_per_step} groups x {cfg.sampler.group_size} videos per step, "
          f"{cfg.pools.rollout.num_actors} rollout + 1 reward + {cfg.pools.learner.num_actors} learner actor(s)")
    print(f"{'mode':6} {'steps':>5} {'wall s':>7} {'videos/s':>9} {'idle rollout':>13} {'idle reward':>12} "
          f"{'idle learner':>13} {'max staleness':>14}")
    for r in rows:
        print(f"{r['mode']:6} {r['steps']:5d} {r['wall_s']:7.1f} {r['videos_per_s']:9.2f} {r['idle_rollout']:13.2f} "
              f"{r['idle_reward']:12.2f} {r['idle_learner']:13.2f} {r['staleness_max']:14.0f}")
    print(f"async / sync videos per second: {rows[1]['videos_per_s'] / rows[0]['videos_per_s']:.2f}")


if __name__ == "__main__":
    main()
