"""An evaluation sampled in the test's own process, to compare with what a run's actors scored."""

from __future__ import annotations


def local_eval(cfg, payload, pairs):
    """The (prompt, seed) pairs ODE-sampled in this process by a fresh toy model holding
    `payload` (LoRA injected as the run's), and scored: the composite per pair."""
    from cluster.evaluation.policy import score
    from common.sde import Schedule
    from rollout_worker.models.lora import inject_lora
    from rollout_worker.models.toy import ToyVideoModel
    from rollout_worker.sampler import sample_videos

    model = ToyVideoModel.from_config(cfg)
    inject_lora(model.transformer, "toy", cfg.optim)
    model.load_weights(payload)
    prompts, seeds = [p for p, _ in pairs], [s for _, s in pairs]
    frames = sample_videos(model, prompts, seeds, Schedule.from_config(cfg.schedule), "ode")
    return score(cfg, frames, prompts)[1].numpy()
