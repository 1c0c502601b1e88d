"""The cluster preflight: what `vgrpo train` checks on the cluster itself once Ray is up, before
any model loads (preflight.py checks the inputs on the driver's node before Ray starts).

1. Role resources (`check_resources`): every pool's processes find a node that offers their
   bundle (the role resource, CPUs, GPUs; pools.bundle_of), by the nodes' totals. What is
   missing is one line naming the role, what the nodes offer and the `ray start --resources`
   that provides it. Where an autoscaler's node groups offer it (KubeRay worker groups
   declaring the resource), the run says in one line what it waits for and for how long
   (preflight.autoscale_wait_s); the pools' placement then waits that long before it refuses.
2. One small task per role and node (`probe_roles`), placed in a bundle of the role's own
   placement group (the role's resources, runtime env and working directory, as its actors will
   have them). It checks the files the role reads (model.path; the reward models' folders and
   upstream templates; the I2V first frames the prompt sets name), CUDA where the pool asks for
   GPUs (device count, torch and its CUDA build, the NVIDIA driver; not where they are simulated,
   pools.simulated_gpus, a CPU test of a GPU layout), the GPU's memory against
   the plan's peak for the role, and that the storage the role writes (the learner's
   checkpoints) is there and writable. All of it within preflight.timeout_s.

Every failure is one line naming the role, the node and the fix; they are raised together as
one `ClusterRefused` (exit 2). preflight.skip_cluster_checks skips both parts.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

from cluster.data.manifests import image_paths
from cluster.driver.errors import ClusterRefused
from cluster.driver.pools import ROLES, Placement, bundle_of, pool_processes, show_bundle
from cluster.driver.probe import FileCheck, ProbeSpec, probe
from cluster.plan.checks import ROLE_FIX, role_peaks
from cluster.plan.sizing import plan
from common.errors import last_line
from common.families import FAMILIES
from common.scorers import scorer_spec
from rollout_worker.models.base import is_local

log = logging.getLogger("vgrpo.preflight")

SKIP = "or set preflight.skip_cluster_checks=true if you know better"


# --- 1. role resources --------------------------------------------------------------------


@dataclass(frozen=True)
class Node:
    id: str
    ip: str
    resources: dict[str, float]  # the node's totals


def alive_nodes() -> list[Node]:
    import ray  # heavy: ray

    return [Node(n["NodeID"], n.get("NodeManagerAddress", "?"), dict(n.get("Resources") or {}))
            for n in ray.nodes() if n.get("Alive")]


def _fits(left: dict[str, float], bundle: dict[str, float]) -> bool:
    return all(left.get(k, 0.0) >= v - 1e-9 for k, v in bundle.items())


def unplaced(cfg, nodes: list[Node]) -> dict[str, int]:
    """Processes of each role no node has room for, by the nodes' totals. Each bundle goes to a
    node that already holds the role (PACK), else to the one offering the fewest other roles."""
    left = {n.id: dict(n.resources) for n in nodes}
    out: dict[str, int] = {}
    for role, (pool, count) in pool_processes(cfg).items():
        bundle, used = bundle_of(pool, role), set()
        for _ in range(count):
            fits = [n for n in nodes if _fits(left[n.id], bundle)]
            if not fits:
                out[role] = out.get(role, 0) + 1
                continue
            node = min(fits, key=lambda n: (n.id not in used,
                                            sum(n.resources.get(r, 0) > 0 for r in ROLES if r != role)))
            for k, v in bundle.items():
                left[node.id][k] -= v
            used.add(node.id)
    return out


def _num(x: float) -> str:
    return f"{x:g}"


def start_command(head: str, role: str, k: int, bundle: dict[str, float]) -> str:
    """The `ray start` that adds a machine offering `k` processes of the role."""
    cmd = f"ray start --address={head} --resources='{{\"{role}\": {k}}}'"
    if bundle.get("GPU"):
        cmd += f" --num-gpus={math.ceil(k * bundle['GPU'])}"
    return cmd


def resource_line(cfg, role: str, missing: int, nodes: list[Node], head: str, local: bool) -> str:
    """One line: what pools.<role> asks, what the nodes offer, and the `ray start` that adds it."""
    pool, count = pool_processes(cfg)[role]
    bundle = bundle_of(pool, role)
    asks = f"pools.{role} needs {count} process(es) of {show_bundle(bundle)}"
    offering = [n for n in nodes if n.resources.get(role, 0) > 0]
    have = sum(n.resources.get(role, 0) for n in nodes)
    shown = ", ".join(f"node {n.ip}: " + ", ".join(f"{k} {_num(n.resources.get(k, 0))}" for k in bundle)
                      for n in offering[:4]) + (f", … ({len(offering)} nodes)" if len(offering) > 4 else "")
    cmd = start_command(head, role, missing, bundle)
    if local:  # a cluster this run started on its own machine: the machine lacks it
        short = [k for k in bundle if k != role and sum(n.resources.get(k, 0) for n in nodes) < count * bundle[k]]
        return (f"{role}: {asks}, but this machine offers Ray only {shown or 'none'} (short of "
                f"{', '.join(short) or role}); run where there is room (RAY_ADDRESS of a cluster), or lower "
                f"pools.{role}.num_gpus / num_cpus / num_actors")
    if have <= 0:
        return (f"{role}: no node declares the `{role}` resource; {asks}; on each {role} machine run `{cmd}` "
                f"(one `{role}` unit per process: an 8-GPU machine declares 8; docs/deploy.md section 7), {SKIP}")
    if have < count:
        return (f"{role}: the nodes declare {_num(have)} `{role}` ({shown}) but {asks}; add {missing} with "
                f"`{cmd}`, or lower pools.{role}.num_actors, {SKIP}")
    short = [k for k in bundle if k != role and sum(n.resources.get(k, 0) for n in offering) < count * bundle[k]]
    return (f"{role}: the nodes declaring `{role}` ({shown}) have too little {', '.join(short) or 'room'} for "
            f"{missing} of the {count} processes ({show_bundle(bundle)} each); declare `{role}` on machines that "
            f"have it (`{cmd}`), or lower pools.{role}.num_gpus / num_cpus, {SKIP}")


def autoscaler_groups() -> list[tuple[str, dict[str, float], int]]:
    """The autoscaler's node groups (name, resources of one node, max nodes; -1: no limit), as
    KubeRay's autoscaler v2 reports them to the cluster; [] without an autoscaler."""
    try:
        from ray._private.state import state  # heavy: ray

        config = state.get_cluster_config()
    except Exception:  # noqa: BLE001 - no autoscaler state: nothing can be added
        return []
    if config is None:
        return []
    return [(g.name, {k: float(v) for k, v in g.resources.items()}, int(g.max_count))
            for g in config.node_group_configs]


