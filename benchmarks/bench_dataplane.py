"""The data plane off the driver, measured in real runs (not a test).

    PYTHONPATH=. python -m benchmarks.bench_dataplane [--quick] [--out benchmarks/results.md]

Every run is the real `Driver` with every role its own Ray actor and an embedded Redis, but
with a stub video model (its velocity is one multiply, optionally with a fixed sleep) and a
stub reward (a fixed sleep per video), installed in every Ray worker by a setup hook. Figures,
each a ratio of two measurements from this one process:

1. bytes into the driver process per video / the video's latent and frame bytes, at the size
   of HunyuanVideo 1.5 at 480p (latent 16×21×30×53 in bf16, 20 recorded steps, frames
   81×480×848): what every `ray.get` of the driver process returned (tensors, arrays, bytes),
   and every byte its threads read from sockets and files (/proc/self/io rchar, which also
   counts the run's fixed reads: imports, the reward plot);
2. system videos/s / raw Redis SET+GET of the same latent bytes on the same server;
3. rollout scaling: videos/s at 4 rollout actors / at 1, the stub sleeping per step;
4. reward scaling: videos/s at 3 reward actors / at 1, the reward stub the bottleneck.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time

import numpy as np
import torch
from torch import Tensor, nn

STUB_ENV = "VGRPO_BENCH_STUB"


# --- the stubs (built inside Ray workers by the setup hook) ---------------------------------

def _stub_model(cfg):
    from rollout_worker.models.base import Cond, VideoModel

    with open(os.environ[STUB_ENV]) as f:  # written by the bench before each run
        p = json.load(f)

    class StubVideoModel(VideoModel):
        family = "toy"

        def __init__(self):
            self.module = nn.Module()
            self.module.scale = nn.Parameter(torch.full((p["latent"][0],), -1.0))  # v = -x: a cheap flow

        @property
        def latent_shape(self):
            return tuple(p["latent"])

        def encode(self, prompts, images=None) -> Cond:
            return Cond({"t": torch.zeros(len(prompts), 1)})

        def velocity(self, x: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
            if p["step_sleep_s"]:
                time.sleep(p["step_sleep_s"])
            return x * self.module.scale.view(1, -1, 1, 1, 1).to(x.dtype)

        def decode(self, latents: Tensor) -> Tensor:
            F, H, W = p["frames"]
            v = latents.float().mean(dim=(1, 2, 3, 4))          # [B]
            out = torch.empty((latents.shape[0], F, H, W, 3), dtype=torch.uint8)
            for i, m in enumerate(v.tolist()):
                out[i].fill_(int(128 + 100 * np.tanh(m)))
            return out

        def trainable_module(self) -> nn.Module:
            return self.module

        def load_weights(self, payload, strict=True):
            self.module.load_state_dict(payload, strict=False)

    return StubVideoModel()


class StubReward:
    """Three heads from the frames' mean, after a fixed sleep per video."""

    name = "toy"

    def __init__(self, sleep_s: float):
        self.sleep_s = sleep_s

    def head_names(self) -> list[str]:
        return ["VQ", "MQ", "TA"]

    def score(self, frames, prompts, images=None):
        time.sleep(self.sleep_s * len(prompts))
        m = frames.reshape(frames.shape[0], -1)[:, :4096].float().mean(dim=1) / 255.0
        return torch.stack([m, 1 - m, m * 0.5], dim=1)


class StubRewardFactory:
    def __init__(self, sleep_s: float):
        self.sleep_s = sleep_s

    def __call__(self, cfg):
        return StubReward(self.sleep_s)


def install_stub() -> None:
    """Ray worker setup hook: `build_model` returns the stub (rollout and learner alike)."""
    if os.environ.get(STUB_ENV):
        import rollout_worker.models as models

        models.build_model = lambda cfg, device=None, components="all", empty=False: _stub_model(cfg)


# --- what the driver process takes in -------------------------------------------------------

