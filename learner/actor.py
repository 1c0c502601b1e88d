"""The learner role on Ray: N `LearnerRank` actors in one torch.distributed group, each with a
Trainer over an FSDP2-sharded model, driven through one `LearnerGroup` handle.

With one rank there is no process group and no sharding: that is the single-process
reference path (the same Trainer), which the distributed path is tested against.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
import torch
import torch.distributed as dist
from torch import Tensor

from common.actor_metrics import exports_publish, exports_train_step, exports_weights_payload
from common.actors import kill_and_wait
from common.config import RunConfig
from common.types import TrainBatch, TrainStats
from learner import dist_checkpoint, fsdp
from learner.trainer import Trainer
from learner.weight_sync import PublishReport, WeightPublisher
from rollout_worker.models import VideoModel

log = logging.getLogger(__name__)

ModelFactory = Callable[[], VideoModel]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _shard_trainer(trainer: Trainer, mesh) -> None:
    """Shard the policy's module in place; the Trainer re-points its Policy and optimizer (Trainer.shard)."""
    trainer.shard(mesh)


class LearnerRank:
    """One data-parallel rank: a Trainer over this rank's shard of the model."""

    def __init__(self, cfg: dict, rank: int, world_size: int, model_factory: ModelFactory | None = None):
        self.cfg = RunConfig.model_validate(cfg)
        torch.set_num_threads(self.cfg.pools.learner.torch_threads)
        self.rank, self.world_size = rank, world_size
        self.model_factory = model_factory
        use_gpu = self.cfg.pools.learner.num_gpus > 0 and torch.cuda.is_available()
        self.device = torch.device("cuda", 0) if use_gpu else torch.device("cpu")  # Ray sets CUDA_VISIBLE_DEVICES
        self.trainer: Trainer | None = None
        self.publisher: WeightPublisher | None = None

    def address(self) -> tuple[str, int]:
        """Rank 0's rendezvous address: this node's IP and a free port."""
        return ray.util.get_node_ip_address(), _free_port()

    def setup(self, master_addr: str, master_port: int) -> int:
        cfg = self.cfg
        # 1. the process group and its mesh (none for a single rank: the reference path)
        mesh = None
        if self.world_size > 1:
            mesh = fsdp.init_distributed(self.rank, self.world_size, master_addr, master_port,
                                         self.device, cfg.weight_sync.timeout_s)
        # 2. the model and the Trainer (LoRA injection happens in Trainer.setup)
        if self.model_factory is not None:
            model = self.model_factory()
        else:
            from rollout_worker.models import build_model

            model = build_model(cfg, self.device)
        self.trainer = Trainer(cfg, model, device=self.device).setup()
        # 3. shard per transformer block
        if mesh is not None:
            _shard_trainer(self.trainer, mesh)
        return self.trainer.version

    # --- verbs -------------------------------------------------------------------------

    @exports_train_step
    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        reduce = self._sum if self.world_size > 1 else None
        stats = self.trainer.train_step(batch, rank=self.rank, world_size=self.world_size, reduce=reduce)
        return stats.values

    def _sum(self, t: Tensor) -> Tensor:
        out = t.to(self.device).clone()
        dist.all_reduce(out)
        return out.cpu()

    @exports_weights_payload
    def weights_payload(self) -> dict[str, Tensor] | None:
        """Full tensors on rank 0 (adapter only with LoRA), None elsewhere. Collective."""
        if self.world_size == 1:
            return self.trainer.weights_payload()
        names = self.trainer.weights_payload().keys()  # local view: only the names are used
        full = fsdp.full_state_dict(self.trainer.policy.module, names)
        return full if self.rank == 0 else None

    @exports_publish
    def publish(self, actors: list | None, names: list[str] | None = None) -> PublishReport | None:
        """Gather the payload (all ranks) and push it from rank 0 to `actors`."""
        payload = self.weights_payload()
        if self.rank != 0:
            return None
        if self.publisher is None or self.publisher.actors != list(actors):
            if self.publisher is not None:
                self.publisher.close()
            self.publisher = WeightPublisher(self.cfg.weight_sync, actors, names, self.device)
        return self.publisher.publish(payload, self.trainer.version)

    def save_checkpoint(self, dir: str, extra: dict | None = None) -> str:
        if self.world_size == 1:
            return str(self.trainer.save_checkpoint(dir, extra))
        return str(dist_checkpoint.save(dir, self.trainer.version, self.trainer.state_dict(),
                                        dict(extra or {}), self.cfg.train.keep_checkpoints))

    def load_checkpoint(self, dir: str) -> dict:
        if self.world_size == 1:
            return self.trainer.load_checkpoint(dir)
        state, extra, _ = dist_checkpoint.load(dir, self.trainer.state_dict())
        self.trainer.load_state_dict(state)
        return extra

    def version(self) -> int:
        return self.trainer.version

    def close(self) -> bool:
        """Barrier, then leave the group to process exit (see learner/fsdp.py on SIGABRT)."""
        if self.publisher is not None:
            self.publisher.close()
        return fsdp.shutdown_process_group("barrier_only")


