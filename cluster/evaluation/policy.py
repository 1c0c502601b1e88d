"""A run's trained policy, in this process (no Ray): find its checkpoint, load it into the
rollout model, ODE-sample the evaluation pairs and score them (`vgrpo eval`, `vgrpo sample`,
the evaluation curve)."""

from __future__ import annotations

from pathlib import Path

from cluster.runs.policy_file import PolicyFiles


def load_policy(cfg, ckpt: Path | None):
    """The rollout model with the checkpoint's published weights loaded (adapter or full), one
    shard at a time (the host holds the model and one shard, never a second copy of the model)."""
    import torch  # lazy: torch (kept out of vgrpo --help)

    # lazy: torch (kept out of vgrpo --help)
    from learner.checkpoint import CheckpointError
    from rollout_worker.models import build_model
    from rollout_worker.models.lora import inject_lora

    files = PolicyFiles(ckpt) if ckpt is not None else None  # every index and header, before the slow build
    torch.set_num_threads(cfg.pools.rollout.torch_threads)
    model = build_model(cfg)
    if files is not None:
        if cfg.optim.finetune == "lora":
            inject_lora(model.trainable_module(), cfg.model.family, cfg.optim)
        try:
            model.weight_targets(files.names())   # a name the model lacks: refused before any load
            for part in files.parts():
                model.load_weights(part)
        except (KeyError, RuntimeError, ValueError) as e:  # names or shapes that are not this model's
            raise CheckpointError(f"{files.path}: does not fit the run's model "
                                  f"({str(e).splitlines()[0]}); was the config edited after training?") from None
    return model


def score(cfg, frames, prompts, images=None, factory=None):
    """Scores from every reward model of the config, merged, and the composite with the run's
    reward heads (common/rewards.py). `images`: the I2V first frames uint8 [B, H, W, 3], or None;
    `factory`: builds a reward model from its config (default: the registry's scorers)."""
    # lazy: torch (kept out of vgrpo --help)
    from common.rewards import RewardHeads
    from common.types import Scores

    if factory is None:
        # lazy: torch (kept out of vgrpo --help)
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
    # lazy: torch, rich (kept out of vgrpo --help)
    from cluster.evaluation.eval_set import EvalSet
    from cluster.evaluation.evaluate import EvalResult
    from common.images import condition_images
    from common.sde import Schedule
    from reward_worker.registry import config_heads
    from rollout_worker.sampler import sample_videos

    config_heads(cfg.rewards.models)  # a shared head name: refused before any video is sampled
    evals = EvalSet.load(prompts or cfg.train.eval_prompts, seeds or cfg.train.eval_seeds, cfg.model, cfg.data)
    images = condition_images(list(evals.conditions), cfg.model.height, cfg.model.width)  # I2V: uint8 [N, H, W, 3]
    model = load_policy(cfg, ckpt)
    frames = sample_videos(model, evals.prompts, list(evals.seeds), Schedule.from_config(cfg.schedule),
                           images=images, forward_batch_size=cfg.sampler.forward_batch_size)
    scores, composite = score(cfg, frames, evals.prompts, images)
    return EvalResult(scores.heads, scores.values.numpy(), composite.numpy()), frames, evals
