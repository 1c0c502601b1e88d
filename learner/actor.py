"""The learner role on Ray: N `LearnerRank` actors in one torch.distributed group, each with a
Trainer over an FSDP2-sharded model, driven through one `LearnerGroup` handle.

Sequence parallelism (`pools.learner.parallel.sp` > 1): each of the num_actors data-parallel
ranks is sp processes on a (dp, sp) mesh (learner/fsdp.py). The sp processes of a data-parallel
rank train the same rows together (each transformer forward split over their video tokens,
rollout_worker/models/sp.py); FSDP2 shards the weights over all processes.

Data plane. Rank 0 holds its own bank connection (a `BankRef`): it pulls the step's batch,
shares it with the other ranks through the object store (one `ray.put`; the driver passes
the ref on without reading it), and commits it after the step. The driver sends only counts
and versions and gets a `PullReceipt` and the step's scalars back.

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

from common import storage
from common.actor_metrics import (
    exports_publish,
    exports_train_step,
    exports_weights_payload,
    exports_weights_record,
)
from common.actors import kill_and_wait
from common.config import ConfigError, RunConfig
from common.dispatch import verb
from common.experts import rows_on_frozen_expert
from common.families import FAMILIES
from common.sde import rollout_spec
from common.types import PullReceipt, TrainBatch, TrainStats
from common.weights_record import WeightsRecord
from learner import checkpoint, dist_checkpoint, fsdp
from learner.admit import Admission, admit
from learner.advantages import group_spread
from learner.policy_writer import expert_configs
from learner.shard_load import lean_sharder
from learner.trainer import Trainer
from learner.weight_sync import PublishReport, WeightPublisher, put_stream, stream_tensors
from rollout_worker.models import VideoModel, build_model
from rollout_worker.models.base import DTYPES

log = logging.getLogger(__name__)

ModelFactory = Callable[[], VideoModel]
SETUP_MARGIN_S = 120.0  # starting the rank processes and forming the group, beyond the load barrier


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def learner_components(cfg: RunConfig) -> str:
    """What the learner builds of the model: the transformer(s) only, since every loss
    (policy, KL, alignment) is computed in latent space from the trajectories and their encoded
    conditions. A loss that needs an encoder or the VAE would return "all" here."""
    return "transformer"


def lean_setup(cfg: RunConfig, mesh, model_factory: ModelFactory | None = None) -> bool:
    """Whether the ranks build the trained module on meta, shard it and read their own rows from
    the checkpoint's safetensors (learner/shard_load.py: no rank holds the whole model): a sharded
    group of a diffusers family. One rank, and test models given as a factory, take the reference
    path (the whole module loaded, fp32 masters copied, broadcast, then sharded)."""
    return mesh is not None and model_factory is None and FAMILIES[cfg.model.family].lean_sharded


def make_trainer(cfg: RunConfig, device: torch.device, mesh=None, model_factory: ModelFactory | None = None,
                 lean: bool | None = None, sp_mesh=None) -> Trainer:
    """This rank's Trainer, sharded over `mesh` when given (lean: see `lean_setup`, its default);
    with `sp_mesh` (parallel.sp > 1) its transformers split their video tokens over that SP group,
    after LoRA injection and before sharding."""
    lean = lean_setup(cfg, mesh, model_factory) if lean is None else lean
    if model_factory is not None:
        model = model_factory()
    else:  # the transformer(s) alone: the batch carries the conditions the rollout encoded
        model = build_model(cfg, device, components=learner_components(cfg), empty=lean)
    boundary = getattr(model, "boundary_timestep", None)   # the checkpoint's, when the config has none
    msg = rows_on_frozen_expert(cfg, None if boundary is None else boundary / 1000.0)
    if msg is not None:
        raise ConfigError(f"{cfg.model.path}: {msg}")
    if lean:
        sharder = lean_sharder(cfg.model.path, mesh, device, DTYPES[cfg.model.dtype], cfg.learner.cpu_offload)
        if sp_mesh is not None:
            sharder = _split_first(model, sp_mesh, sharder)
        trainer = Trainer(cfg, model, device=device).setup(sharder)
        # every rank read its shard: the first collective must not wait on the slowest reader
        fsdp.barrier(cfg.learner.load_timeout_s, "learner.load_timeout_s", "read its shard of the model")
        return trainer
    trainer = Trainer(cfg, model, device=device).setup()
    if mesh is not None:
        # wait for the slowest rank's read, then shard per transformer block (its broadcast is
        # the group's first collective)
        fsdp.barrier(cfg.learner.load_timeout_s, "learner.load_timeout_s", "loaded its model")
        if sp_mesh is not None:
            model.enable_sp(sp_mesh)
        trainer.shard(mesh)
    return trainer


def _split_first(model, sp_mesh, sharder):
    """The lean sharder, after splitting the video tokens over the SP group (the Policy calls it
    once LoRA is injected, so wrapped layers keep their hooks)."""

    def shard(module, trained):
        model.enable_sp(sp_mesh)
        return sharder(module, trained)

    return shard


class LearnerRank:
    """One data-parallel rank: a Trainer over this rank's shard of the model."""

    def __init__(self, cfg: dict, rank: int, world_size: int, model_factory: ModelFactory | None = None,
                 bank: Any = None, sp: int = 1):
        self.cfg = RunConfig.model_validate(cfg)
        self._bank_ref, self._bank = bank, None
        self._batch: TrainBatch | None = None   # rank 0: pulled, not yet committed
        self._admission = None                  # rank 0: what a pulled entry must fit (learner/admit.py)
        torch.set_num_threads(self.cfg.pools.learner.torch_threads)
        self.rank, self.world_size, self.sp = rank, world_size, sp
        self.mesh: fsdp.LearnerMesh | None = None
        self.model_factory = model_factory
        pools = self.cfg.pools  # simulated GPUs: Ray's share only, the rank computes on the CPU
        use_gpu = pools.learner.num_gpus > 0 and not pools.simulated_gpus and torch.cuda.is_available()
        self.device = torch.device("cuda", 0) if use_gpu else torch.device("cpu")  # Ray sets CUDA_VISIBLE_DEVICES
        self.trainer: Trainer | None = None
        self.publisher: WeightPublisher | None = None
        self._generation = 0  # of the weight group `publisher` formed (see publish)

    def address(self) -> tuple[str, int]:
        """Rank 0's rendezvous address: this node's IP and a free port."""
        return ray.util.get_node_ip_address(), _free_port()

    def setup(self, master_addr: str, master_port: int) -> int:
        cfg = self.cfg
        # 1. the process group and its mesh (none for a single rank: the reference path)
        if self.world_size > 1:
            self.mesh = fsdp.init_distributed(self.rank, self.world_size, master_addr, master_port,
                                              self.device, cfg.learner.collective_timeout_s, self.sp)
        # 2. the model, the Trainer (LoRA injection happens in Trainer.setup) and its sharding over
        #    every process, the video tokens split over the SP group first (after LoRA injection)
        m = self.mesh
        self.trainer = make_trainer(cfg, self.device, None if m is None else m.fsdp, self.model_factory,
                                    sp_mesh=None if m is None else m.sp)
        return self.trainer.version

    # --- verbs -------------------------------------------------------------------------

    @exports_train_step
    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        if self.mesh is None:
            return self.trainer.train_step(batch).values
        m = self.mesh
        stats = self.trainer.train_step(batch, rank=m.dp_rank, world_size=m.dp_size, reduce=self._sum, sp=self.sp)
        return stats.values

    # --- the data plane (rank 0 talks to the bank) ----------------------------------------

    def _open_bank(self):
        if self._bank is None:
            if self._bank_ref is None:
                raise RuntimeError("learner rank 0 was created without a bank reference")
            self._bank = self._bank_ref.open()
        return self._bank

    def pull(self, n: int, version: int) -> PullReceipt:
        """Rank 0: up to n fresh groups with their bank entries, kept here until commit."""
        bank = self._open_bank()
        bank.requeue_pending()  # a pull whose answer was lost left its groups pending
        bank.dropped_ids = []
        batch = bank.pull(n, version)
        why = {g: "corrupt" for g in bank.dropped_ids}
        dropped, notes = self._admit(bank, batch, version)
        why.update(dropped)
        if why:  # fresh groups were dropped: give the rest back, the driver refills first
            bank.requeue_pending()
            return PullReceipt(dropped=list(why), reasons=why, notes=notes)
        self._batch = batch
        out = PullReceipt(notes=notes, group_ids=[g.group_id for g in batch.fresh],
                          condition_ids=[g.condition.id for g in batch.fresh],
                          versions=[g.policy_version for g in batch.fresh],
                          bank_entries=sum(len(b) for b in batch.bank))
        if batch.fresh:
            out.heads = list(batch.fresh[0].scores.heads)
            out.reward_mean = float(torch.cat([g.composite for g in batch.fresh]).float().mean())
            out.head_means = {h: float(torch.stack([g.scores.values[:, i].mean() for g in batch.fresh]).mean())
                              for i, h in enumerate(out.heads)}

            out.spread = group_spread(batch.fresh)
            if self.world_size > 1:
                out.box = [ray.put(batch)]  # one copy in the object store, read by the other ranks
        return out

    def _admit(self, bank, batch: TrainBatch, version: int) -> tuple[dict[str, str], list[str]]:
        """Take out what does not fit this run (learner/admit.py): untrainable entries to the
        quarantine, banked entries of other settings evicted, their fresh groups dropped.
        Returns ({dropped group id: why}, lines for the driver's log)."""
        if self._admission is None:  # the run's settings and model: fixed for the process's life
            self._admission = Admission(rollout_spec(self.cfg), tuple(self.trainer.model.latent_shape))
        verdict = admit(batch, self._admission, version)
        for eid, why in verdict.quarantine.items():
            bank.quarantine(eid, why)
        for cid, eids in verdict.evict.items():
            bank.evict(cid, eids)
        for gid in verdict.dropped:
            bank.drop_pulled(gid)
        return verdict.dropped, verdict.notes()

    def drop_pulled(self, gids: list[str]) -> int:
        """Rank 0: drop these groups of the pulled batch untrained (their members deleted) and give
        the rest back to the queue; returns how many were dropped."""
        if self._batch is None:
            return 0
        bank, batch, self._batch = self._open_bank(), self._batch, None
        drop = [g.group_id for g in batch.fresh if g.group_id in set(gids)]
        for gid in drop:
            bank.drop_pulled(gid)
        bank.requeue_pending()
        return len(drop)

    def quarantine_pulled(self, reason: str) -> tuple[list[str], int]:
        """Rank 0: the pulled batch could not be trained (`reason`: the step's error). Every entry
        it used goes to the quarantine and its groups are dropped; returns their ids and the
        policy version (unchanged unless the step failed after its optimizer step)."""
        version = self.trainer.version
        if self._batch is None:
            return [], version
        bank, batch, self._batch = self._open_bank(), self._batch, None
        for group, entries in zip(batch.fresh, batch.bank or [[] for _ in batch.fresh], strict=True):
            for t in [*group.members, *(e[0] for e in entries)]:
                if t.bank_id:
                    bank.quarantine(t.bank_id, reason)
            bank.drop_pulled(group.group_id)
        return [g.group_id for g in batch.fresh], version

    def train_pulled(self, box: list | None) -> dict[str, float]:
        """Train on the batch rank 0 pulled (rank 0 reads its own copy; others the object store)."""
        batch = self._batch if self.rank == 0 else ray.get(box[0])
        if batch is None:
            raise RuntimeError("train_pulled before pull")
        return self.train_step(batch)

    def commit(self, step: int) -> int:
        """Rank 0: commit the pulled batch after the optimizer step; returns groups committed."""
        if self._batch is None:
            return 0
        self._open_bank().commit(self._batch, step)
        n, self._batch = len(self._batch.fresh), None
        return n

    def commit_ids(self, gids: list[str], step: int) -> int:
        """Rank 0, on resume: commit groups the saved learner trained but Redis missed."""
        bank = self._open_bank()
        batch = bank.pull(len(gids), step)
        keep = [i for i, g in enumerate(batch.fresh) if g.group_id in set(gids)]
        bank.commit(TrainBatch(fresh=[batch.fresh[i] for i in keep],
                               bank=[batch.bank[i] for i in keep], version=step), step)
        bank.requeue_pending()  # anything else pulled goes back
        return len(keep)

    def _sum(self, t: Tensor) -> Tensor:
        """Sum over the data-parallel ranks (an SP group's ranks hold the same statistics)."""
        out = t.to(self.device).clone()
        dist.all_reduce(out, group=self.mesh.dp_group)
        return out.cpu()

    def _stream(self, version: int):
        """This rank's part of a publish: the payload's tensors (references, no copy) in their
        wire dtypes, gathered one at a time as the stream is walked. Call inside `exported`."""
        policy = self.trainer.policy
        tensors = policy.payload_tensors()
        wire = {k: policy.wire_dtype(k, v) for k, v in tensors.items()}
        return stream_tensors(tensors, wire, self.cfg.weight_sync.bucket_bytes, version)

    @exports_weights_payload
    def weights_payload(self, ema: bool = False) -> dict[str, Tensor] | None:
        """Full tensors in the wire dtype on rank 0 (adapter only with LoRA), None elsewhere.
        Collective. ema: the weights' moving average (the exported policy) when the run keeps one."""
        if self.world_size == 1:
            return self.trainer.weights_payload(ema)
        with self.trainer.exported(ema):
            stream = self._stream(0)
            if self.rank != 0:
                stream.drain()
                return None
            return {e.name: t.cpu() for e, t in zip(stream.manifest.entries, stream.tensors, strict=True)}

    @exports_weights_record
    def weights_record(self, version: int, checksum: str | bool | None = None,
                       ema: bool = False) -> WeightsRecord | None:
        """Rank 0: the payload put into the object store bucket by bucket (learner.weight_sync.
        put_stream), as a WeightsRecord of the refs; None elsewhere. Collective.
        checksum: weight_sync.checksum's mode (None: this run's)."""
        mode = self.cfg.weight_sync.checksum if checksum is None else checksum
        with self.trainer.exported(ema):
            stream = self._stream(version)
            if self.rank != 0:
                stream.drain()
                return None
            try:
                return put_stream(stream, mode)
            finally:
                stream.drain()

    def save_policy(self, path: str) -> None:
        """Write the exported policy (the live weights, or their moving average when the run keeps
        one) under `path` in diffusers' sharded layout: every rank gathers one tensor at a time
        and writes those of its own shard files (learner/policy_writer.py); rank 0 adds the
        configs and the index. Collective."""
        t = self.trainer
        policy = t.policy
        with t.exported(ema=True):
            tensors = policy.payload_tensors()
            wire = {k: policy.wire_dtype(k, v) for k, v in tensors.items()}
            configs = {} if self.cfg.optim.finetune == "lora" else \
                expert_configs(policy.module, FAMILIES[self.cfg.model.family].transformer)
            checkpoint.write_policy(path, tensors, ema=t.exports_ema, version=t.version,
                                    decay=self.cfg.optim.ema_decay, wire=wire, configs=configs,
                                    rank=self.rank, world=self.world_size, wait=self._wait_for_writers)

    def _wait_for_writers(self) -> None:
        fsdp.barrier(self.cfg.learner.checkpoint_timeout_s, "learner.checkpoint_timeout_s",
                     "wrote its policy shards")

    @exports_publish
    def publish(self, actors: list | None, names: list[str] | None = None,
                ema: bool = False, generation: int = 0) -> PublishReport | None:
        """Stream the payload (all ranks gather) from rank 0 to `actors` (ema: the moving average).
        generation: the weight group's, as the driver numbers it; a new one (a member restarted,
        joined or left) forms a new group, whose members all join it afresh."""
        version = self.trainer.version + int(ema and self.trainer.exports_ema)
        with self.trainer.exported(ema):
            stream = self._stream(version)
            if self.rank != 0:
                stream.drain()
                return None
            if self.publisher is None or self.publisher.actors != list(actors) or generation != self._generation:
                self._generation = generation
                if self.publisher is not None:
                    self.publisher.close()
                self.publisher = WeightPublisher(self.cfg.weight_sync, actors, names, self.device)
            return self.publisher.publish(stream, version)

    def save_checkpoint(self, dir: str, extra: dict | None = None) -> str:
        if self.world_size == 1:
            return str(self.trainer.save_checkpoint(dir, extra))
        return str(dist_checkpoint.save(dir, self.trainer.version, self.trainer.state_dict(),
                                        dict(extra or {}), self.cfg.train.keep_checkpoints,
                                        timeout_s=self.cfg.learner.checkpoint_timeout_s))

    def load_checkpoint(self, dir: str) -> dict:
        if self.world_size == 1:
            return self.trainer.load_checkpoint(dir)
        state, extra, _ = dist_checkpoint.load(dir, self.trainer.state_dict(),
                                               self.trainer.optimizer.param_groups[0]["params"])
        self.trainer.load_state_dict(state)
        # every rank read its shard: the next collective must not wait on the slowest reader
        fsdp.barrier(self.cfg.learner.checkpoint_timeout_s, "learner.checkpoint_timeout_s",
                     "read its checkpoint shard")
        return extra

    def version(self) -> int:
        return self.trainer.version

    def layout(self) -> dict:
        """This rank's place on the (dp, sp) mesh and the SP degree its transformers run at."""
        from rollout_worker.models.sp import sp_degree  # heavy: diffusers

        m = self.mesh
        return {"rank": self.rank, "dp_rank": m.dp_rank if m else 0, "dp_size": m.dp_size if m else 1,
                "sp": sp_degree(self.trainer.model.transformers())}

    def close(self) -> bool:
        """Barrier, then leave the group to process exit (see learner/fsdp.py on SIGABRT)."""
        if self.publisher is not None:
            self.publisher.close()
        return fsdp.shutdown_process_group("barrier_only")