class LearnerGroup:
    """Driver-side handle: starts the ranks, forms their group, and fans each verb out."""

    def __init__(self, cfg: RunConfig, model_factory: ModelFactory | None = None,
                 num_ranks: int | None = None, setup_timeout_s: float = 600.0):
        pool = cfg.pools.learner
        n = num_ranks if num_ranks is not None else pool.num_actors
        if n < 1:
            raise ValueError(f"pools.learner.num_actors = {n}: the learner needs at least one rank")
        self.cfg, self.world_size = cfg, n
        # A rank cannot rejoin a live process group, so Ray never restarts one on its own;
        # the driver restarts the whole group from its last checkpoint instead.
        remote = ray.remote(LearnerRank).options(
            num_cpus=pool.num_cpus, num_gpus=pool.num_gpus, resources={"learner": 1},
            max_restarts=0, max_task_retries=0)
        cfg_data = cfg.model_dump(mode="python")
        self.ranks = [remote.remote(cfg_data, r, n, model_factory) for r in range(n)]
        addr, port = ray.get(self.ranks[0].address.remote(), timeout=setup_timeout_s)
        try:
            self._version = ray.get([r.setup.remote(addr, port) for r in self.ranks],
                                    timeout=setup_timeout_s)[0]
        except BaseException:
            self._kill()
            raise

    def _all(self, method: str, *args: Any) -> list[Any]:
        return ray.get([getattr(r, method).remote(*args) for r in self.ranks])

    def train_step(self, batch: TrainBatch) -> TrainStats:
        """One optimizer step; every rank gets the batch and trains on its share of the rows."""
        ref = ray.put(batch)  # one copy in the object store, read by every rank
        stats = self._all("train_step", ref)[0]  # batch-wide: the ranks all-reduce them
        self._version = int(stats["version"])
        return TrainStats(stats)

    def weights_payload(self) -> dict[str, Tensor]:
        return self._all("weights_payload")[0]

    def weights_payload_ref(self) -> ray.ObjectRef:
        """Rank 0's payload as an object ref: rollout actors read it without a copy through the driver."""
        refs = [r.weights_payload.remote() for r in self.ranks]  # every rank joins the gather
        return refs[0]

    def publish(self, actors: list, names: list[str] | None = None) -> PublishReport:
        """Push the current version to rollout actors (cfg.weight_sync.transport) from rank 0."""
        return self._all("publish", list(actors), names)[0]

    def save_checkpoint(self, dir: str | Path, extra: dict | None = None) -> Path:
        return Path(self._all("save_checkpoint", str(dir), extra)[0])

    def load_checkpoint(self, dir: str | Path) -> dict:
        extra = self._all("load_checkpoint", str(dir))[0]
        self._version = self._all("version")[0]
        return extra

    def version(self) -> int:
        return self._version

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Barrier on every rank, then end the rank processes without destroying the group."""
        try:
            ray.get([r.close.remote() for r in self.ranks], timeout=timeout_s)
        except Exception as e:
            log.warning("learner shutdown: ranks did not all reach the barrier (%s)", e)
        self._kill()

    def _kill(self) -> None:
        kill_and_wait(self.ranks)
        self.ranks = []
