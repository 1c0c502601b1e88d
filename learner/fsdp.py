"""FSDP2 for the learner: process-group setup, `fully_shard` per transformer block, full-state
gathers for publishing, barriers with their own timeouts, and a teardown that cannot abort the
process.

Timeouts: the default group's (learner.collective_timeout_s) bounds every collective. A wait
that is long by nature (the slowest rank's model read, a checkpoint shard on slow storage) is a
monitored barrier on a gloo control group instead, whose timeout is given per call: NCCL's
watchdog aborts a rank whose collective outlives its group's timeout.

Teardown: with torch 2.13 and gloo on CPU, `destroy_process_group` now and then aborts the
process (SIGABRT from gloo's C++ pair teardown while a peer has already closed its socket;
no Python `try` can catch it). So `shutdown_process_group` first runs a barrier, which
bounds the group's life: after it no collective is in flight and every rank is at the end.
Then it does not destroy the group by default: the owner ends the process (LearnerGroup
kills its rank actors), and the OS frees the sockets. `mode="destroy"` is for a process
that must live on; it destroys the group under the same barrier, rank 0 last.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from common.weight_group import backend_for

log = logging.getLogger(__name__)

# ModuleList attribute names that hold the repeated transformer blocks in diffusers models.
BLOCK_LISTS = ("blocks", "transformer_blocks", "single_transformer_blocks")


class LearnerTimeout(TimeoutError):
    """A learner rank did not reach a barrier in time; the message names the rank and the field."""


_control: dist.ProcessGroup | None = None  # gloo, for barriers with a timeout of their own


@dataclass
class LearnerMesh:
    """The learner's (dp, sp) layout: rank = dp_rank·sp + sp_rank.

    `fsdp` is the 1-D mesh FSDP2 shards the weights over: every rank, dp × sp (the SP ranks of a
    data-parallel rank would otherwise hold the same weights; each holds its tokens' share of
    the gradient, and the reduce-scatter sums them). `sp` is the ("ring", "ulysses") = (1, sp)
    mesh of this rank's SP group (diffusers' context parallelism wants both names), None at
    sp 1. Rows split over dp; `dp_group` reduces the step's statistics, which every SP rank of a
    data-parallel rank computes alike, so each row counts once."""

    fsdp: DeviceMesh
    sp: DeviceMesh | None
    dp_rank: int
    dp_size: int
    dp_group: dist.ProcessGroup | None


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int,
                     device: torch.device | str = "cpu", timeout_s: float = 1800.0,
                     sp: int = 1) -> LearnerMesh:
    """Join the learner's default process group and build its (dp, sp) meshes.

    timeout_s (learner.collective_timeout_s) bounds every collective of the group. Waits that
    are longer by nature (the slowest rank's model read, a checkpoint write) are barriers on a
    gloo control group instead, each with its own timeout (`barrier`)."""
    global _control
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size % sp:
        raise ValueError(f"learner world size {world_size} is not a multiple of parallel.sp = {sp}")
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(backend_for(device), init_method=f"tcp://{master_addr}:{master_port}",
                            rank=rank, world_size=world_size, timeout=timeout)
    # made now, while every rank is here: new_group is itself a rendezvous of all ranks
    _control = dist.new_group(backend="gloo", timeout=timeout)
    dp = world_size // sp
    if sp == 1:
        mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("fsdp",))
        return LearnerMesh(mesh, None, rank, dp, None)
    mesh = init_device_mesh(device.type, (dp, 1, sp), mesh_dim_names=("dp", "ring", "ulysses"))
    return LearnerMesh(mesh._flatten("fsdp"), mesh["ring", "ulysses"], rank // sp, dp,
                       mesh["dp"].get_group())


def barrier(timeout_s: float, field: str, what: str) -> None:
    """Wait up to timeout_s for every rank of the learner's group (gloo's monitored barrier,
    whose timeout is per call); raises LearnerTimeout naming the late rank and `field`."""
    global _control
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    if _control is None:  # a group initialised elsewhere: every rank is here, so make it now
        _control = dist.new_group(backend="gloo")
    try:
        dist.monitored_barrier(group=_control, timeout=timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise LearnerTimeout(f"learner rank {dist.get_rank()}: not every rank {what} within "
                             f"{timeout_s:g} s ({field}); raise it if the work is that slow "
                             f"({str(e).splitlines()[0][:200]})") from None


def transformer_blocks(module: nn.Module) -> list[nn.Module]:
    """The repeated blocks (elements of ModuleLists named as in BLOCK_LISTS), in model order."""
    blocks: list[nn.Module] = []
    for name, child in module.named_modules():
        if isinstance(child, nn.ModuleList) and name.rsplit(".", 1)[-1] in BLOCK_LISTS:
            blocks.extend(child)
    return blocks


def shard_model(module: nn.Module, mesh: DeviceMesh, *,
                param_dtype: torch.dtype | None = None, offload: bool = False) -> nn.Module:
    """Apply FSDP2 `fully_shard` to each transformer block, then to the root (in place).

    Call after LoRA injection, so adapter weights are sharded with their block, and before
    anything keeps references to the parameters (fully_shard replaces them with DTensors).
    offload (learner.cpu_offload): FSDP2's CPUOffloadPolicy, the sharded parameters, their
    gradients and the optimizer state in host memory, the optimizer step on the CPU.
    """
    # heavy: torch.distributed.fsdp (DTensor and sympy, 1.1 s): only a sharding rank pays it
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    blocks = transformer_blocks(module)
    if not blocks:
        log.warning("shard_model: %s has no %s ModuleList; sharding the root only",
                    type(module).__name__, "/".join(BLOCK_LISTS))
    mp = MixedPrecisionPolicy(
        # The sharded params are the fp32 masters; param_dtype is model.dtype, the dtype the
        # sampler holds every weight in, so both compute the same velocities (log r = 0 on
        # replay). None (LoRA) keeps each param's dtype: a bf16 frozen base, fp32 adapters.
        param_dtype=param_dtype,
        # Gradients are averaged across ranks in fp32: bf16 sums lose the small GRPO updates.
        reduce_dtype=torch.float32,
        # Inputs pass as the model casts them: casting a block's fp32 RoPE table or timestep
        # embedding to bf16 would compute other velocities than the sampler's.
        cast_forward_inputs=False,
    )
    # pinned host memory copies faster to and from the GPU; a CPU-only process has none to pin
    policy = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if offload else OffloadPolicy()
    for block in blocks:
        # One FSDP unit per block: its all-gather overlaps the previous block's compute, and
        # only one block's full weights are alive at a time.
        # reshard_after_forward=True frees the gathered weights after forward and gathers again
        # in backward (ZeRO-3): memory, not bandwidth, bounds 14B video transformers.
        fully_shard(block, mesh=mesh, reshard_after_forward=True, mp_policy=mp, offload_policy=policy)
    # The root holds what is left (patch/time/text embeddings, the head). Its weights are the
    # first needed in backward, right after forward, so keeping them gathered saves a re-gather.
    fully_shard(module, mesh=mesh, reshard_after_forward=False, mp_policy=mp, offload_policy=policy)
    return module


def reshard(module: nn.Module) -> None:
    """Free every gathered (unsharded) copy of `module`'s FSDP2 units: the next forward gathers
    from the shards. Needed after the shards change outside an optimizer step (anchor swaps)."""
    # heavy: torch.distributed.fsdp (shard_model loaded it)
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def full_tensors(tensors: Iterable[tuple[Tensor, torch.dtype]]) -> Iterator[Tensor]:
    """Each tensor's full value in the given dtype, one at a time, in order. A collective per
    sharded tensor: every rank must walk the same list.

    The cast runs on each rank's shard before the all-gather, so the wire carries the compute
    dtype (half the bytes of fp32 masters, and the same rounding as casting the whole tensor);
    only the tensor asked for is ever gathered, and it lives until the caller moves on.
    """
    for t, dtype in tensors:
        yield full_value(t.detach().to(dtype))


def is_dtensor(t) -> bool:
    """Whether `t` is a DTensor, without importing torch.distributed.tensor (1 s, sympy) where no
    DTensor was ever made: none can exist before that module is loaded."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def full_value(t: Tensor) -> Tensor:
    """A DTensor's full value (a collective when sharded), or the tensor itself."""
    full = getattr(t, "full_tensor", None)
    return full() if full is not None else t


def shutdown_process_group(mode: Literal["barrier_only", "destroy"] = "barrier_only") -> bool:
    """End this rank's part in the default group; returns whether the barrier completed.

    `barrier_only` (the default, see the module doc) leaves the group for process exit;
    `destroy` destroys it after the barrier, rank 0 last so its store outlives its peers.
    """
    if not dist.is_available() or not dist.is_initialized():
        return True
    rank = dist.get_rank()
    try:
        dist.barrier()  # bounded by the group's timeout
        ok = True
    except Exception as e:  # a dead peer: nothing more can be synchronised
        log.warning("learner rank %d: teardown barrier failed (%s); leaving the group as is", rank, e)
        return False
    if mode == "destroy":
        global _control
        if rank == 0:
            time.sleep(0.2)  # let the peers close their pairs against a live store first
        dist.destroy_process_group()  # every group, the control group too
        _control = None
    return ok