def payload_bytes(obj, seen: set | None = None) -> int:
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if isinstance(obj, bytes | bytearray | memoryview):
        return len(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    elif isinstance(obj, dict):
        items = [*obj.keys(), *obj.values()]
    elif isinstance(obj, list | tuple | set):
        items = list(obj)
    else:
        items = []
    return sum(payload_bytes(x, seen) for x in items)


def _rchar() -> int:
    for line in open("/proc/self/io"):
        if line.startswith("rchar:"):
            return int(line.split()[1])
    return 0


class Ingress:
    """Counts the payload of every ray.get in this process while active."""

    def __enter__(self):
        import ray

        self.ray, self.real, self.bytes = ray, ray.get, 0

        def get(*a, **kw):
            out = self.real(*a, **kw)
            self.bytes += payload_bytes(out)
            return out

        ray.get = get
        self.rchar0 = _rchar()
        return self

    def __exit__(self, *exc):
        self.rchar = _rchar() - self.rchar0
        self.ray.get = self.real


# --- runs -----------------------------------------------------------------------------------

def _run(root: str, name: str, stub: dict, reward_sleep_s: float, overrides: list[str]) -> dict:
    from cluster.driver.driver import Driver
    from cluster.runs.run_dir import RunDir
    from common.config import load_config

    with open(os.environ[STUB_ENV], "w") as f:
        json.dump(stub, f)
    cfg = load_config("configs/quickstart.yaml", [
        f"run.root={root}", f"run.name={name}", "optim.finetune=full", "train.checkpoint_every=1000",
        "pools.rollout.num_cpus=0", "pools.reward.num_cpus=0", "pools.learner.num_cpus=0",
        "sampler.ode_last_steps=0", "sampler.train_steps=all", *overrides])
    driver = Driver(cfg, RunDir.create(cfg), reward_factory=StubRewardFactory(reward_sleep_s))
    try:
        driver.setup()
        with Ingress() as ing:
            t0 = time.monotonic()
            driver.run()
            wall = time.monotonic() - t0
        if driver.stop_reason:
            raise RuntimeError(f"{name}: {driver.stop_reason}")
        receipts = [r for r in driver.receipts if r.ok]
        out = {"name": name, "wall_s": wall, "videos": sum(r.size for r in receipts),
               "videos_trained": driver.counts["groups_trained"] * cfg.sampler.group_size,
               "latent_bytes": sum(r.latent_bytes for r in receipts),
               "frame_bytes": sum(r.frame_bytes for r in receipts),
               "driver_ray_get_bytes": ing.bytes, "driver_rchar": ing.rchar,
               "seconds": {k: round(v, 2) for k, v in driver.timers.items()}}
        out["videos_per_s"] = out["videos"] / wall
        if name.startswith("realistic"):
            out["raw_redis_s_per_video"] = _raw_redis(driver, out["latent_bytes"] // max(out["videos"], 1))
        return out
    finally:
        driver.teardown()


def _raw_redis(driver, nbytes: int, repeats: int = 3) -> float:
    """Seconds for one SET and one GET of a video's latent bytes on the run's own Redis."""
    r = driver.bank.r
    blob = os.urandom(1 << 20) * max(1, nbytes >> 20)
    best = float("inf")
    for i in range(repeats):
        t0 = time.perf_counter()
        r.set(f"bench:raw:{i}", blob)
        got = r.get(f"bench:raw:{i}")
        best = min(best, time.perf_counter() - t0)
        r.delete(f"bench:raw:{i}")
        assert len(got) == len(blob)
    return best


def main(argv: list[str] | None = None) -> None:
    import ray

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller latents and fewer steps")
    ap.add_argument("--smoke", action="store_true", help="the quickest run: one sync and one async "
                    "run of one step, rows only, no cluster probe; joins RAY_ADDRESS when set (tests run it)")
    ap.add_argument("--gpu", action="store_true", help="accepted for run_all; the stubs run on the CPU either way")
    ap.add_argument("--out", default=None, help="append the figures to this markdown file")
    args = ap.parse_args(argv)
    args.quick = args.quick or args.smoke
    root = tempfile.mkdtemp(prefix="vgrpo-bench-dp-")
    os.environ[STUB_ENV] = os.path.join(root, "stub.json")
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd(), STUB_ENV: os.environ[STUB_ENV]}
    runtime_env = {"env_vars": env, "worker_process_setup_hook": "benchmarks.bench_dataplane.install_stub"}
    if args.smoke and os.environ.get("RAY_ADDRESS"):  # the smoke joins a running cluster (tests: the session's)
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False, runtime_env=runtime_env)
    else:
        ray.init(num_cpus=2, resources={"rollout": 4, "reward": 3, "learner": 1}, include_dashboard=False,
                 log_to_driver=False, runtime_env=runtime_env)
    # the smoke checks the code paths, not the driver's cluster probe (a task per role; tested on its own)
    probe = ["preflight.skip_cluster_checks=true"] if args.smoke else []
    rows = {}
    try:
        big = {"latent": [16, 21, 30, 53], "frames": [81, 480, 848], "step_sleep_s": 0.0}
        if args.quick:
            big = {"latent": [16, 11, 30, 53], "frames": [41, 480, 848], "step_sleep_s": 0.0}
        if args.smoke:  # the code paths only: small tensors, no sleeps (the rows are not figures)
            big = {"latent": [16, 3, 8, 8], "frames": [5, 32, 32], "step_sleep_s": 0.0}
        for name, steps in ((("realistic", 1),) if args.smoke else (("realistic", 2), ("realistic_long", 4))):
            rows[name] = _run(root, name, big, 0.0, [
                "train.mode=sync", f"train.steps={steps}", "train.groups_per_step=1", "sampler.group_size=2",
                "schedule.steps=20", "sampler.latent_dtype=bfloat16", "bank.capacity=1", *probe])
        small = {"latent": [4, 2, 8, 8], "frames": [4, 16, 16], "step_sleep_s": 0.0 if args.smoke else 0.2}
        steps = 1 if args.smoke else 2 if args.quick else 3
        for n in ((1,) if args.smoke else (1, 2, 4)):
            rows[f"rollout{n}"] = _run(root, f"rollout{n}", small, 0.0, [
                "train.mode=async", f"train.steps={steps}", "train.groups_per_step=4", "train.max_staleness=2",
                "sampler.group_size=2", "schedule.steps=8", f"pools.rollout.num_actors={n}", *probe])
        fast = {**small, "step_sleep_s": 0.0}
        for n in (() if args.smoke else (1, 3)):
            rows[f"reward{n}"] = _run(root, f"reward{n}", fast, 0.5, [
                "train.mode=async", f"train.steps={steps + 2}", "train.groups_per_step=3", "train.max_staleness=2",
                "sampler.group_size=2", "schedule.steps=4", "pools.rollout.num_actors=3",
                f"pools.reward.num_actors={n}"])
    finally:
        ray.shutdown()
    if args.smoke:
        for r in rows.values():
            print(json.dumps(r))
        return
    real, long = rows["realistic"], rows["realistic_long"]
    per_video = (real["latent_bytes"] + real["frame_bytes"]) / real["videos"]
    figures = {
        "driver_bytes_per_video_ratio (ray.get payload)": long["driver_ray_get_bytes"] / long["videos"] / per_video,
        # every byte the driver's threads read (sockets and files, the run's fixed cost included:
        # imports, the reward plot), over the longer run: an upper bound on what the data plane adds
        "driver_bytes_per_video_ratio (rchar, all reads)": long["driver_rchar"] / long["videos"] / per_video,
        "system_vs_raw_redis": long["videos_per_s"] * long["raw_redis_s_per_video"],
        "rollout_scaling_4_vs_1": rows["rollout4"]["videos_per_s"] / rows["rollout1"]["videos_per_s"],
        "rollout_scaling_2_vs_1": rows["rollout2"]["videos_per_s"] / rows["rollout1"]["videos_per_s"],
        "reward_scaling_3_vs_1": rows["reward3"]["videos_per_s"] / rows["reward1"]["videos_per_s"],
    }
    for r in rows.values():
        print(json.dumps(r))
    for k, v in figures.items():
        print(f"{k}: {v:.4g}")
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n## bench_dataplane" + (" --quick" if args.quick else "") + "\n\n```\n")
            f.write("\n".join(json.dumps(r) for r in rows.values()) + "\n")
            f.write("\n".join(f"{k}: {v:.4g}" for k, v in figures.items()) + "\n```\n")


if __name__ == "__main__":
    main()
