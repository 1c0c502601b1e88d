"""Host RAM per process and role, and the pods that must hold it (the Helm chart's values).

A rollout process loads its pipeline on the host in the dtypes it loads in, then moves it to
the GPU (diffusers' from_pretrained, then .to(cuda)): its host peak is the whole pipeline. A
sharded learner rank reads its own rows one weight at a time (learner/shard_load.py), so its
host holds one weight's rows at once; a single learner rank loads its trained transformer(s)
whole first. A checkpoint writes the policy one tensor at a time (learner/policy_writer.py:
each rank gathers every tensor in turn and writes those of its own shard files; no rank holds a
shard or the model): a rank's host holds the one tensor it copies out of the GPU, or, with the
weights on the host, the gathered tensor and its cast shard of it; then the trainer state, one
local storage at a time (torch.save; no copy of the shards). At a publish, learner rank 0 gathers the payload one bucket at a time in
the rollout's dtype (learner/weight_sync.stream_tensors): with the object store it copies each
bucket to the host for `ray.put` and drops it before the next; with the collective transport
it broadcasts from the GPU. Under
learner.cpu_offload a learner rank's masters, gradients, optimizer state and anchors live on
the host all run long, on top of its peak. A pod holds `rayResources` such processes of each
role plus its /dev/shm (memory-backed: it counts against the pod's limit).
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from cluster.plan.sizing import (
    GB,
    Plan,
    _safetensors_params,
    file_dtype_bytes,
    lean_setup,
    learner_offloaded,
)
from cluster.plan.timing import load_bytes, publish_bucket_bytes, wire_bytes
from common.config import ConfigError, PodsConfig
from common.scorers import scorer_spec

PROCESS_BYTES = 4 * GB
"""A role process before it loads anything: Python, torch, the CUDA context, the Ray worker
(an assumption; 3-4 GiB resident is typical for a CUDA torch process under Ray)."""
REDIS_OVERHEAD = 1.1
"""Redis's own structures and allocator slack over the bytes bank.max_bytes counts."""
ROLES = ("rollout", "reward", "learner")


def reward_bytes(m) -> float:
    """One reward model in its dtype: a local checkpoint's own files, else the released size."""
    c = 4 if m.dtype == "float32" else 2
    if m.path is not None and Path(m.path).is_dir() and any(Path(m.path).glob("*.safetensors")):
        return c * _safetensors_params(Path(m.path))
    return c * scorer_spec(m.name).params  # the released size (common/scorers.py)


def host_ram(cfg, p: Plan) -> dict[str, dict[str, float]]:
    """Role → {part: bytes} of one process's host peak (the parts' max, plus the process)."""
    # the pipeline loads on the host whole, text encoders included (they stay there when offloaded)
    rollout_load = p.rollout["weights"] + p.rollout["frozen modules"] + p.rollout.get("text encoders (while encoding)", 0.0)
    # object store: each bucket is copied to the host for ray.put (then dropped); collective:
    # broadcast from the GPU, nothing on the host
    at_publish = publish_bucket_bytes(cfg, p) if cfg.weight_sync.transport == "object_store" else 0.0
    rewards = [reward_bytes(m) for m in cfg.rewards.models] or [0.0]
    return {"rollout": {"process": PROCESS_BYTES, "pipeline load": rollout_load},
            "reward": {"process": PROCESS_BYTES, "model load": max(rewards)},
            "learner": {"process": PROCESS_BYTES, **learner_host(cfg, p),
                        "rank 0 at a publish (one bucket)": at_publish}}


def learner_host(cfg, p: Plan) -> dict[str, float]:
    """A learner rank's host parts besides its process and a publish: its model read, the
    checkpoint save's transient, and what learner.cpu_offload keeps resident."""
    a, n = p.arch, max(1, cfg.pools.learner.processes)  # FSDP2 shards over num_actors × sp
    if lean_setup(cfg):
        out = {"shard read (one weight's rows)": file_dtype_bytes(cfg) * a.largest_params / n}
    else:
        out = {"transformer load": load_bytes(cfg, p)}
    out.update(checkpoint_host(cfg, p))
    offloaded = learner_offloaded(cfg, a)
    if offloaded:
        out[RESIDENT] = offloaded
    return out


POLICY_WRITE, STATE_WRITE = "checkpoint policy (one tensor)", "checkpoint save (one storage)"


