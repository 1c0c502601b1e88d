"""Pools: where each role's actors run, and joining or starting the Ray cluster.

Each role asks for its Ray custom resource (`rollout`, `reward`, `learner`) plus the CPUs and
GPUs its pool config gives. A local run declares all three resources on the local node; on a
cluster, each KubeRay worker group provides one. A placement group per pool keeps that pool's
actors together (PACK), so a pool scales by adding bundles, not by scattering.
"""

from __future__ import annotations

import json
import logging
import math
import os
import uuid
from dataclasses import dataclass
from typing import Any

from cluster.plan.devices import shared_devices
from common.config import PoolConfig, RunConfig
from common.errors import UserError

log = logging.getLogger("vgrpo.pools")

ROLES = ("rollout", "reward", "learner")
JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # what Ray's job supervisor sets for a submitted entrypoint


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
        """End this process's Ray: the local cluster it started, or its connection to the one it
        joined (the cluster goes on; the streaming of the ended actors' logs stops here)."""
        import ray  # lazy: ray (kept out of vgrpo --help)

        if (self.started_here or self.joined) and ray.is_initialized():
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


def simulated_gpus(cfg: RunConfig) -> int | None:
    """GPUs a local cluster declares for pools.simulated_gpus: the devices the fractional shares
    pack onto (cluster/plan/devices.shared_devices) and the whole GPUs of the rest; None (Ray
    detects the machine's own) when the GPUs are real."""
    if not cfg.pools.simulated_gpus:
        return None
    p = cfg.pools
    whole = sum(math.ceil(pool.num_gpus) * n for pool, n in
                ((p.rollout, p.rollout.processes), (p.reward, reward_actor_count(cfg)),
                 (p.learner, p.learner.processes)) if pool.num_gpus >= 1)
    return whole + len(shared_devices(cfg))


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
        # under `ray job submit` the job's runtime env (its working_dir: the project, where every
        # worker runs it) is merged with this one; a variable the job sets itself is left to it
        job_env = (job_runtime_env() or {}).get("env_vars") or {}
        ray.init(address=address, runtime_env={"env_vars": {k: v for k, v in env.items() if k not in job_env}},
                 log_to_driver=True)
        return RayHandle(started_here=False, joined=True)
    resources = {k: v * copies for k, v in local_resources(cfg).items()}
    gpus = simulated_gpus(cfg)
    ctx = ray.init(num_cpus=local_cpus(cfg) * copies, num_gpus=None if gpus is None else gpus * copies,
                   resources=resources, include_dashboard=False,
                   runtime_env={"env_vars": env}, log_to_driver=True, logging_level=logging.WARNING)
    return RayHandle(started_here=True, session_dir=ctx.address_info.get("session_dir"))


def job_runtime_env() -> dict[str, Any] | None:
    """The runtime env `ray job submit` gave this process's job (its `--working-dir` as a
    `working_dir` URI, `--runtime-env-json`'s fields); None when this is not a submitted job."""
    raw = os.environ.get(JOB_CONFIG_ENV)
    if not raw:
        return None
    try:
        env = json.loads(raw).get("runtime_env")
    except (ValueError, AttributeError):
        return None
    return env if isinstance(env, dict) else {}


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


def bundle_of(pool: PoolConfig, role: str) -> dict[str, float]:
    """The resources of one process of a pool: its role resource, CPUs and GPUs (none of zero)."""
    bundle = {role: 1.0, "CPU": pool.num_cpus, "GPU": pool.num_gpus}
    return {k: float(v) for k, v in bundle.items() if v > 0}


def show_bundle(bundle: dict[str, float]) -> str:
    """{rollout: 1, CPU: 8, GPU: 1}"""
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in bundle.items()) + "}"


def pool_processes(cfg: RunConfig) -> dict[str, tuple[PoolConfig, int]]:
    """Each role's pool and the processes (placement bundles) the driver asks for: at least one
    rollout actor, one reward actor per model per replica, the learner's ranks, each × parallel.sp."""
    p = cfg.pools
    return {"reward": (p.reward, reward_actor_count(cfg)),
            "rollout": (p.rollout, max(1, p.rollout.num_actors) * p.rollout.parallel.sp),
            "learner": (p.learner, p.learner.num_actors * p.learner.parallel.sp)}


def placement_group_for(pool: PoolConfig, role: str, count: int):
    """A PACK placement group with one bundle per process of the pool's `count` actors; None for
    an empty pool. Bundles 0..count-1 are the actors themselves; with parallel.sp > 1 the rest
    hold their SP followers (rollout_worker/sp_group.py)."""
    # lazy: ray (kept out of vgrpo --help)
    from ray.util.placement_group import placement_group

    if count <= 0:
        return None
    bundle = bundle_of(pool, role)
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
        placement = cls.request(pool, role, count)
        wait_placed([placement], timeout_s)
        return placement

    @classmethod
    def request(cls, pool: PoolConfig, role: str, count: int) -> Placement:
        """Ask for the placement group without waiting for it (`wait_placed`)."""
        return cls(pool, role, placement_group_for(pool, role, count))

    def bundle_nodes(self) -> dict[int, str]:
        """Bundle index -> the id of the node it was placed on (a ready group)."""
        if self.group is None:
            return {}
        # lazy: ray (kept out of vgrpo --help)
        from ray.util.placement_group import placement_group_table

        return {int(i): n for i, n in placement_group_table(self.group).get("bundles_to_node_id", {}).items()}

    def options(self, index: int, **extra: Any) -> dict[str, Any]:
        return actor_options(self.pool, self.role, **in_group(self.group, index), **extra)

    def remove(self) -> None:
        if self.group is not None:
            # lazy: ray (kept out of vgrpo --help)
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.group)
            self.group = None


class NotPlaced(UserError):
    """Pools whose placement groups were not ready in time (one line)."""


def wait_placed(placements: list[Placement], timeout_s: float) -> None:
    """Wait until every pool's placement group is ready; else one line naming the pools that are
    not, what each asks per process, and for how long it waited."""
    import ray  # lazy: ray (kept out of vgrpo --help)

    refs = {p.group.ready(): p for p in placements if p.group is not None}
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    late = [p for r, p in refs.items() if r not in ready]
    if late:
        what = "; ".join(f"pools.{p.role}: {len(p.group.bundle_specs)} x {show_bundle(bundle_of(p.pool, p.role))}"
                         for p in late)
        raise NotPlaced(f"the cluster did not place {what} within {timeout_s:.0f} s: another job holds those "
                        "resources, or no node offers them (raise preflight.autoscale_wait_s to wait longer)")
