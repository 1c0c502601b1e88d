"""A checkpoint of the run: the learner's state, the driver's state, the bank's data, the policy.

The learner's ranks write their own state; the driver adds its `DriverState` and the bank's
watermark to extra.json; the bank's entries are dumped beside it; and the learner ranks write
the policy, `policy/` in diffusers' sharded safetensors layout, each rank the shard files of its
own run of tensors (learner/policy_writer.py: no host ever holds the whole model), so
`vgrpo eval/sample/export` can load the policy without the learner (the weights never pass
through the driver).

A checkpoint is visible only when whole: the bank dump and the policy go first, into the
learner's stage for the step (learner/checkpoint.py `stage`); the trainer state goes last and
makes the step dir appear (a rename locally, the marker object on an object store); older
checkpoints are pruned only after that. A kill or a full disk part-way leaves the last complete
checkpoint as it was, and a full disk is one line (`DiskFull`).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from cluster.driver.state import DriverState
from common import storage
from common.policy_layout import POLICY_DIR
from learner import checkpoint as ckpt
from learner.checkpoint import DiskFull
from memory_bank.dump import dump_bank
from memory_bank.errors import BankUnavailable


def try_write(learner, bank, state: DriverState, root: Path, note: Callable[[str], None]
              ) -> tuple[Path | None, str | None]:
    """(the step dir, None), or (None, one line) for a write that failed and left the last
    checkpoint standing: a full disk, or a learner that died while writing (only the staged
    step is lost; it was never committed)."""
    import ray  # heavy: ray

    from common.dispatch import why_lost  # heavy: ray

    try:
        return write_checkpoint(learner, bank, state, root, note), None
    except DiskFull as e:
        return None, str(e)
    except ray.exceptions.RayActorError as e:
        return None, f"the learner died while writing a checkpoint ({why_lost(e)})"


def write_checkpoint(learner, bank, state: DriverState, root: Path, note: Callable[[str], None]) -> Path:
    extra = state.saved()
    try:
        extra["bank"] = bank.snapshot()
    except BankUnavailable as e:  # the bank's own entries stay in Redis (AOF); resume requeues
        extra["bank"] = None
        note(f"checkpoint without a bank watermark: {e}")
    staged = ckpt.stage(root, state.step)
    try:
        if extra["bank"] is None:  # Redis is unreachable: nothing to dump either
            note("checkpoint without the bank's data: Redis was unreachable")
        elif (lost := dump_bank(bank, staged)) is not None:  # the bank's data rides along
            note(lost)
        learner.save_policy(staged / POLICY_DIR)
        path = learner.save_checkpoint(root, extra)   # the trainer state last: now it is visible
    except Exception as e:
        # whatever layer reported it (ENOSPC, torch's `unexpected pos`, a Ray task's error): a
        # failed write with less room left than the last checkpoint took is a full disk
        full = ckpt.out_of_space(e, staged, _room_needed(root, staged))
        if not storage.is_uri(root):
            shutil.rmtree(staged, ignore_errors=True)  # the stage goes; the last complete checkpoint stands
        if full:
            raise DiskFull(ckpt.disk_full_line(root, state.step)) from None
        raise
    note(f"checkpoint written: {path}")
    return path


def _room_needed(root, staged) -> int:
    """What the failed checkpoint still needed, as far as the driver knows: the newest complete
    checkpoint's bytes less what the stage holds (0 on an object store, or with none yet)."""
    if storage.is_uri(root):
        return 0
    done = ckpt.list_checkpoints(root)

    def du(d: Path) -> int:
        return sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) if d.is_dir() else 0

    try:
        return max(0, du(done[-1]) - du(Path(staged))) if done else 0
    except OSError:  # a file went while it was counted
        return 0
