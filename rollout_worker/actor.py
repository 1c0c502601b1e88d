"""The rollout actor: one model on one pool slot; verbs `generate`, `set_weights`, `version`, `ping`.

`RolloutWorker` is the plain class (usable without Ray, and the place to add methods such
as a collective-transport receive); `RolloutActor = ray.remote(RolloutWorker)` is what the
driver creates, with `create_rollout_actors(cfg)` placing it on the `rollout` pool.

Restarts. Ray re-runs the constructor of a restarted actor with the same arguments, so the
constructor loads weights before the actor can generate:
- `weights_ref`: a published record (or an ObjectRef to one) loaded first;
- `latest_weights`: where the newest published record lives, asked next — the name of a
  named Ray actor, or its handle, whose `latest()` method returns a record or None; or any
  zero-argument callable returning one.
A published record is a plain dict {"version": int, "weights": {name: Tensor}, "checksum": str | None}.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import ray
import torch
from torch import Tensor

from common.actor_metrics import exports_generate, exports_weight_load
from common.config import RunConfig, validate
from common.sde import Schedule
from common.types import Condition, Group
from common.weights import verify
from rollout_worker.models import build_model
from rollout_worker.models.lora import inject_lora
from rollout_worker.sampler import sample_group, sample_videos
from rollout_worker.weight_receiver import WeightReceiver

log = logging.getLogger(__name__)

LatestWeights = str | Callable[[], dict | None] | Any  # actor name, callable, or actor handle


def published(weights: dict[str, Tensor], version: int, checksum: str | None = None) -> dict:
    """The record a publisher hands to rollout actors (see the module docstring)."""
    return {"version": int(version), "weights": weights, "checksum": checksum}


class RolloutWorker:
    """Holds one model and generates groups with it, stamped with the weights' policy version."""

    def __init__(self, cfg: RunConfig | dict, actor_index: int = 0, weights_ref: Any = None,
                 latest_weights: LatestWeights | None = None):
        self.cfg = cfg if isinstance(cfg, RunConfig) else validate(cfg, source="rollout actor config")
        torch.set_num_threads(self.cfg.pools.rollout.torch_threads)
        self.actor_index = actor_index
        self.model = build_model(self.cfg)
        if self.cfg.optim.finetune == "lora":
            # the learner publishes only the adapter: hold the same (zero-effect) adapter to load it
            inject_lora(self.model.trainable_module(), self.cfg.model.family, self.cfg.optim)
        self._version = 0
        for record in (_resolve(weights_ref), _fetch_latest(latest_weights)):
            if record is not None:
                self.set_weights(record["weights"], record["version"], record.get("checksum"))

    @exports_generate
    def generate(self, condition: Condition, seed: int, group_id: str | None = None) -> Group:
        return sample_group(self.model, condition, self.cfg, seed=seed, policy_version=self._version,
                            group_id=group_id)

    @exports_weight_load
    def set_weights(self, payload: dict[str, Tensor], version: int, checksum: str | None = None) -> bool:
        """Load a payload if its version is newer than ours; a stale push is ignored (returns False)."""
        if version <= self._version:
            log.info("rollout %d: ignoring weights v%d (holding v%d)", self.actor_index, version, self._version)
            return False
        verify(payload, checksum, who=f"rollout actor {self.actor_index} weights v{version}")
        self.model.load_weights(payload)
        self._version = int(version)
        return True

    def version(self) -> int:
        return self._version

    def sample_videos(self, prompts: list[str], seeds: list[int], scheme: str = "ode",
                      images: list[str] | Tensor | None = None) -> Tensor:
        """Evaluation videos with the current weights, one per (prompt, seed) (I2V: `images`, a
        first-frame path per video, read here). uint8 [B, F, H, W, 3]"""
        from common.images import resolve_images

        m = self.cfg.model
        return sample_videos(self.model, prompts, seeds, Schedule.from_config(self.cfg.schedule), scheme,
                             images=resolve_images(images, len(prompts), m.height, m.width))

    # --- the collective weight transport (learner/weight_sync.py is the sending side) ---

    def join_weight_group(self, host: str, port: int, prefix: str, rank: int, world_size: int,
                          backend: str, timeout_s: float) -> int:
        """Join the publisher's weight group as `rank`; returns once the group is built."""
        if getattr(self, "_receiver", None) is None:
            self._receiver = WeightReceiver()
        self._receiver.join(host, port, prefix, rank, world_size, backend, timeout_s)
        return rank

    def receive_weights(self, version: int, manifest: dict) -> bool:
        """Take part in the broadcast of `version`, then load it like set_weights (stale: ignored)."""
        receiver = getattr(self, "_receiver", None)
        if receiver is None:
            raise RuntimeError(f"rollout actor {self.actor_index}: receive_weights before join_weight_group")
        m, state = receiver.receive(manifest, self.model.device)  # checksum verified there
        if m.version != version:
            raise ValueError(f"rollout actor {self.actor_index}: manifest says v{m.version}, call says v{version}")
        return self.set_weights(state, m.version)

    def ping(self) -> dict:
        return {"actor_index": self.actor_index, "version": self._version, "family": self.model.family}


RolloutActor = ray.remote(RolloutWorker)


def create_rollout_actors(cfg: RunConfig, *, count: int | None = None, weights_ref: Any = None,
                          latest_weights: LatestWeights | None = None) -> list:
    """`count` (default pools.rollout.num_actors) actors on the `rollout` resource, sized by the pool."""
    pool = cfg.pools.rollout
    n = pool.num_actors if count is None else count
    return [RolloutActor.options(resources={"rollout": 1}, num_cpus=pool.num_cpus, num_gpus=pool.num_gpus,
                                 max_restarts=pool.max_restarts)
            .remote(cfg, i, weights_ref, latest_weights) for i in range(n)]


def _resolve(ref: Any) -> dict | None:
    return ray.get(ref) if isinstance(ref, ray.ObjectRef) else ref


def _fetch_latest(source: LatestWeights | None) -> dict | None:
    if source is None:
        return None
    if isinstance(source, str):
        source = ray.get_actor(source)
    if isinstance(source, ray.actor.ActorHandle):
        return _resolve(ray.get(source.latest.remote()))
    if callable(source):
        return _resolve(source())
    raise TypeError(f"latest_weights must be an actor name, an actor handle or a callable, got {type(source)}")