def offering_groups(groups, bundle: dict[str, float]) -> list[tuple[str, dict[str, float], int]]:
    return [g for g in groups if g[2] != 0 and _fits(g[1], bundle)]


def check_resources(cfg, local: bool, note: Callable[[str], None]) -> float:
    """Refuse (ClusterRefused) when a pool's processes have no node; where an autoscaler's groups
    offer them, say so in one line and return how long the placement may wait for them
    (preflight.autoscale_wait_s). Returns the placement's wait otherwise, too."""
    import ray  # heavy: ray

    wait_s = cfg.preflight.autoscale_wait_s
    if cfg.preflight.skip_cluster_checks:
        return wait_s
    nodes = alive_nodes()
    missing = unplaced(cfg, nodes)
    if not missing:
        return wait_s
    head = ray.get_runtime_context().gcs_address
    lines = [resource_line(cfg, role, k, nodes, head, local) for role, k in missing.items()]
    groups = [] if local else autoscaler_groups()
    offers = {role: offering_groups(groups, bundle_of(pool_processes(cfg)[role][0], role)) for role in missing}
    if groups and all(offers.values()) and wait_s > 0:
        what = "; ".join(f"{k} x pools.{role} ({' or '.join(g[0] for g in offers[role])})" for role, k in missing.items())
        note(f"waiting up to {wait_s:.0f} s (preflight.autoscale_wait_s) for the autoscaler to add {what}; "
             "then the run stops")
        return wait_s
    raise ClusterRefused("\n".join(lines))


# --- 2. one task per role and node (cluster/driver/probe.py runs there) ----------------------

SHARED = "it must be at the same path on every {role} machine (shared storage, or a copy on each)"


