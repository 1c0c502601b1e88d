"""Shared pieces of the fault tests: a tiny run config, a ledger of pushed and trained groups,
and a reward model that misbehaves once at chosen calls (NaN rows, a hang, a crash)."""

from __future__ import annotations

import json
import math
import os
import threading
import time
from pathlib import Path

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


class Lines:
    """A console for a Driver that keeps the lines it is given."""

    def __init__(self):
        self.lines: list[str] = []

    def log(self, text: str) -> None:
        self.lines.append(text)


class Ledger:
    """What was pushed and what trained, from the bank's own records (the real Redis is used).

    Pushed: the receipts the rollout actors returned for the groups they stored. Trained: the
    bank's done list, where commit appends each group id it moves out of pending (it commits a
    group only once). `finite`: no entry in the bank carries a non-finite reward. Call
    `freeze()` before the driver's teardown stops an embedded Redis.
    """

    def __init__(self, driver):
        self.driver = driver
        self.start_done = driver.bank.r.llen(driver.bank.keys.done)
        self.start_receipts = len(driver.receipts)
        self._frozen: tuple | None = None

    def freeze(self) -> Ledger:
        self._frozen = (self.pushed, self.trained, self.finite)
        return self

    @property
    def pushed(self) -> list[tuple[str, int, int]]:
        """(group id, policy version, driver step when it was stored)."""
        if self._frozen:
            return self._frozen[0]
        got = list(self.driver.receipts)[self.start_receipts:]
        return [(r.group_id, r.version, r.step) for r in got if r.ok]

    @property
    def trained(self) -> list[str]:
        if self._frozen:
            return self._frozen[1]
        bank = self.driver.bank
        done = [g.decode() for g in bank.r.lrange(bank.keys.done, 0, -1)][::-1]  # oldest first
        return done[self.start_done:]

    @property
    def finite(self) -> bool:
        if self._frozen:
            return self._frozen[2]
        bank = self.driver.bank
        return all(math.isfinite(json.loads(v)["c"]) for v in bank.r.hvals(bank.keys.einfo))


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
