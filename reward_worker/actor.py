"""The reward role: one Ray actor per reward model, and the caller's client that fans out to them.

`RewardActor.score` batches up to `batch_size` videos per model call and turns a row with any
non-finite head into an all-NaN row, counted in `invalid_count()`: such a member never reaches
the loss. `RewardClient.score` asks every model at once, waits with a per-call timeout,
retries a bounded number of times, and raises RewardTimeout / RewardFailed so the driver
can refill the group.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch import Tensor

from common.actor_metrics import exports_score
from common.config import PoolConfig, RewardModelConfig
from common.types import Scores
from reward_worker.base import RewardModel

log = logging.getLogger(__name__)

ModelFactory = Callable[[RewardModelConfig], RewardModel]


class RewardTimeout(TimeoutError):
    """A reward model did not answer within its timeout, on every try."""


class RewardFailed(RuntimeError):
    """A reward model raised (or its actor died) on every try."""


class RewardActor:
    """Holds one reward model. Create with `create_reward_actor` (it asks for the `reward` resource)."""

    def __init__(self, cfg: RewardModelConfig, torch_threads: int = 1, factory: ModelFactory | None = None):
        torch.set_num_threads(torch_threads)
        if factory is None:
            from reward_worker.registry import build_reward_model as factory
        self.cfg = cfg
        self.model = factory(cfg)
        self._invalid = 0

    def heads(self) -> list[str]:
        return self.model.head_names()

    def invalid_count(self) -> int:
        """Rows with a non-finite score so far."""
        return self._invalid

    @exports_score
    def score(self, frames: Tensor, prompts: list[str], images: Tensor | None = None) -> Scores:
        """frames uint8 [B, F, H, W, 3], prompts [B], images uint8 [B, H, W, 3] or None → Scores [B, H]."""
        # 1. Check the request.
        if frames.dtype != torch.uint8 or frames.ndim != 5 or frames.shape[-1] != 3:
            raise ValueError(f"frames must be uint8 [B, F, H, W, 3], got {frames.dtype} {list(frames.shape)}")
        B = frames.shape[0]
        from common.images import resolve_images  # I2V first frames come by path, read here

        images = resolve_images(images, B, frames.shape[2], frames.shape[3])
        if len(prompts) != B or (images is not None and images.shape[0] != B):
            raise ValueError(f"{B} videos but {len(prompts)} prompts"
                             + ("" if images is None else f" and {images.shape[0]} images"))
        heads = self.heads()
        # 2. Score in batches of at most batch_size.
        parts = []
        for s in range(0, B, self.cfg.batch_size):
            sl = slice(s, s + self.cfg.batch_size)
            out = self.model.score(frames[sl], list(prompts[sl]), None if images is None else images[sl])
            n = min(B, s + self.cfg.batch_size) - s
            if tuple(out.shape) != (n, len(heads)):
                raise ValueError(f"{self.cfg.name} returned scores of shape {list(out.shape)}, "
                                 f"expected [{n}, {len(heads)}]")
            parts.append(out.detach().float().cpu())
        values = torch.cat(parts)                                           # [B, H]
        # 3. A row with any non-finite head is invalid as a whole.
        bad = ~torch.isfinite(values).all(dim=1)                            # [B]
        values[bad] = float("nan")
        if bad.any():
            self._invalid += int(bad.sum())
            log.warning("%s: %d of %d rows had non-finite scores", self.cfg.name, int(bad.sum()), B)
        return Scores(heads, values)


def create_reward_actor(cfg: RewardModelConfig, pool: PoolConfig, factory: ModelFactory | None = None):
    """One RewardActor on the `reward` pool, with the pool's CPUs, GPUs and restart budget."""
    import ray

    return ray.remote(RewardActor).options(
        resources={"reward": 1}, num_cpus=pool.num_cpus, num_gpus=pool.num_gpus,
        max_restarts=pool.max_restarts,
    ).remote(cfg, pool.torch_threads, factory)


def actor_names(cfgs: list[RewardModelConfig]) -> list[str]:
    """One name per reward model: its name, numbered when a model appears twice."""
    names = [c.name for c in cfgs]
    return [n if names.count(n) == 1 else f"{n}{names[:i].count(n)}" for i, n in enumerate(names)]


