"""A run's trained policy as files: which checkpoints hold it, which config and checkpoint a
target names (a run dir, a checkpoint dir or 'base'), and reading its policy.safetensors with
one-line errors. Evaluation and export both read it; it loads no model."""

from __future__ import annotations

import json
from pathlib import Path

from common import storage
from common.config import ConfigError, load_config

POLICY_FILE = "policy.safetensors"


def policy_checkpoints(run) -> list:
    """A run's checkpoint dirs that hold the exported policy, oldest first (Paths, or Uris for a
    run on an object store)."""
    from learner.checkpoint import step_dirs  # heavy: torch (the CLI imports this module at start)

    root = storage.location(run) / "checkpoints"
    if not root.is_dir():
        return []
    # step_dirs: on an object store only those whose marker is written (the policy goes in first)
    return [d for d in step_dirs(root) if (d / POLICY_FILE).is_file()]


def resolve_target(target: str, config: str | None, step: int | None = None):
    """(config, checkpoint dir or None) for a run dir (its newest checkpoint, or `step`'s), a
    checkpoint dir, or 'base'. A run may live on an object store (s3://…)."""
    if target == "base":
        return load_config(config), None
    p = storage.location(target)
    if (p / "config.yaml").is_file():
        ckpts = policy_checkpoints(p)
        if step is not None:
            ckpts = [d for d in ckpts if d.name == f"step_{step:08d}"]
            if not ckpts:
                have = ", ".join(str(int(d.name[5:])) for d in policy_checkpoints(p)) or "none"
                raise ConfigError(f"--step {step}: {p} has no checkpoint of that step with {POLICY_FILE} "
                                  f"(kept: {have})")
        if not ckpts:
            raise ConfigError(f"{p}: no checkpoint with {POLICY_FILE} under {p / 'checkpoints'}")
        return load_config(p / "config.yaml"), ckpts[-1]
    if (p / POLICY_FILE).is_file() and (p.parent.parent / "config.yaml").is_file():
        return load_config(p.parent.parent / "config.yaml"), p
    raise ConfigError(f"{p}: not a run directory (config.yaml) or a checkpoint dir ({POLICY_FILE})")


def read_policy(f: Path) -> dict:
    """A checkpoint's policy.safetensors, or CheckpointError: one line naming the file and the fault."""
    return read_policy_file(f)[0]


def read_policy_file(f: Path) -> tuple[dict, dict[str, str]]:
    """(tensors, metadata) of a policy.safetensors, local or on an object store; CheckpointError
    (one line naming the file and the fault) when it is missing or damaged."""
    import torch  # heavy: torch and safetensors, only when a policy is read
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load, load_file

    # lazy: torch, safetensors (kept out of vgrpo --help)
    from learner.checkpoint import CheckpointError

    fix = "restore it, or evaluate an older checkpoint dir (TARGET/checkpoints/step_NNNNNNNN)"
    try:
        if storage.is_uri(f):
            data = storage.read_bytes(f)
            payload, meta = load(data), _metadata(data)
        else:  # memory-mapped: a full fine-tune's policy is the size of the transformer
            payload = load_file(str(f))
            with safe_open(str(f), "pt") as sf:
                meta = dict(sf.metadata() or {})
    except FileNotFoundError:
        raise CheckpointError(f"{f}: missing; {fix}") from None
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{f}: truncated or damaged safetensors file ({e}); {fix}") from None
    if not payload:
        raise CheckpointError(f"{f}: holds no tensors; {fix}")
    # safetensors has no checksum: flipped bytes in the data show up, if at all, as NaN/inf
    bad = next((k for k, v in payload.items() if v.is_floating_point() and not torch.isfinite(v).all()), None)
    if bad is not None:
        raise CheckpointError(f"{f}: tensor {bad!r} holds NaN/inf (a damaged file); {fix}")
    return payload, meta


def _metadata(data: bytes) -> dict[str, str]:
    """A safetensors file's __metadata__ (its header: 8-byte little-endian length, then JSON)."""
    n = int.from_bytes(data[:8], "little")
    return dict(json.loads(data[8:8 + n]).get("__metadata__") or {})
