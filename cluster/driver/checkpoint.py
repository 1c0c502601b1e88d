"""A checkpoint of the run: the learner's state, the driver's state, the bank's data, the policy.

The learner's ranks write their own state; the driver adds its `DriverState` and the bank's
watermark to extra.json; the bank's entries are dumped beside it; and rank 0 writes
policy.safetensors, so `vgrpo eval/sample` can load the policy without the learner (the
weights never pass through the driver).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from cluster.driver.state import DriverState


def write_checkpoint(learner, bank, state: DriverState, root: Path, note: Callable[[str], None]) -> Path:
    from memory_bank.dump import dump_bank
    from memory_bank.errors import BankUnavailable

    extra = state.saved()
    try:
        extra["bank"] = bank.snapshot()
    except BankUnavailable as e:  # the bank's own entries stay in Redis (AOF); resume requeues
        extra["bank"] = None
        note(f"checkpoint without a bank watermark: {e}")
    path = learner.save_checkpoint(root, extra)
    if extra["bank"] is None:  # Redis is unreachable: nothing to dump either
        note("checkpoint without the bank's data: Redis was unreachable")
    elif (lost := dump_bank(bank, path)) is not None:  # the bank's data rides along
        note(lost)
    learner.save_policy(path / "policy.safetensors")
    note(f"checkpoint written: {path}")
    return path