def checkpoint_host(cfg, p: Plan) -> dict[str, float]:
    """A learner rank's host bytes while a checkpoint is written, per part (they run one after the
    other, so the peak is the larger). The policy (learner/policy_writer.py) goes one tensor at a
    time in the rollout's dtype: the largest weight (a LoRA run: adapter) copied out of the GPU to
    be written; with the weights on the host (learner.cpu_offload, or a learner without GPUs) the
    gather is on the host: the gathered tensor and this rank's cast shard of it (sharded fp32
    masters cast to model.dtype), or nothing for one rank, which writes its tensors as they are.
    The trainer state: torch.save moves one storage at a time to the host, a weight's fp32
    shard, none when it is already there."""
    a, n = p.arch, max(1, cfg.pools.learner.processes)  # FSDP2 shards over num_actors × sp
    full = cfg.optim.finetune == "full"
    on_host = cfg.learner.cpu_offload or cfg.pools.learner.num_gpus == 0
    wire = wire_bytes(cfg) if full else 4                 # LoRA adapters travel in fp32
    largest = wire * (a.largest_params if full else a.largest_lora)
    if on_host:
        cast = largest / n if full and wire < 4 else 0.0
        policy = largest + cast if lean_setup(cfg) else 0.0
    else:
        policy = largest
    state = 0.0 if on_host else 4 * a.largest_params / n
    return {POLICY_WRITE: policy, STATE_WRITE: state}


RESIDENT = "resident: cpu offload"
"""A part held all run long (added to the peak, not one of the transients it takes the max of)."""


def peak(parts: dict[str, float]) -> float:
    transient = [v for k, v in parts.items() if k not in ("process", RESIDENT)]
    return parts["process"] + parts.get(RESIDENT, 0.0) + max(transient)


# --- quantities ---------------------------------------------------------------------------

_K8S = {"": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
        "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_REDIS = {"": 1, "k": 1e3, "kb": 2**10, "m": 1e6, "mb": 2**20, "g": 1e9, "gb": 2**30}


def k8s_bytes(q: str) -> float:
    """A Kubernetes quantity (96Gi, 64G, 1000000) in bytes."""
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)([A-Za-z]*)", str(q).strip())
    if m is None or m.group(2) not in _K8S:
        raise ValueError(f"{q!r} is not a Kubernetes memory quantity (e.g. 96Gi)")
    return float(m.group(1)) * _K8S[m.group(2)]


def redis_bytes(q: str) -> float:
    """A Redis memory value (8gb = 8 GiB, 8g = 8e9, bytes) in bytes."""
    m = re.fullmatch(r"([0-9]+)([A-Za-z]*)", str(q).strip())
    if m is None or m.group(2).lower() not in _REDIS:
        raise ValueError(f"{q!r} is not a Redis memory value (e.g. 12gb)")
    return float(m.group(1)) * _REDIS[m.group(2).lower()]


def gi(nbytes: float) -> str:
    """Bytes as the smallest whole Gi quantity that holds them."""
    return f"{-(-int(nbytes) // 2**30)}Gi"


# --- the chart's values -------------------------------------------------------------------

def merge_values(base: dict, over: dict) -> dict:
    """Helm's coalescing of a values file over the chart's: maps merge, a null deletes the key."""
    out = dict(base)
    for k, v in over.items():
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge_values(out[k], v)
        else:
            out[k] = v
    return out


def pods_from_values(values: dict) -> dict:
    """The `plan.pods` section the chart writes into the run config (templates/configmap-config.yaml),
    from a values file: every worker group's memory and roles, ray.shmSize, internal Redis's maxmemory."""
    groups = {name: {"memory": str(g["memory"]),
                     "roles": {r: float(n) for r, n in (g.get("rayResources") or {}).items() if r in ROLES}}
              for name, g in (values.get("workerGroups") or {}).items() if g}
    redis = values.get("redis") or {}
    out = {"groups": groups, "shm": str((values.get("ray") or {}).get("shmSize", "0"))}
    if redis.get("mode", "internal") == "internal":
        out["redis_maxmemory"] = str(redis["maxmemory"])
    return out


CHART_VALUES = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "vgrpo" / "values.yaml"
"""The chart's default values, present in a clone of the repository (not in the image)."""


def pods_for(cfg, values: str | Path | None = None):
    """(PodsConfig, where it came from) for the pod checks, or (None, why not): a values file
    given, else the config's plan.pods (the chart writes it), else the repository's chart values."""
    if values is None and cfg.plan.pods is not None:
        return cfg.plan.pods, "the config's plan.pods"
    path = Path(values) if values is not None else (CHART_VALUES if CHART_VALUES.is_file() else None)
    if path is None:
        return None, "not checked (no plan.pods in the config; pass --values FILE)"
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        if path.resolve() != CHART_VALUES and CHART_VALUES.is_file():  # as `helm install -f FILE` sees it
            data = merge_values(yaml.safe_load(CHART_VALUES.read_text(encoding="utf-8")) or {}, data)
        return PodsConfig.model_validate(pods_from_values(data)), _shown(path)
    except (OSError, yaml.YAMLError, KeyError, TypeError, AttributeError, ValueError) as e:
        raise ConfigError(f"--values {path}: cannot read its pods ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''})") from None


def _shown(path: Path) -> str:
    """A path relative to the working directory when it lies below it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)
