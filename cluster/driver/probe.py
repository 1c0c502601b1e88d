"""The task the cluster preflight runs on each role's node (cluster/driver/cluster_check.py), in a
bundle of the role's placement group: the files the role reads, CUDA and the GPU's memory, the
storage it writes. It imports nothing of the project's but this module (and torch, on a role with
GPUs), so it runs where the roles' own code would not even import; it reports, never raises.
"""

from __future__ import annotations

import importlib.util
import math
import os
import socket
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

GB = 1024**3


@dataclass(frozen=True)
class FileCheck:
    field: str           # the config field that names it
    path: str            # as the role reads it (relative: from its working directory)
    kind: str            # "path" (file or folder), "dir" (with `needed` inside), "template", "module"
    fix: str
    needed: tuple[str, ...] = ()


@dataclass
class ProbeSpec:
    """What one role's task checks on its node: plain data (it travels by value)."""

    role: str
    files: list[FileCheck] = field(default_factory=list)
    images: dict[str, list[str]] = field(default_factory=dict)   # prompt set field -> first-frame files
    writable: list[tuple[str, str]] = field(default_factory=list)  # (what, folder)
    gpus: float = 0.0
    simulated: bool = False  # pools.simulated_gpus: the GPUs are Ray's resources only; no CUDA looked for
    peak: tuple[float, str] | None = None  # the plan's GPU bytes per process, and at what
    peak_fix: str = ""
    driver_node: str = ""


def probe(spec: ProbeSpec) -> tuple[list[str], str]:
    """Runs on the role's node, in its bundle: (one line per failure, one line of what it found)."""
    import ray  # heavy: ray (the worker has it loaded)

    where = f"{spec.role} on node {ray.util.get_node_ip_address()} ({socket.gethostname()})"
    out = [f"{where}: {msg}" for msg in _file_problems(spec) + _writable_problems(spec)]
    found = ""
    if spec.gpus > 0 and spec.simulated:
        found = (f"{spec.gpus:g} of a simulated GPU (pools.simulated_gpus; Ray's GPU ids "
                 f"{ray.get_runtime_context().get_accelerator_ids().get('GPU')}): the role computes on the CPU")
    elif spec.gpus > 0:
        problems, found = _gpu(spec)
        out += [f"{where}: {msg}" for msg in problems]
    return out, f"{where}: {found}" if found else ""


def _shown(path: str) -> str:
    p = Path(path).expanduser()
    return repr(path) if p.is_absolute() else f"{path!r} (from {os.getcwd()})"


def _file_problems(spec: ProbeSpec) -> list[str]:
    out = []
    for c in spec.files:
        p = Path(c.path).expanduser()
        if c.kind == "module":
            if importlib.util.find_spec(c.path) is None:
                out.append(f"{c.field} is not set and the `{c.path}` package is not installed here; {c.fix}")
        elif c.kind == "template":
            if not (p.is_file() or all((p / n).is_file() for n in c.needed)):
                out.append(f"{c.field} = {_shown(c.path)}: no {', '.join(c.needed)} there; {c.fix}")
        elif not p.exists():
            out.append(f"{c.field} = {_shown(c.path)} not found; {c.fix}")
        elif c.kind == "dir":
            lacking = [n for n in c.needed if not (p / n).exists()]
            if lacking:
                out.append(f"{c.field} = {_shown(c.path)} lacks {', '.join(lacking)} (an incomplete copy?); {c.fix}")
    for set_field, paths in spec.images.items():
        gone = [p for p in paths if not os.path.isfile(p)]
        if gone:
            out.append(f"{len(gone)} of the {len(paths)} first-frame images {set_field} names are not here "
                       f"(e.g. {gone[0]!r}); the manifest's images must be at the same path on every rollout and "
                       "reward machine (shared storage)")
    return out


def _writable_problems(spec: ProbeSpec) -> list[str]:
    out = []
    for what, folder in spec.writable:
        p = Path(folder)
        if not p.is_dir():
            out.append(f"{what} {_shown(folder)} is not here (the driver made it on node {spec.driver_node}): "
                       "run.root must be storage the driver's node and every learner node share, at the same path")
            continue
        try:
            with tempfile.NamedTemporaryFile(dir=p, prefix=".vgrpo-preflight-"):
                pass
        except OSError as e:
            out.append(f"cannot write in {what} {_shown(folder)} ({e.strerror or type(e).__name__}); give the Ray "
                       "user write access there, or set run.root to storage it can write")
    return out


def _nvidia_driver() -> str | None:
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return None
    words = text.split()
    for i, w in enumerate(words):
        if w == "Module" and i + 1 < len(words):
            return words[i + 1].strip()
    return text.splitlines()[0][:80] if text else None


def _gpu(spec: ProbeSpec) -> tuple[list[str], str]:
    import torch  # heavy: torch, only on a role with GPUs

    build = f"torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}"
    driver = _nvidia_driver()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    asked = f"Ray gave it {spec.gpus:g} GPU (CUDA_VISIBLE_DEVICES={visible})"
    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            fix = "this torch is a CPU build: install the CUDA build of torch on the node (the image's)"
        elif driver is None:
            fix = "the node has no NVIDIA driver (/proc/driver/nvidia/version): install one, or give the pool no GPUs"
        else:
            fix = (f"NVIDIA driver {driver} may be older than CUDA {torch.version.cuda} needs, or the GPU is not "
                   "passed into the container: upgrade the driver or use a torch built for an older CUDA")
        return [f"{asked} but torch sees no CUDA device ({build}, NVIDIA driver {driver or 'none'}); the role "
                f"would run on the CPU; {fix}, or set pools.{spec.role}.num_gpus=0"], ""
    n = torch.cuda.device_count()
    props = torch.cuda.get_device_properties(0)
    total = props.total_memory
    found = f"{n} x {props.name} ({total / GB:.1f} GiB), {build}, NVIDIA driver {driver or '?'}"
    out = []
    if n < max(1, math.floor(spec.gpus)):
        out.append(f"{asked} but torch sees {n} device(s) ({found}); check the node's GPUs (nvidia-smi)")
    if spec.peak is not None:
        need, what = spec.peak
        cap = total * min(1.0, spec.gpus)
        if need > cap:
            out.append(f"the plan's peak per {spec.role} process is {need / GB:.1f} GiB ({what}), above the "
                       f"{cap / GB:.1f} GiB of this {props.name}; {spec.peak_fix}, or set "
                       "preflight.skip_gpu_memory_check=true if you know better")
    return out, found