def create_reward_actors(cfgs: list[RewardModelConfig], pool: PoolConfig) -> dict[str, object]:
    return {n: create_reward_actor(c, pool) for n, c in zip(actor_names(cfgs), cfgs, strict=True)}


class RewardClient:
    """The caller's side: fans a batch out to every reward model and merges their heads.

    A head name that two models share is reported as `model/head`; `weights` maps the merged
    names to each model's configured head weights for `Scores.composite`.
    """

    def __init__(self, actors_by_model: dict[str, object], cfgs: dict[str, RewardModelConfig],
                 startup_timeout_s: float = 900.0):
        import ray

        if set(actors_by_model) != set(cfgs):
            raise ValueError(f"actors {sorted(actors_by_model)} and configs {sorted(cfgs)} name different models")
        self.actors, self.cfgs = dict(actors_by_model), dict(cfgs)
        # The first call waits for the actors to load their models (minutes for a 7B VLM).
        raw = dict(zip(self.actors, ray.get([a.heads.remote() for a in self.actors.values()],
                                           timeout=startup_timeout_s), strict=True))
        every = [h for hs in raw.values() for h in hs]
        self.head_names = {m: [h if every.count(h) == 1 else f"{m}/{h}" for h in hs] for m, hs in raw.items()}
        self.weights = {merged: self.cfgs[m].weights.get(h, 1.0)
                        for m, hs in raw.items() for h, merged in zip(hs, self.head_names[m], strict=True)}
        self.timeouts = dict.fromkeys(self.actors, 0)
        self.failures = dict.fromkeys(self.actors, 0)

    def score(self, frames: Tensor, prompts: list[str], images: Tensor | None = None) -> Scores:
        """Scores of every model side by side, [B, Σ heads]; raises RewardTimeout / RewardFailed."""
        import ray

        frames_ref = ray.put(frames)                 # one copy shared by every model and retry
        images_ref = None if images is None else ray.put(images)

        def submit(m: str, attempt: int):
            ref = self.actors[m].score.remote(frames_ref, list(prompts), images_ref)
            return ref, time.monotonic() + self.cfgs[m].timeout_s, attempt

        pending = {m: submit(m, 0) for m in self.actors}
        results: dict[str, Scores] = {}
        while pending:
            nearest = min(d for _, d, _ in pending.values())
            by_ref = {ref: m for m, (ref, _, _) in pending.items()}
            ready, _ = ray.wait(list(by_ref), num_returns=1, timeout=max(0.0, nearest - time.monotonic()))
            for ref in ready:
                m = by_ref[ref]
                try:
                    results[m] = ray.get(ref)
                    del pending[m]
                except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as e:
                    self.failures[m] += 1
                    cause = getattr(e, "cause", None) or e          # the scorer's own exception
                    pending[m] = self._retry(m, pending[m][2], submit, RewardFailed(
                        f"reward model {m!r} failed on all {pending[m][2] + 1} tries: "
                        f"{type(cause).__name__}: {cause}"))
            now = time.monotonic()
            for m, (ref, deadline, attempt) in list(pending.items()):
                if m not in results and deadline <= now and ref not in ready:
                    self.timeouts[m] += 1
                    ray.cancel(ref)                  # best effort: a running call may not stop
                    pending[m] = self._retry(m, attempt, submit, RewardTimeout(
                        f"reward model {m!r} gave no answer within {self.cfgs[m].timeout_s}s "
                        f"on all {attempt + 1} tries (rewards.models[].timeout_s, retries)"))
        return Scores.merge([Scores(self.head_names[m], results[m].values) for m in self.actors])

    def _retry(self, m: str, attempt: int, submit, error: Exception):
        if attempt >= self.cfgs[m].retries:
            raise error
        log.warning("reward model %s: try %d failed (%s); retrying", m, attempt + 1, type(error).__name__)
        return submit(m, attempt + 1)

    def composite(self, scores: Scores) -> Tensor:
        """R = Σ_h w_h·S_h with each model's head weights. [B]"""
        return scores.composite(self.weights)

    def invalid_counts(self) -> dict[str, int]:
        import ray

        return dict(zip(self.actors, ray.get([a.invalid_count.remote() for a in self.actors.values()]),
                        strict=True))
