"""A sequence-parallel rollout actor: one leader (the driver-facing handle) and sp - 1 followers.

With `pools.rollout.parallel.sp` > 1 the actor the driver creates is the leader. Its
constructor starts the followers (actors it owns: when it dies they die with it, and a
restarted leader starts fresh ones and a fresh process group), and all sp processes join one
torch.distributed group in which every transformer forward is split over their video tokens
(rollout_worker/models/sp.py). Every verb that runs the model runs on all of them at once with
the same arguments: they draw the same noise from the same seeds and record the same
trajectory; only the leader decodes, scores and pushes, so the driver sees one actor with the
usual receipts. Followers answer a digest of what they recorded, and the leader refuses a group
whose digests differ. A follower that is lost ends the leader's process, so Ray restarts the
whole SP group (the driver reloads the current weights into it, as for any restart).

Placement: when the leader runs in the rollout pool's placement group, which
`cluster.driver.pools.placement_group_for` sizes to num_actors × sp bundles, leader i's
followers take bundles num_actors + i·(sp - 1) + j; elsewhere they are placed by resources.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
from datetime import timedelta
from typing import Any

import ray
import torch
import torch.distributed as dist
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from common.types import Group
from common.weight_group import backend_for

log = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def join_sp_group(model, host: str, port: int, rank: int, sp: int, timeout_s: float) -> None:
    """Join the SP group's default process group and split `model`'s transformers over it."""
    from rollout_worker.models.sp import sp_mesh  # heavy: diffusers

    device = torch.device(model.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for(device), init_method=f"tcp://{host}:{port}", rank=rank,
                            world_size=sp, timeout=timedelta(seconds=timeout_s))
    model.enable_sp(sp_mesh(sp, device.type))


def group_digest(group: Group) -> str:
    """What a rank recorded, hashed: version, steps, log-probs, stored and final latents."""
    h = hashlib.sha256(f"{group.group_id}:{group.policy_version}".encode())
    for m in group.members:
        h.update(repr(m.step_indices).encode())
        for t in (m.logp_old, m.x, m.x_next, m.final_latents, m.mu_old):
            if t is not None:
                h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _follower_options(pool, actor_index: int, j: int, leaders: int) -> dict[str, Any]:
    opts: dict[str, Any] = {"resources": {"rollout": 1}, "num_cpus": pool.num_cpus, "num_gpus": pool.num_gpus,
                            "max_restarts": 0, "max_task_retries": 0}
    pg = ray.util.get_current_placement_group()
    index = leaders + actor_index * (pool.parallel.sp - 1) + (j - 1)
    if pg is not None and index < len(pg.bundle_specs):
        opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(placement_group=pg,
                                                                       placement_group_bundle_index=index)
    return opts


class SPFollowers:
    """The leader's handles on its followers: start them, join the group, run verbs in step."""

    def __init__(self, actor_cls, cfg, actor_index: int):
        pool = cfg.pools.rollout
        self.sp, self.timeout_s = pool.parallel.sp, cfg.sampler.timeout_s
        leaders = max(1, pool.num_actors)
        self.actors = [actor_cls.options(**_follower_options(pool, actor_index, j, leaders))
                       .remote(cfg, actor_index, sp_rank=j) for j in range(1, self.sp)]

    def join(self, model) -> None:
        """Every rank joins the group at once (init_process_group blocks until all are in)."""
        host, port = ray.util.get_node_ip_address(), _free_port()
        refs = [a.join_sp.remote(host, port) for a in self.actors]
        join_sp_group(model, host, port, 0, self.sp, self.timeout_s)
        self.wait(refs)

    def submit(self, method: str, *args: Any) -> list:
        return [getattr(a, method).remote(*args) for a in self.actors]

    def wait(self, refs: list) -> list:
        """The followers' answers; a lost follower ends this process, so Ray restarts the group."""
        try:
            return ray.get(refs)
        except ray.exceptions.RayActorError as e:
            log.error("rollout SP group: a follower was lost (%s); restarting the group", e)
            os._exit(1)

    def check(self, refs: list, own: str, what: str) -> None:
        digests = self.wait(refs)
        if any(d != own for d in digests):
            raise RuntimeError(f"rollout SP group: the {self.sp} ranks recorded different trajectories for {what}; "
                               "they must run identical code on identical inputs")
