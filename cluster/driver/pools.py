"""Pools: where each role's actors run, and joining or starting the Ray cluster.

Each role asks for its Ray custom resource (`rollout`, `reward`, `learner`) plus the CPUs and
GPUs its pool config gives. A local run declares all three resources on the local node; on a
cluster, each KubeRay worker group provides one. A placement group per pool keeps that pool's
actors together (PACK), so a pool scales by adding bundles, not by scattering.
"""

from __future__ import annotations

import logging
import math
import os
import uuid
from dataclasses import dataclass
from typing import Any

from common.config import PoolConfig, RunConfig

log = logging.getLogger("vgrpo.pools")

ROLES = ("rollout", "reward", "learner")


@dataclass
class RayHandle:
    started_here: bool
    joined: bool = False  # joined a cluster by address (`ray job submit`, RAY_ADDRESS)
    session_dir: str | None = None  # the local cluster's session directory, when started here

    @property
    def own_session(self) -> str | None:
        """The Ray session whose processes die with this driver (its watchdog ends them): one it
        started itself, never a joined cluster's or one this process found running."""
        return self.session_dir if self.started_here and not self.joined else None

    def spans_nodes(self) -> bool:
        """Whether actors may run on other nodes than the driver's: a joined cluster (which may
        grow: the autoscaler), or one that has several nodes now."""
        import ray  # lazy: ray (kept out of vgrpo --help)

        return self.joined or sum(1 for n in ray.nodes() if n.get("Alive")) > 1

    def shutdown(self) -> None:
        import ray  # lazy: ray (kept out of vgrpo --help)

        if self.started_here and ray.is_initialized():
            ray.shutdown()


def pool_sizes(cfg: RunConfig) -> dict[str, PoolConfig]:
    pools = {"rollout": cfg.pools.rollout, "reward": cfg.pools.reward, "learner": cfg.pools.learner}
    return pools


def reward_actor_count(cfg: RunConfig) -> int:
    """One reward actor per reward model per reward-pool replica."""
    return max(1, cfg.pools.reward.num_actors) * len(cfg.rewards.models)


def local_resources(cfg: RunConfig) -> dict[str, float]:
    """Role resources a local node declares: enough for every process the config asks for
    (an actor with parallel.sp > 1 is sp processes)."""
    p = cfg.pools
    return {"rollout": float(max(1, p.rollout.num_actors) * p.rollout.parallel.sp),
            "reward": float(reward_actor_count(cfg)),
            "learner": float(max(1, p.learner.num_actors) * p.learner.parallel.sp)}


def local_cpus(cfg: RunConfig) -> int:
    need = (cfg.pools.rollout.num_cpus * cfg.pools.rollout.processes
            + cfg.pools.reward.num_cpus * reward_actor_count(cfg)
            + cfg.pools.learner.num_cpus * cfg.pools.learner.processes)
    return max(math.ceil(need), 1)


def init_ray(cfg: RunConfig, address: str | None = None, copies: int = 1) -> RayHandle:
    """Join RAY_ADDRESS (as under `ray job submit`) or start a local cluster sized for the config,
    or for `copies` runs of it at once (`vgrpo compare --parallel`)."""
    import ray  # lazy: ray (kept out of vgrpo --help)

    address = address or os.environ.get("RAY_ADDRESS")
    if ray.is_initialized():
        return RayHandle(started_here=False)
    env = cfg.env.variables()  # the allocator's and the collectives' settings (config section env)
    if address:
        log.info("joining Ray cluster at %s", address)
        ray.init(address=address, runtime_env={"env_vars": env}, log_to_driver=True)
        missing = [r for r in ROLES if ray.cluster_resources().get(r, 0) <= 0]
        if missing:
            log.warning("the cluster declares no %s resource yet; actors will wait for autoscaling",
                        ", ".join(missing))
        return RayHandle(started_here=False, joined=True)
    resources = {k: v * copies for k, v in local_resources(cfg).items()}
    ctx = ray.init(num_cpus=local_cpus(cfg) * copies, resources=resources, include_dashboard=False,
                   runtime_env={"env_vars": env}, log_to_driver=True, logging_level=logging.WARNING)
    return RayHandle(started_here=True, session_dir=ctx.address_info.get("session_dir"))


def actor_options(pool: PoolConfig, role: str, **extra: Any) -> dict[str, Any]:
    """Ray options for one actor of a pool: its role resource, CPUs, GPUs and restarts."""
    opts: dict[str, Any] = {
        "resources": {role: 1},
        "num_cpus": pool.num_cpus,
        "num_gpus": pool.num_gpus,
        "max_restarts": pool.max_restarts,
        "max_task_retries": 0,
    }
    opts.update(extra)
    return opts


def placement_group_for(pool: PoolConfig, role: str, count: int):
    """A PACK placement group with one bundle per process of the pool's `count` actors; None for
    an empty pool. Bundles 0..count-1 are the actors themselves; with parallel.sp > 1 the rest
    hold their SP followers (rollout_worker/sp_group.py)."""
    # lazy: ray (kept out of vgrpo --help)
    from ray.util.placement_group import placement_group

    if count <= 0:
        return None
    bundle = {"CPU": pool.num_cpus, role: 1.0}
    if pool.num_gpus:
        bundle["GPU"] = pool.num_gpus
    bundle = {k: v for k, v in bundle.items() if v > 0}
    # the name is unique per group: two runs in one process (`vgrpo compare --parallel`) each own one
    return placement_group([dict(bundle) for _ in range(count * pool.parallel.sp)], strategy="PACK",
                           name=f"vgrpo-{role}-{uuid.uuid4().hex[:8]}")


def in_group(pg, index: int) -> dict[str, Any]:
    """Options that put an actor in bundle `index` of a placement group."""
    if pg is None:
        return {}
    # lazy: ray (kept out of vgrpo --help)
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=index)}


@dataclass
class Placement:
    """One pool's actors, placed one way: a PACK placement group with one bundle per process, so
    a pool's actors sit together (a learner's ranks on as few nodes as fit) and a pool grows by
    bundles, not by scattering. `options(i)` are the Ray options of the pool's i-th actor."""

    pool: PoolConfig
    role: str
    group: Any = None  # the placement group; None for a pool of no actors

    @classmethod
    def create(cls, pool: PoolConfig, role: str, count: int, timeout_s: float = 300.0) -> Placement:
        import ray  # lazy: ray (kept out of vgrpo --help)

        pg = placement_group_for(pool, role, count)
        if pg is not None:
            ray.get(pg.ready(), timeout=timeout_s)
        return cls(pool, role, pg)

    def options(self, index: int, **extra: Any) -> dict[str, Any]:
        return actor_options(self.pool, self.role, **in_group(self.group, index), **extra)

    def remove(self) -> None:
        if self.group is not None:
            # lazy: ray (kept out of vgrpo --help)
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.group)
            self.group = None
