"""What `vgrpo plan` checks and `vgrpo train`'s preflight refuses: a role whose planned GPU peak
(plus plan.gpu_reserved_gib) leaves less than plan.min_free of its GPU, a bank that cannot hold
`bank.headroom_steps` steps of groups, a timeout below SAFETY times the work it waits for, a pod
below the host RAM of the processes it holds, a Redis maxmemory below bank.max_bytes. Each
check is one line of figures; a failing one also carries the one-line refusal (field, figure,
fix). GPU memory: `gpu_checks` refuses a pool with GPUs whose process peak (plus
plan.gpu_reserved_gib) leaves less than plan.min_free of plan.gpu (unless
preflight.skip_gpu_memory_check) and a GPU whose sharing processes' summed peaks do, and
`role_peaks` gives the peaks the cluster preflight compares
with each node's own GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cluster.plan.bank import BankSize, bank_size
from cluster.plan.devices import device_total, role_phases, shared_devices
from cluster.plan.host import (
    REDIS_OVERHEAD,
    ROLES,
    gi,
    host_ram,
    k8s_bytes,
    peak,
    redis_bytes,
)
from cluster.plan.sizing import (
    GB,
    GPUS,
    Plan,
    learner_memory,
    learner_peak,
)
from cluster.plan.timing import SAFETY, estimates
from common.config import ConfigError, PodsConfig


@dataclass
class Check:
    field: str
    ok: bool
    line: str          # the figures, as the plan prints them
    refusal: str = ""  # one line: the field, the figure, the fix (only when not ok)


def bank_check(cfg, b: BankSize) -> Check:
    h, have = cfg.bank.headroom_steps, cfg.bank.max_bytes
    need = h * b.step
    line = (f"bank.max_bytes {have / 1e9:.2f} GB holds {have / b.step:.1f} steps of "
            f"{b.step / 1e9:.2f} GB (bank.headroom_steps = {h})")
    refusal = (f"bank.max_bytes = {have} holds {have / b.step:.2f} training steps, below bank.headroom_steps = "
               f"{h}: one step is train.groups_per_step = {cfg.train.groups_per_step} x {b.group} bytes per "
               f"group ({cfg.sampler.group_size} members x {b.steps_per_member} stored steps of latents "
               f"{list(b.latent)}); set bank.max_bytes to at least {need} (and Redis maxmemory above it) "
               "or lower train.groups_per_step")
    return Check("bank.max_bytes", have >= need, line, refusal)


def timeout_checks(cfg, p: Plan) -> list[Check]:
    out = []
    for field, (est, parts) in estimates(cfg, p).items():
        section, key = field.split(".")
        have = getattr(getattr(cfg, section), key)
        need = SAFETY * est
        shown = " + ".join(f"{k} {v:.1f} s" for k, v in parts.items() if k != "bytes")
        if "bytes" in parts:
            shown = f"{parts['bytes'] / 1e9:.1f} GB at plan.storage_gb_s = {cfg.plan.storage_gb_s:g}"
        line = f"{field} {have:g} s vs {est:.1f} s estimated{f' ({shown})' if shown else ''}"
        refusal = (f"{field} = {have:g} is below {SAFETY:g}x the {est:.1f} s the work takes "
                   f"({shown or 'one micro-batch'}, on {p.gpu}); set {field} to at least {math.ceil(need)}")
        out.append(Check(field, have >= need, line, refusal))
    return out


def pod_checks(cfg, p: Plan, pods: PodsConfig) -> list[Check]:
    per = {role: peak(parts) for role, parts in host_ram(cfg, p).items()}
    shm = k8s_bytes(pods.shm)
    out = []
    for name, g in pods.groups.items():
        have = k8s_bytes(g.memory)
        units = {r: n for r, n in g.roles.items() if r in ROLES and n > 0}
        need = sum(n * per[r] for r, n in units.items()) + shm
        parts = " + ".join(f"{n:g} {r} x {per[r] / GB:.1f} GiB" for r, n in units.items())
        line = f"workerGroups.{name}.memory {g.memory} vs {need / GB:.1f} GiB ({parts} + /dev/shm {pods.shm})"
        refusal = (f"workerGroups.{name}.memory = {g.memory} is below the plan's {need / GB:.1f} GiB "
                   f"({parts} + /dev/shm {pods.shm}); set it to at least {gi(need)} in the chart's values")
        out.append(Check(f"workerGroups.{name}.memory", have >= need, line, refusal))
    if pods.redis_maxmemory is not None:
        have, need = redis_bytes(pods.redis_maxmemory), REDIS_OVERHEAD * cfg.bank.max_bytes
        line = f"redis.maxmemory {pods.redis_maxmemory} vs bank.max_bytes {cfg.bank.max_bytes / GB:.1f} GiB"
        refusal = (f"redis.maxmemory = {pods.redis_maxmemory} is below bank.max_bytes = {cfg.bank.max_bytes} "
                   f"plus {REDIS_OVERHEAD - 1:.0%} for Redis's own structures; set redis.maxmemory to at least "
                   f"{math.ceil(need / GB)}gb or lower bank.max_bytes")
        out.append(Check("redis.maxmemory", have >= need, line, refusal))
    return out


ROLE_FIX = {"learner": "set model.gradient_checkpointing true, raise pools.learner.num_actors (FSDP2 shards the "
                       "weights, gradients and optimizer over the ranks), set learner.cpu_offload=true, or "
                       "optim.finetune lora",
            "rollout": "lower sampler.forward_batch_size, set model.vae_tiling and model.text_encoder_offload true, "
                       "or raise pools.rollout.parallel.sp"}
SKIP_GPU = "or set preflight.skip_gpu_memory_check=true if you know better"


def role_peaks(cfg, p: Plan) -> dict[str, tuple[float, str]]:
    """The learner's and the rollout's GPU peak per process and at what (devices.role_phases),
    for the pools that have GPUs: what gpu_checks and the cluster preflight hold to a GPU."""
    return _on_gpu(cfg, role_phases(cfg, p))


def _on_gpu(cfg, phases: dict[str, tuple[float, str]]) -> dict[str, tuple[float, str]]:
    return {role: peak for role, peak in phases.items()
            if role in ("learner", "rollout") and getattr(cfg.pools, role).num_gpus > 0}


def _ranks_that_fit(cfg, p: Plan, cap: float) -> int | None:
    """The fewest learner ranks (a power of two, at most 64) whose step peak fits `cap` bytes."""
    n = 1
    while n <= 64:
        c = cfg.model_copy(update={"pools": cfg.pools.model_copy(update={
            "learner": cfg.pools.learner.model_copy(update={"num_actors": n})})})
        if learner_peak(learner_memory(c, p.arch), cfg.model.gradient_checkpointing) < cap:
            return n
        n *= 2
    return None


def gpu_checks(cfg, p: Plan) -> list[Check]:
    """Each pool with GPUs: its process's planned peak plus plan.gpu_reserved_gib (the CUDA
    context, NCCL, fragmentation) leaves plan.min_free of plan.gpu free. A pool that shares a GPU
    (fractional num_gpus) is checked against the whole GPU here, and the processes that share one
    are summed in device_checks."""
    cap = GPUS[p.gpu][1] * GB
    reserved, want = cfg.plan.gpu_reserved_gib * GB, cfg.plan.min_free
    out = []
    phases = role_phases(cfg, p)  # once: the per-process checks and the shared devices read it
    for role, (peak_b, what) in _on_gpu(cfg, phases).items():
        free = 1.0 - (peak_b + reserved) / cap
        line = (f"pools.{role} GPU peak ({what}) {peak_b / GB:.1f} + {reserved / GB:.1f} GiB reserved of "
                f"{cap / GB:.0f} GiB on {p.gpu}: {free:.0%} free (plan.min_free {want:.0%})")
        short = (f"leaves {free:.0%} of the {p.gpu}'s {cap / GB:.0f} GiB free" if free >= 0 else
                 f"exceeds the {p.gpu}'s {cap / GB:.0f} GiB by {(peak_b + reserved - cap) / GB:.1f} GiB")
        fix = ROLE_FIX[role]
        room = (1.0 - want) * cap - reserved
        if role == "learner" and "train step" in what and (n := _ranks_that_fit(cfg, p, room)) is not None \
                and n > cfg.pools.learner.num_actors:
            fix = f"set pools.learner.num_actors to at least {n} (FSDP2 shards over the ranks); or {fix}"
        refusal = (f"pools.{role}: the plan's {role} peak ({what}) of {peak_b / GB:.1f} GiB plus "
                   f"plan.gpu_reserved_gib = {cfg.plan.gpu_reserved_gib:g} {short}, and plan.min_free = {want:g} "
                   f"asks {want:.0%} free; {fix} (vgrpo plan shows the parts), {SKIP_GPU}")
        out.append(Check(f"pools.{role}", free >= want, line, refusal))
    return out + device_checks(cfg, p, phases)


def device_checks(cfg, p: Plan, phases: dict[str, tuple[float, str]]) -> list[Check]:
    """Each GPU that processes share (fractional pools.<role>.num_gpus, devices.shared_devices):
    their peaks summed, each with plan.gpu_reserved_gib, leave plan.min_free of it free. Every
    process keeps what its allocator reserved while another role is busy, so the peaks add."""
    cap = GPUS[p.gpu][1] * GB
    reserved, want = cfg.plan.gpu_reserved_gib * GB, cfg.plan.min_free
    peaks = {role: b for role, (b, _) in phases.items()}
    out = []
    for i, dev in enumerate(shared_devices(cfg)):
        total = device_total(peaks, dev, reserved)
        free = 1.0 - total / cap
        names = " + ".join(dev.roles)
        parts = " + ".join(f"{r} {peaks[r] / GB:.1f}" for r in dev.roles)
        line = (f"GPU {i} shared by {names}: {parts} + {len(dev.roles)} x {reserved / GB:g} GiB reserved of "
                f"{cap / GB:.0f} GiB on {p.gpu}: {free:.0%} free (plan.min_free {want:.0%})")
        refusal = (f"pools: {names} share GPU {i} and their peaks ({parts} GiB) plus {len(dev.roles)} x "
                   f"plan.gpu_reserved_gib = {cfg.plan.gpu_reserved_gib:g} come to {total / GB:.1f} of its "
                   f"{cap / GB:.0f} GiB ({free:.0%} free; plan.min_free = {want:g}); lower a role's peak "
                   f"(model.gradient_checkpointing, optim.finetune lora, sampler.forward_batch_size, "
                   f"model.text_encoder_offload; vgrpo plan shows the parts) or give a pool a GPU of its own "
                   f"(pools.<role>.num_gpus = 1), {SKIP_GPU}")
        out.append(Check(f"GPU {i}", free >= want, line, refusal))
    return out


def run_checks(cfg, p: Plan, pods: PodsConfig | None) -> list[Check]:
    """Every check, in the order they are reported."""
    gpu = [] if cfg.preflight.skip_gpu_memory_check else gpu_checks(cfg, p)
    out = [*gpu, bank_check(cfg, bank_size(cfg)), *timeout_checks(cfg, p)]
    return out + (pod_checks(cfg, p, pods) if pods is not None else [])


def refuse(checks: list[Check]) -> None:
    """Raise the first failing check's refusal as a ConfigError (one line, exit 2)."""
    for c in checks:
        if not c.ok:
            raise ConfigError(c.refusal)