def role_specs(cfg, run_dir, peaks: dict[str, tuple[float, str]], driver_node: str) -> dict[str, ProbeSpec]:
    """What each role reads and writes, as plain data for its task."""
    specs = {role: ProbeSpec(role, gpus=float(getattr(cfg.pools, role).num_gpus), simulated=cfg.pools.simulated_gpus,
                             peak=peaks.get(role),
                             peak_fix=ROLE_FIX.get(role, ""), driver_node=driver_node) for role in ROLES}
    path = cfg.model.path
    if path is not None and (is_local(path) or not FAMILIES[cfg.model.family].needs_path):
        needs_dir = FAMILIES[cfg.model.family].needs_path
        for role in ("rollout", "learner"):
            specs[role].files.append(FileCheck("model.path", path, "dir" if needs_dir else "path",
                                               SHARED.format(role=role),
                                               ("model_index.json",) if needs_dir else ()))
    for i, m in enumerate(cfg.rewards.models):
        f, spec = f"rewards.models[{i}]", scorer_spec(m.name)
        for key in ("path", "base_path"):
            value = getattr(m, key)
            if value and spec.needs_path and is_local(value):
                specs["reward"].files.append(FileCheck(f"{f}.{key}", value, "path", SHARED.format(role="reward")))
        if spec.template_file and m.template_path:
            specs["reward"].files.append(FileCheck(
                f"{f}.template_path", m.template_path, "template",
                f"{SHARED.format(role='reward')}; {spec.template_how}", (spec.template_file,)))
        elif spec.template_wheel and not m.template_path:
            specs["reward"].files.append(FileCheck(f"{f}.template_path", spec.template_wheel, "module",
                                                   spec.template_how))
    if cfg.model.task == "i2v":
        sets = {"train.prompts": cfg.train.prompts, "train.eval_prompts": cfg.train.eval_prompts,
                "health.eval_prompts": cfg.health.eval_prompts}
        images = {k: image_paths(v) for k, v in sets.items() if v is not None}
        for role in ("rollout", "reward"):
            specs[role].images = {k: v for k, v in images.items() if v}
    if not run_dir.remote:  # an object store is written through its own client (checked at create)
        specs["learner"].writable.append(("the run's checkpoints folder", str(run_dir.checkpoints)))
    return specs


def probe_roles(cfg, placements: list[Placement], run_dir, note: Callable[[str], None]) -> None:
    """One `probe` task per role and node, each in the first of the role's bundles on that node;
    every failure one line (ClusterRefused), all within preflight.timeout_s."""
    import ray  # heavy: ray

    if cfg.preflight.skip_cluster_checks:
        return
    specs = role_specs(cfg, run_dir, _peaks(cfg), ray.util.get_node_ip_address())
    ips = {n.id: n.ip for n in alive_nodes()}
    remote = ray.remote(max_calls=1)(probe)  # its worker exits after it: no CUDA context stays on a GPU
    tasks = {}
    for pl in placements:
        if pl.group is None:
            continue
        first: dict[str, int] = {}
        for index, node in sorted(pl.bundle_nodes().items()):
            first.setdefault(node, index)
        bundle = bundle_of(pl.pool, pl.role)
        for node, index in first.items():
            opts = pl.options(index)
            ref = remote.options(num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
                                 resources={pl.role: 1}, max_retries=0,
                                 scheduling_strategy=opts["scheduling_strategy"]).remote(specs[pl.role])
            tasks[ref] = f"{pl.role} on node {ips.get(node, node)}"
    timeout_s = cfg.preflight.timeout_s
    ready, late = ray.wait(list(tasks), num_returns=len(tasks), timeout=timeout_s)
    lines: list[str] = []
    for ref in ready:
        try:
            problems, found = ray.get(ref)
        except ray.exceptions.RayError as e:
            why = last_line(e)
            fix = ("submit with `ray job submit --working-dir .` from the project, or install vgrpo on every node"
                   if "ModuleNotFoundError" in why else "see the node's Ray logs")
            lines.append(f"{tasks[ref]}: the check could not run ({why}); {fix}, {SKIP}")
            continue
        lines += problems
        if found:
            note(found)
    for ref in late:
        ray.cancel(ref, force=True)
        lines.append(f"{tasks[ref]}: the check did not finish within {timeout_s:g} s (preflight.timeout_s): the "
                     f"node could not start a worker with the job's runtime env, or its storage hangs; {SKIP}")
    if lines:
        raise ClusterRefused("\n".join(lines))


def _peaks(cfg) -> dict[str, tuple[float, str]]:
    """The plan's GPU peak per process of each pool with GPUs ({} for families without a plan)."""
    if cfg.preflight.skip_gpu_memory_check or not FAMILIES[cfg.model.family].planned or \
            not any(getattr(cfg.pools, r).num_gpus > 0 for r in ROLES):
        return {}
    try:
        return role_peaks(cfg, plan(cfg))
    except ValueError:
        return {}