class LearnerGroup:
    """Driver-side handle: starts the ranks, forms their group, and fans each verb out
    (common/dispatch.verb: to every rank or rank 0 alone, with the result collected)."""

    def __init__(self, cfg: RunConfig, model_factory: ModelFactory | None = None,
                 num_ranks: int | None = None, setup_timeout_s: float | None = None, bank: Any = None,
                 placement: Callable[[int], dict] | None = None,
                 wait: Callable[[list, float, list[str]], list] | None = None):
        """`wait(refs, timeout_s, labels)`: how setup waits for the ranks (default ray.get); the
        driver's ends at once when a rank, or another role's actor, fails while loading."""
        pool = cfg.pools.learner
        if setup_timeout_s is None:  # the ranks' own wait for the slowest load, plus forming the group
            setup_timeout_s = cfg.learner.load_timeout_s + SETUP_MARGIN_S
        dp = num_ranks if num_ranks is not None else pool.num_actors
        if dp < 1:
            raise ValueError(f"pools.learner.num_actors = {dp}: the learner needs at least one rank")
        sp = pool.parallel.sp
        n = dp * sp  # processes: sp per data-parallel rank
        self.cfg, self.world_size = cfg, n
        self.rank_failure_grace_s = cfg.learner.rank_failure_grace_s  # common/dispatch.in_step
        self.killed = False
        # A rank cannot rejoin a live process group, so Ray never restarts one on its own;
        # the driver restarts the whole group from its last checkpoint instead.
        default = {"num_cpus": pool.num_cpus, "num_gpus": pool.num_gpus, "resources": {"learner": 1}}
        remote = ray.remote(LearnerRank)
        cfg_data = cfg.model_dump(mode="python")
        # placement(i) is process i's bundle: one per process, dp × sp of them
        self.ranks = [remote.options(**{**(placement(r) if placement else default), "max_restarts": 0,
                                        "max_task_retries": 0})
                      .remote(cfg_data, r, n, model_factory, bank if r == 0 else None, sp)
                      for r in range(n)]
        # every rank's process is up before the rendezvous starts: it is bounded by the
        # collective timeout, not by how long Ray takes to start a process
        if wait is None:
            wait = lambda refs, timeout_s, labels: ray.get(refs, timeout=timeout_s)  # noqa: E731
        labels = [f"learner rank {r}" for r in range(n)]
        addr, port = wait([r.address.remote() for r in self.ranks], setup_timeout_s, labels)[0]
        try:
            self._version = wait([r.setup.remote(addr, port) for r in self.ranks], setup_timeout_s, labels)[0]
        except BaseException:
            self.kill()
            raise

    def _stepped(self, stats: dict) -> TrainStats:
        self._version = int(stats["version"])
        return TrainStats(stats)

    def _loaded(self, extra: dict) -> dict:
        self._version = ray.get(self.ranks[0].version.remote())
        return extra

    def train_step(self, batch: TrainBatch) -> TrainStats:
        """One optimizer step; every rank gets the batch and trains on its share of the rows."""
        return self._train_ref(ray.put(batch))  # one copy in the object store, read by every rank

    _train_ref = verb("train_step", post=_stepped)  # stats are batch-wide: the ranks all-reduce them
    pull = verb("pull", on="rank0", doc="Rank 0 pulls the batch from the bank; the driver gets ids and versions only.")
    commit = verb("commit", on="rank0")
    commit_ids = verb("commit_ids", on="rank0")
    quarantine_pulled = verb("quarantine_pulled", on="rank0",
                             doc="Rank 0 quarantines the batch it pulled and could not train; the dropped group ids.")
    drop_pulled = verb("drop_pulled", on="rank0",
                       doc="Rank 0 drops these groups of its pulled batch untrained and requeues the rest.")
    weights_record = verb("weights_record", doc="The record of the packed payload's ref (rank 0's): "
                          "the payload stays in the object store; every rank joins the gather.")
    save_policy = verb("save_policy", collect="none")
    weights_payload = verb("weights_payload")
    weights_payload_ref = verb("weights_payload", ref=True, doc="Rank 0's payload as an object ref: rollout "
                               "actors read it without a copy through the driver; every rank joins the gather.")
    load_checkpoint = verb("load_checkpoint", post=_loaded)

    def train_pulled(self, receipt: PullReceipt) -> TrainStats:
        """One optimizer step on the batch rank 0 pulled."""
        return self._train_pulled(receipt.box)

    _train_pulled = verb("train_pulled", post=_stepped)

    def publish(self, actors: list, names: list[str] | None = None, ema: bool = False,
                generation: int = 0) -> PublishReport:
        """Push the current version to rollout actors (cfg.weight_sync.transport) from rank 0;
        a new `generation` forms the collective group afresh (LearnerRank.publish)."""
        return self._publish(list(actors), names, ema, generation)

    _publish = verb("publish")

    def save_checkpoint(self, dir: str | Path, extra: dict | None = None) -> Path:
        """The step dir written: a Path, or a storage.Uri for an object-store root."""
        return storage.location(self._save(str(dir), extra))

    _save = verb("save_checkpoint")

    def version(self) -> int:
        return self._version

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Barrier on every rank, then end the rank processes without destroying the group."""
        if self.killed:
            return
        try:
            ray.get([r.close.remote() for r in self.ranks], timeout=timeout_s)
        except Exception as e:
            log.warning("learner shutdown: ranks did not all reach the barrier (%s)", e)
        self.kill()

    def kill(self) -> None:
        """End the rank processes now (a rank that failed mid-call leaves its peers in a
        collective). The handles stay: a later call raises Ray's actor-died error."""
        kill_and_wait(self.ranks)
        self.killed = True
