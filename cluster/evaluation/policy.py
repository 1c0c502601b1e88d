"""A run's trained policy, in this process (no Ray): find its checkpoint, load it into the
rollout model, ODE-sample the evaluation pairs and score them (`vgrpo eval`, `vgrpo sample`,
the evaluation curve)."""

from __future__ import annotations

from pathlib import Path

from common import storage

POLICY_FILE = "policy.safetensors"


def policy_checkpoints(run) -> list:
    """A run's checkpoint dirs that hold the exported policy, oldest first (Paths, or Uris for a
    run on an object store)."""
    from learner.checkpoint import step_dirs

    root = storage.location(run) / "checkpoints"
    if not root.is_dir():
        return []
    # step_dirs: on an object store only those whose marker is written (the policy goes in first)
    return [d for d in step_dirs(root) if (d / POLICY_FILE).is_file()]


def resolve_target(target: str, config: str | None, step: int | None = None):
    """(config, checkpoint dir or None) for a run dir (its newest checkpoint, or `step`'s), a
    checkpoint dir, or 'base'. A run may live on an object store (s3://…)."""
    from common.config import ConfigError, load_config

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
    import torch
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load, load_file

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
    import json

    n = int.from_bytes(data[:8], "little")
    return dict(json.loads(data[8:8 + n]).get("__metadata__") or {})


def load_policy(cfg, ckpt: Path | None):
    """The rollout model with the checkpoint's published weights loaded (adapter or full)."""
    import torch

    from learner.checkpoint import CheckpointError
    from rollout_worker.models import build_model
    from rollout_worker.models.lora import inject_lora

    payload = read_policy(ckpt / POLICY_FILE) if ckpt is not None else None  # before the slow model build
    torch.set_num_threads(cfg.pools.rollout.torch_threads)
    model = build_model(cfg)
    if payload is not None:
        if cfg.optim.finetune == "lora":
            inject_lora(model.trainable_module(), cfg.model.family, cfg.optim)
        try:
            model.load_weights(payload)
        except (KeyError, RuntimeError) as e:  # names or shapes that are not this model's
            raise CheckpointError(f"{ckpt / POLICY_FILE}: does not fit the run's model "
                                  f"({str(e).splitlines()[0]}); was the config edited after training?") from None
    return model


def score(cfg, frames, prompts, images=None, factory=None):
    """Scores from every reward model of the config, merged, and the composite with the run's
    reward heads (common/rewards.py). `images`: the I2V first frames uint8 [B, H, W, 3], or None;
    `factory`: builds a reward model from its config (default: the registry's scorers)."""
    from common.rewards import RewardHeads
    from common.types import Scores

    if factory is None:
        from reward_worker.registry import build_reward_model as factory
        from reward_worker.registry import config_heads

        config_heads(cfg.rewards.models)  # a shared head name: refused before any model loads
    parts = []
    for m in cfg.rewards.models:  # one model in memory at a time
        rm = factory(m)
        parts.append(Scores(rm.head_names(), rm.score(frames, prompts, images)))
    heads = RewardHeads.build(cfg.rewards.models, [p.heads for p in parts])
    scores = Scores.merge(parts)
    return scores, heads.composite(scores)


def evaluate_policy(cfg, ckpt: Path | None, seeds: int | None = None, prompts: str | None = None):
    """ODE-sample the evaluation pairs (`prompts` × `seeds`, default the run's train.eval_prompts ×
    train.eval_seeds) with the checkpoint (None: the base) and score them.
    Returns (EvalResult, frames uint8 [N, F, H, W, 3], the EvalSet)."""
    from cluster.evaluation.eval_set import EvalSet
    from cluster.evaluation.evaluate import EvalResult
    from common.images import condition_images
    from common.sde import Schedule
    from reward_worker.registry import config_heads
    from rollout_worker.sampler import sample_videos

    config_heads(cfg.rewards.models)  # a shared head name: refused before any video is sampled
    evals = EvalSet.load(prompts or cfg.train.eval_prompts, seeds or cfg.train.eval_seeds, cfg.model)
    images = condition_images(list(evals.conditions), cfg.model.height, cfg.model.width)  # I2V: uint8 [N, H, W, 3]
    model = load_policy(cfg, ckpt)
    frames = sample_videos(model, evals.prompts, list(evals.seeds), Schedule.from_config(cfg.schedule),
                           images=images, forward_batch_size=cfg.sampler.forward_batch_size)
    scores, composite = score(cfg, frames, evals.prompts, images)
    return EvalResult(scores.heads, scores.values.numpy(), composite.numpy()), frames, evals
