"""Run a function on `world` CPU processes joined in one gloo group (torch.multiprocessing spawn).

`spawn_ranks(fn, world, tmp, *args)` starts the processes, each with one torch thread, calls
`fn(rank, world, *args)` in each and returns their results in rank order (through torch.save
files: tensors passed back through a multiprocessing queue would need the child alive). A rank
that raises fails the call with its traceback. `fn` must be importable by name (a module-level
function of a module on sys.path).
"""

from __future__ import annotations

import importlib
import os
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp


def _entry(rank: int, world: int, init: str | None, module: str, name: str, args: tuple, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist

    try:
        if init is not None:
            dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
        fn = getattr(importlib.import_module(module), name)
        result = fn(rank, world, *args)
        torch.save(result, f"{out}/rank{rank}.pt")
        dist.barrier()
    except BaseException:
        Path(f"{out}/rank{rank}.err").write_text(traceback.format_exc(), encoding="utf-8")
        raise


def spawn_ranks(fn, world: int, tmp: Path, *args, timeout_s: float = 600.0, init: bool = True) -> list:
    """`init=False`: `fn` joins the group itself."""
    tmp = Path(tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "rendezvous").unlink(missing_ok=True)
    ctx = mp.get_context("spawn")
    rendezvous = str(tmp / "rendezvous") if init else None
    procs = [ctx.Process(target=_entry, args=(r, world, rendezvous, fn.__module__, fn.__name__, args, str(tmp)))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    errors = [f.read_text(encoding="utf-8") for f in sorted(tmp.glob("rank*.err"))]
    if errors or any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"a rank failed (exit codes {[p.exitcode for p in procs]}):\n" + "\n".join(errors))
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]
