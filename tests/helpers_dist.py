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


def lean_against_reference(rank: int, port: int, cfg_json: str, batch_path: str | None, out: str,
                           offload: bool = False) -> None:
    """Rank `rank` of 2 (gloo) sets up the learner both ways, the reference path (the whole
    transformer loaded, fp32 masters, broadcast, then sharded) and the lean one (built on meta,
    sharded, each rank reading its own rows), measuring the tensor bytes each setup holds at its
    peak; with a batch, both train one step on it. Rank 0 writes what it saw to `out`.RANK
    (torch.save), every rank its own peaks. offload: also the lean path with learner.cpu_offload."""
    import torch

    from common.config import RunConfig
    from common.tensor_bytes import LiveTensorBytes
    from learner import fsdp
    from learner.actor import make_trainer

    cfg = RunConfig.model_validate_json(cfg_json)
    mesh = fsdp.init_distributed(rank, 2, "127.0.0.1", port, "cpu", timeout_s=120).fsdp  # (dp, sp) = (2, 1)
    batch = torch.load(batch_path, weights_only=False) if batch_path else None
    result = {}
    variants = [("reference", False, cfg), ("lean", True, cfg)]
    if offload:
        variants.append(("lean_offload", True, cfg.model_copy(
            update={"learner": cfg.learner.model_copy(update={"cpu_offload": True})})))
    for name, lean, c in variants:
        with LiveTensorBytes() as probe:
            trainer = make_trainer(c, torch.device("cpu"), mesh, lean=lean)
        policy = trainer.policy
        entry = {"setup_peak": probe.peak, "offload": _offload_policies(policy.module), "sharded": all(hasattr(p, "full_tensor") for p in policy.params.values()),
                 "master_dtypes": sorted({str(p.dtype) for p in policy.params.values()}),
                 "anchors": sorted(policy.anchors),
                 "experts": [e for e in ("transformer", "transformer_2") if getattr(trainer.model, e, None) is not None],
                 "before": {n: fsdp.full_value(p.detach()).clone() for n, p in policy.params.items()}}
        if batch is not None:
            def reduce(t):
                t = t.clone()
                torch.distributed.all_reduce(t)
                return t
            entry["stats"] = trainer.train_step(batch, rank=rank, world_size=2, reduce=reduce).values
            entry["after"] = {n: fsdp.full_value(p.detach()) for n, p in policy.params.items()}
            entry["anchor_values"] = {a: {n: fsdp.full_value(t) for n, t in s.items()}
                                      for a, s in policy.anchors.items()}
        result[name] = entry
        del trainer, policy
    torch.save(result, f"{out}.{rank}")
    fsdp.shutdown_process_group("barrier_only")


def _offload_policies(module) -> list[str]:
    """The offload policy class of each FSDP2 unit in `module` (FSDP2 keeps it on the unit's group)."""
    from torch.distributed.fsdp import FSDPModule

    groups = [m._get_fsdp_state()._fsdp_param_group for m in module.modules() if isinstance(m, FSDPModule)]
    return sorted({type(g.offload_policy).__name__ for g in groups if g is not None})


def _cloning_to_local(tree):
    """The sharded checkpoint writer's tree walk as it was before the lean learner: every DTensor's
    local shard cloned (the file layout is the same: plain tensors in the same tree)."""
    from torch.distributed.tensor import DTensor

    if isinstance(tree, DTensor):
        return tree.to_local().detach().clone()
    if isinstance(tree, dict):
        return {k: _cloning_to_local(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_cloning_to_local(v) for v in tree)
    return tree


def resume_across_writers(rank: int, port: int, cfg_json: str, batch_path: str, root: str, out: str) -> None:
    """Rank `rank` of 2 (gloo): the reference path steps once and saves the way checkpoints were
    written before the lean learner (cloned shards), steps again; a lean trainer resumes from
    that checkpoint and takes the same second step. The lean trainer then saves (measuring the
    tensor bytes the save allocates), steps, and a fresh lean trainer resumes and steps alike."""
    import torch

    from common.config import RunConfig
    from common.tensor_bytes import LiveTensorBytes, tensor_leaves
    from learner import dist_checkpoint, fsdp
    from learner.actor import make_trainer

    cfg = RunConfig.model_validate_json(cfg_json)
    mesh = fsdp.init_distributed(rank, 2, "127.0.0.1", port, "cpu", timeout_s=120).fsdp  # (dp, sp) = (2, 1)
    batch = torch.load(batch_path, weights_only=False)
    cpu = torch.device("cpu")

    def reduce(t):
        t = t.clone()
        torch.distributed.all_reduce(t)
        return t

    def step(trainer):
        return trainer.train_step(batch, rank=rank, world_size=2, reduce=reduce).values

    def local_bytes(tree) -> int:
        return sum(t.numel() * t.element_size() for t in tensor_leaves(dist_checkpoint.to_local(tree)))

    def save(trainer, sub: str, version: int):
        with LiveTensorBytes() as probe:
            d = dist_checkpoint.save(f"{root}/{sub}", version, trainer.state_dict(), {"cursor": 1}, keep=2)
        return d, probe.peak

    res = {}
    ref = make_trainer(cfg, cpu, mesh, lean=False)
    step(ref)
    new_to_local, dist_checkpoint.to_local = dist_checkpoint.to_local, _cloning_to_local
    try:
        old_dir, res["old_save_peak"] = save(ref, "old", 1)
    finally:
        dist_checkpoint.to_local = new_to_local
    res["state_bytes"] = local_bytes(ref.state_dict())
    res["ref_second"] = step(ref)
    del ref
    lean = make_trainer(cfg, cpu, mesh, lean=True)
    lean.load_state_dict(dist_checkpoint.load(old_dir, lean.state_dict(), lean.optimizer.param_groups[0]["params"])[0])
    res["lean_from_old_second"] = step(lean)
    new_dir, res["new_save_peak"] = save(lean, "new", 2)
    res["lean_third"] = step(lean)
    del lean
    fresh = make_trainer(cfg, cpu, mesh, lean=True)
    fresh.load_state_dict(dist_checkpoint.load(new_dir, fresh.state_dict(), fresh.optimizer.param_groups[0]["params"])[0])
    res["fresh_third"] = step(fresh)
    res["files"] = sorted(p.name for p in new_dir.iterdir())
    torch.save(res, f"{out}.{rank}")
    fsdp.shutdown_process_group("barrier_only")




def save_policy_on_ranks(rank: int, world: int, port: int, cfg_json: str, path: str, out: str) -> None:
    """Rank `rank` of `world` (gloo) sets up a learner rank as LearnerGroup does (learner/actor.py,
    the lean sharded path), moves every weight (w := 1.5 w + 0.01 on its shard, so the policy is
    not the base), and writes the policy as a checkpoint does (`LearnerRank.save_policy`),
    measuring what the save allocates on this host: torch storages (common/tensor_bytes.py) and
    Python objects (tracemalloc: bytes, numpy buffers). Writes both peaks to out.RANK."""
    import json
    import tracemalloc

    import torch

    from common.tensor_bytes import LiveTensorBytes
    from learner.actor import LearnerRank

    lr = LearnerRank(json.loads(cfg_json), rank, world)
    lr.setup("127.0.0.1", port)
    with torch.no_grad():
        for p in lr.trainer.policy.params.values():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.mul_(1.5).add_(0.01)
    tracemalloc.start()
    with LiveTensorBytes() as probe:
        lr.save_policy(path)
    _, py_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    torch.save({"tensor_peak": probe.peak, "python_peak": py_peak}, f"{out}.{rank}")
    lr.close()
