"""Shared pieces of the fault tests: a tiny run config, a ledger of pushed and trained groups,
and a reward model that misbehaves once at chosen calls (NaN rows, a hang, a crash)."""

from __future__ import annotations

import math
import os
import threading
import time
from pathlib import Path

import torch

from common.config import load_config
from reward_worker.base import RewardModel

ROOT = Path(__file__).resolve().parents[2]
TWO_PROMPTS = "a red square moving right\na red square moving up\n"  # conditions repeat every step


def tiny_cfg(tmp_path: Path, name: str, *extra: str, steps: int = 5):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(TWO_PROMPTS)
    return load_config(ROOT / "configs/quickstart.yaml", [
        "train.mode=sync", f"train.steps={steps}", "train.groups_per_step=2", "train.eval_seeds=1",
        "train.checkpoint_every=2", "sampler.group_size=4", "schedule.steps=6", "bank.capacity=64",
        f"train.prompts={prompts}", f"run.root={tmp_path}", f"run.name={name}", *extra])


class Ledger:
    """Watches the driver's bank calls (the real Redis is used): what was pushed, what trained."""

    def __init__(self, driver):
        self.driver = driver
        self.pushed: list[tuple[str, int, int]] = []   # (group id, policy version, driver step at push)
        self.trained: list[str] = []
        self.finite = True
        bank = driver.bank
        push, commit = bank.push_group, bank.commit

        def push_group(group):
            out = push(group)
            self.pushed.append((group.group_id, group.policy_version, driver.step))
            self.finite &= bool(torch.isfinite(group.scores.values).all())
            return out

        def commit_(batch, step):
            commit(batch, step)
            self.trained += [g.group_id for g in batch.fresh]

        bank.push_group, bank.commit = push_group, commit_


def when(pred, timeout_s: float, poll_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(poll_s)
    return False


def in_thread(fn) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def once(marker_dir: str, name: str) -> bool:
    """True the first time any process asks for `name` (a marker file survives actor restarts)."""
    try:
        os.close(os.open(os.path.join(marker_dir, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


class FlakyToyReward(RewardModel):
    """The toy reward, except: call `nan_at` gives a NaN row, call `hang_at` sleeps `hang_s`,
    call `crash_at` kills the actor's process. Each fault happens once per marker_dir."""

    name = "toy"

    def __init__(self, marker_dir: str, nan_at: int, hang_at: int, hang_s: float, crash_at: int):
        from reward_worker.models.toy import ToyReward

        self.inner = ToyReward()
        self.marker_dir, self.hang_s = marker_dir, hang_s
        self.at = {"nan": nan_at, "hang": hang_at, "crash": crash_at}
        self.calls = 0

    def head_names(self) -> list[str]:
        return self.inner.head_names()

    def score(self, frames, prompts, images=None):
        self.calls += 1
        out = self.inner.score(frames, prompts, images)
        if self.calls >= self.at["crash"] and once(self.marker_dir, "crash"):
            os._exit(1)
        if self.calls >= self.at["hang"] and once(self.marker_dir, "hang"):
            time.sleep(self.hang_s)
        if self.calls >= self.at["nan"] and once(self.marker_dir, "nan"):
            out[0, 0] = math.nan if self.calls % 2 else math.inf
        return out


class FlakyFactory:
    def __init__(self, **kw):
        self.kw = kw

    def __call__(self, cfg):
        return FlakyToyReward(**self.kw)


def hang_next_generate(worker, seconds: float) -> None:
    """Run on a rollout actor (via __ray_call__): its next group stalls for `seconds`, like a hung device."""
    model = worker.model
    original = model.velocity

    def velocity(*args, **kwargs):
        model.velocity = original
        time.sleep(seconds)
        return original(*args, **kwargs)

    model.velocity = velocity
