"""The reward role: a pool of Ray actors per reward model, and the caller's client that fans out to them.

`RewardActor.score` batches up to `batch_size` videos per model call and turns a row with any
non-finite head into an all-NaN row, counted in `invalid_count()`: such a member never reaches
the loss. `RewardClient.score` asks every model at once (the least busy replica of each),
waits with a per-call timeout, retries a bounded number of times on another replica, and
raises RewardTimeout / RewardFailed so the group is drawn again. Rollout actors hold their
own client: frames go from the rollout actor to the reward actors, never through the driver.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from common.actor_metrics import exports_score
from common.config import PoolConfig, RewardModelConfig
from common.images import resolve_images
from common.rewards import RewardHeads, actor_names
from common.types import Scores
from reward_worker.base import RewardModel
from reward_worker.registry import build_reward_model

log = logging.getLogger(__name__)

ModelFactory = Callable[[RewardModelConfig], RewardModel]


class RewardTimeout(TimeoutError):
    """A reward model did not answer within its timeout, on every try."""


class RewardFailed(RuntimeError):
    """A reward model raised (or its actor died) on every try. `restarting`: the last try met a
    replica Ray is restarting (it comes back by itself: not a fault of the group's)."""

    def __init__(self, message: str, restarting: bool = False):
        super().__init__(message)
        self.restarting = restarting


class RewardActor:
    """Holds one reward model. Create with `create_reward_actor` (it asks for the `reward` resource)."""

    def __init__(self, cfg: RewardModelConfig, torch_threads: int = 1, factory: ModelFactory | None = None):
        torch.set_num_threads(torch_threads)
        if factory is None:
            factory = build_reward_model
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
        """frames uint8 [B, F, H, W, 3], prompts [B], images uint8 [B, H, W, 3] or None → Scores [B, H].

        frames may come as a numpy array (what RewardClient puts): a view of the object store."""
        frames, images = _tensor(frames), None if images is None else _tensor(images)
        # 1. Check the request.
        if frames.dtype != torch.uint8 or frames.ndim != 5 or frames.shape[-1] != 3:
            raise ValueError(f"frames must be uint8 [B, F, H, W, 3], got {frames.dtype} {list(frames.shape)}")
        B = frames.shape[0]

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


def _tensor(x) -> Tensor:
    """A torch view of a numpy array from the object store (read-only: scorers only read frames)."""
    if isinstance(x, np.ndarray):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "non-writable array"
            return torch.from_numpy(x)
    return x


def create_reward_actor(cfg: RewardModelConfig, pool: PoolConfig, factory: ModelFactory | None = None,
                        options: dict | None = None):
    """One RewardActor on the `reward` pool: the Ray `options` the caller placed it with (the
    driver's placement group bundle), else the pool's CPUs, GPUs and restart budget."""
    import ray  # heavy: ray

    options = options or {"resources": {"reward": 1}, "num_cpus": pool.num_cpus, "num_gpus": pool.num_gpus,
                          "max_restarts": pool.max_restarts}
    return ray.remote(RewardActor).options(**options).remote(cfg, pool.torch_threads, factory)


def create_reward_actors(cfgs: list[RewardModelConfig], pool: PoolConfig, factory: ModelFactory | None = None,
                         options: Callable[[int], dict] | None = None) -> dict[str, list]:
    """`pools.reward.num_actors` actors (at least one) per reward model, by model name;
    `options(k)` places the k-th actor (model-major), else each gets the pool's defaults."""
    n = max(1, pool.num_actors)
    return {name: [create_reward_actor(c, pool, factory, options(m * n + j) if options else None)
                   for j in range(n)]
            for m, (name, c) in enumerate(zip(actor_names(cfgs), cfgs, strict=True))}


class RewardClient:
    """The caller's side: fans a batch out to every reward model and merges their heads.

    Each model has a pool of one or more identical actors. A call goes to the replica with the
    fewest calls in flight from this client, starting at `offset` (each rollout actor starts
    at its own index, so N callers spread over M replicas); a try that times out or fails is
    retried on the next replica, so one slow or dead actor does not stall the model.

    `heads` (common/rewards.RewardHeads) are the heads the actors report, model by model, with
    their configured weights; two models reporting the same head name are refused at start.
    """

    def __init__(self, actors_by_model: dict[str, object | list], cfgs: dict[str, RewardModelConfig],
                 startup_timeout_s: float = 900.0, offset: int = 0):
        import ray  # heavy: ray

        if set(actors_by_model) != set(cfgs):
            raise ValueError(f"actors {sorted(actors_by_model)} and configs {sorted(cfgs)} name different models")
        self.pool = {m: list(a) if isinstance(a, list | tuple) else [a] for m, a in actors_by_model.items()}
        if any(not a for a in self.pool.values()):
            raise ValueError("every reward model needs at least one actor (pools.reward.num_actors)")
        self.cfgs = dict(cfgs)
        # every replica, flat (teardown, fault injection): model name, then model#i for replicas
        self.actors = {(m if i == 0 else f"{m}#{i}"): a for m, acts in self.pool.items() for i, a in enumerate(acts)}
        self._next = {m: offset % len(acts) for m, acts in self.pool.items()}
        self._busy = {m: [0] * len(acts) for m, acts in self.pool.items()}
        # The first call waits for the actors to load their models (minutes for a 7B VLM).
        firsts = {m: acts[0] for m, acts in self.pool.items()}
        raw = dict(zip(firsts, ray.get([a.heads.remote() for a in firsts.values()],
                                       timeout=startup_timeout_s), strict=True))
        self.heads = RewardHeads.build([self.cfgs[m] for m in self.pool], [raw[m] for m in self.pool],
                                       list(self.pool))
        self.timeouts = dict.fromkeys(self.pool, 0)
        self.failures = dict.fromkeys(self.pool, 0)

    def _pick(self, m: str, avoid: int | None) -> int:
        """The replica with the fewest calls in flight, round-robin among equals, not `avoid`."""
        n = len(self.pool[m])
        start = self._next[m]
        order = [(start + k) % n for k in range(n)]
        if avoid is not None and n > 1:
            order.remove(avoid)
        i = min(order, key=lambda j: self._busy[m][j])
        self._next[m] = (i + 1) % n
        return i

    def score(self, frames: Tensor, prompts: list[str], images: Tensor | None = None) -> Scores:
        """Scores of every model side by side, [B, Σ heads]; raises RewardTimeout / RewardFailed."""
        import ray  # heavy: ray

        # one copy shared by every model and retry; numpy, so readers map it instead of unpickling
        frames_ref = ray.put(frames.contiguous().numpy())
        images_ref = None if images is None else ray.put(  # I2V first frames: a tensor, or paths
            images.contiguous().numpy() if isinstance(images, Tensor) else images)

        def submit(m: str, attempt: int, avoid: int | None = None):
            i = self._pick(m, avoid)
            self._busy[m][i] += 1
            ref = self.pool[m][i].score.remote(frames_ref, list(prompts), images_ref)
            return ref, time.monotonic() + self.cfgs[m].timeout_s, attempt, i

        pending = {m: submit(m, 0) for m in self.pool}
        results: dict[str, Scores] = {}
        try:
            while pending:
                nearest = min(d for _, d, _, _ in pending.values())
                by_ref = {ref: m for m, (ref, _, _, _) in pending.items()}
                ready, _ = ray.wait(list(by_ref), num_returns=1, timeout=max(0.0, nearest - time.monotonic()))
                for ref in ready:
                    m = by_ref[ref]
                    _, _, attempt, i = pending[m]
                    self._busy[m][i] -= 1
                    try:
                        results[m] = ray.get(ref)
                        del pending[m]
                    except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as e:
                        self.failures[m] += 1
                        cause = getattr(e, "cause", None) or e          # the scorer's own exception
                        pending[m] = self._retry(m, attempt, i, submit, RewardFailed(
                            f"reward model {m!r} failed on all {attempt + 1} tries: "
                            f"{type(cause).__name__}: {cause}",
                            restarting=isinstance(e, ray.exceptions.ActorUnavailableError)))
                now = time.monotonic()
                for m, (ref, deadline, attempt, i) in list(pending.items()):
                    if m not in results and deadline <= now and ref not in ready:
                        self.timeouts[m] += 1
                        self._busy[m][i] -= 1
                        ray.cancel(ref)                  # best effort: a running call may not stop
                        pending[m] = self._retry(m, attempt, i, submit, RewardTimeout(
                            f"reward model {m!r} gave no answer within {self.cfgs[m].timeout_s}s "
                            f"on all {attempt + 1} tries (rewards.models[].timeout_s, retries)"))
        finally:
            for m, (_, _, _, i) in pending.items():   # given up: no longer counted as in flight
                self._busy[m][i] = max(0, self._busy[m][i] - 1)
        return Scores.merge([results[m] for m in self.pool])

    def _retry(self, m: str, attempt: int, failed: int, submit, error: Exception):
        if attempt >= self.cfgs[m].retries:
            raise error
        log.warning("reward model %s: try %d failed on replica %d (%s); retrying on another",
                    m, attempt + 1, failed, type(error).__name__)
        return submit(m, attempt + 1, failed)

    def invalid_counts(self) -> dict[str, int]:
        import ray  # heavy: ray

        refs = {m: [a.invalid_count.remote() for a in acts] for m, acts in self.pool.items()}
        out = {m: sum(ray.get(rs)) for m, rs in refs.items()}
        return out
