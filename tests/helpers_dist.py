"""Process bodies for tests that spawn torch.distributed ranks (light imports: a spawned
child imports this module, not the test module)."""

from __future__ import annotations

import time


class SlowToWrite:
    """Pickles delay_s slowly: a shard whose write takes that long (slow shared storage)."""

    def __init__(self, delay_s: float):
        self.delay_s = delay_s

    def __reduce__(self):
        time.sleep(self.delay_s)
        return (float, (self.delay_s,))


def save_on_two_ranks(rank: int, port: int, root: str, timeout_s: float | None, out: str,
                      collective_timeout_s: float, delay_s: float) -> None:
    """Rank `rank` of 2 (gloo) saves a sharded checkpoint; rank 1's shard takes delay_s to write.
    Writes "saved" or the error to `out`.RANK."""
    import torch

    from learner import dist_checkpoint, fsdp

    fsdp.init_distributed(rank, 2, "127.0.0.1", port, "cpu", timeout_s=collective_timeout_s)
    state = {"w": torch.full((4,), float(rank)), "slow": SlowToWrite(delay_s if rank == 1 else 0.0)}
    try:
        dist_checkpoint.save(root, 3, state, {"cursor": 1}, keep=2, timeout_s=timeout_s)
        result = "saved"
    except Exception as e:  # noqa: BLE001 — the parent reads what happened
        result = f"{type(e).__name__}: {e}"
    with open(f"{out}.{rank}", "w", encoding="utf-8") as f:
        f.write(result)
    fsdp.shutdown_process_group("barrier_only")
