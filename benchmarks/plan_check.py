"""Measure the peak memory of CPU train steps and compare it with `vgrpo plan` (not a test itself).

`python -m benchmarks.plan_check PATH [key=value …]` loads the diffusers-format Wan checkpoint
in PATH through the real adapter, generates one group with the real sampler, runs two
Trainer.train_step calls (the second with AdamW state allocated) and prints JSON: how far the
resident memory rises during the steps (the kernel's VmHWM, restarted just before them, minus
the resident memory then) and what the plan says a step adds for the same config: its peak
less the weights, frozen modules and anchors, which are resident before the step and whose
sizes are exact parameter counts. (Measuring from process start would also count libraries
imported lazily and memory-mapped checkpoint files.) tests/test_plan.py runs it in a fresh process per size.
"""

from __future__ import annotations

import json
import resource
import sys


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _reset_peak() -> None:
    """Return freed heap to the OS, then restart the kernel's peak-RSS count from the current RSS."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def overrides(path: str) -> list[str]:
    """A single-rank full fine-tune in fp32, one row per micro-batch, no CFG, no anchors."""
    return [f"model.path={path}", "model.family=wan", "model.guidance_scale=1.0", "model.max_sequence_length=16",
            "optim.finetune=full", "optim.micro_batch=1", "kl.strategy=none", "align.enabled=false",
            "schedule.steps=2", "sampler.group_size=2", "sampler.train_steps=all", "sampler.ode_last_steps=1",
            "pools.learner.num_actors=1"]


def main(argv: list[str]) -> None:
    import torch

    from cluster.plan.sizing import arch, learner_memory, learner_peak
    from common.config import load_config
    from common.types import Condition, TrainBatch
    from learner.trainer import Trainer
    from rollout_worker.models import build_model
    from rollout_worker.sampler import sample_group

    torch.set_num_threads(1)
    cfg = load_config(None, [*overrides(argv[0]), *argv[1:]])
    model = build_model(cfg, "cpu")
    g = sample_group(model, Condition(id="c", prompt="a plan check"), cfg, seed=0, policy_version=0)
    g.composite = torch.tensor([1.0, -1.0])
    for m in g.members:  # the decoded frames are the rollout's, not the learner's
        m.frames = None
    trainer = Trainer(cfg, model, device="cpu").setup()
    _reset_peak()
    base = _rss()  # weights, frozen modules and anchors are resident (exact parameter counts)
    for _ in range(2):
        trainer.train_step(TrainBatch(fresh=[g]))
    grew = _peak_rss() - base  # what a step adds: grads, optimizer state, activations, transients
    mem = learner_memory(cfg, arch(cfg))
    resident = mem["weights"] + mem["frozen modules"] + mem["anchors"]
    planned = learner_peak(mem, cfg.model.gradient_checkpointing) - resident
    print(json.dumps({"measured": grew, "plan": planned, "parts": mem}))


if __name__ == "__main__":
    main(sys.argv[1:])
