"""The single-process reference learner: setup → train_step → save_checkpoint.

One `train_step` is one optimizer step over a TrainBatch: gradients accumulate over
(sample, trained step) micro-batches of cfg.optim.micro_batch rows, are clipped to
cfg.optim.grad_clip, and AdamW steps once; the policy version then advances by one.

For data-parallel ranks (learner/fsdp.py), `train_step(batch, rank=r, world_size=n, reduce=fn)`
processes rank r's share of the rows (every rank runs the same number of micro-batches) and
scales its loss by n, because FSDP2's gradient reduce-scatter averages over ranks while the
loss is a sum over rows / the batch-wide count. `reduce` (a sum all-reduce of one fp64
tensor over the data-parallel ranks) makes the reported stats batch-wide. With sequence
parallelism (`sp` > 1) each of the sp ranks of data-parallel rank r trains the same rows and
holds its tokens' share of their gradient; FSDP2 averages over all n·sp ranks, so the loss is
scaled by n·sp.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from common.config import RunConfig
from common.types import Cond, TrainBatch, TrainStats
from learner import checkpoint, finite_guard, fsdp
from learner.kl import KLController
from learner.methods import build_method
from learner.policy import Policy, Sharder
from rollout_worker.models.base import VideoModel

ReduceFn = Callable[[Tensor], Tensor]


class Trainer:
    def __init__(self, cfg: RunConfig, model: VideoModel, *, device: str | torch.device | None = None):
        self.cfg, self.model = cfg, model
        self.device = torch.device(device) if device is not None else torch.device(model.device)
        self.version = 0  # optimizer steps taken; the policy version of the current weights

    def setup(self, sharder: Sharder | None = None) -> Trainer:
        """sharder: the lean sharded setup (learner/shard_load.py; the model was built empty): the
        Policy shards and loads the module before any master or anchor is made."""
        cfg = self.cfg
        # 1. the method (grpo.loss: learner/methods/) and the anchors its loss needs (LoRA anchors
        # are cheap: keep π_0 and moving)
        self.method = build_method(cfg)
        anchors = {"pi0", "moving"} if cfg.optim.finetune == "lora" else set()
        anchors |= self.method.anchors()
        if cfg.optim.ema_decay > 0:
            anchors.add("ema")
        if sharder is None:
            self.model.trainable_module().to(self.device)
        self.policy = Policy(self.model, cfg.optim, sorted(anchors), checkpointing=cfg.model.gradient_checkpointing,
                             seed=cfg.train.seed, sharder=sharder)
        if sharder is not None:
            self._after_sharding()
        # 2. optimizer (authors' defaults: lr 1e-5, weight decay 0.01), over fp32 master weights
        self.optimizer = torch.optim.AdamW(self.policy.optim_parameters(), lr=cfg.optim.lr,
                                           weight_decay=cfg.optim.weight_decay, betas=cfg.optim.betas)
        # 3. λ_KL (the SDE scheme and schedule come with each batch: rows.build_rows)
        self.kl = KLController(cfg.kl)
        return self

    # --- one optimizer step ------------------------------------------------------------

    def conditions(self, rows) -> Cond:
        """The batch's encoded conditions, each once, on the device: those the rollout encoded and
        the trajectories carry (the learner runs no text/image encoder and no VAE)."""
        if rows.cond is None:
            raise ValueError("the batch's trajectories carry no encoded condition (Trajectory.cond): "
                             "groups must come from rollout_worker.sampler.sample_group or the bank")
        return rows.cond.to(self.device)

    def train_step(self, batch: TrainBatch, *, rank: int = 0, world_size: int = 1,
                   reduce: ReduceFn | None = None, sp: int = 1) -> TrainStats:
        lam_kl = self.kl.value(self.version)

        # 1. the method's rows: advantages, step weights, winner/loser rows (NFT: noised clean latents)
        rows = self.method.rows(batch, self.version)

        # 2. conditions, as the rollout encoded them
        cond_all = self.conditions(rows)

        # 3. accumulate gradients over this rank's micro-batches
        stats, first_logratio, onp_max = self._accumulate(rows, cond_all, lam_kl, rank, world_size, reduce, sp)

        # 4. clip, step the fp32 masters, round them into the compute weights (a non-finite
        # loss or gradient: no step, nothing moves; learner/finite_guard.py)
        grad_norm = self._optimizer_step(stats["loss"])
        skipped = not finite_guard.finite(stats["loss"], grad_norm)

        # 5. anchors and λ_KL for the next step
        if not skipped:
            self._move_anchors(stats)
        stats.update(finite_guard.step_stats(batch, skipped))
        stats.update(rows.stats)
        self.method.step_stats(self, stats, onp_max)
        stats.update({"kl/lambda": lam_kl, "kl/lambda_next": self.kl.value(self.version),
                      "grad_norm": grad_norm, "logratio_first_absmax": first_logratio,
                      "version": float(self.version), "lr": self.optimizer.param_groups[0]["lr"]})
        return TrainStats(stats)

    def _accumulate(self, rows, cond_all: Cond, lam_kl: float, rank: int, world_size: int,
                    reduce: ReduceFn | None, sp: int = 1) -> tuple[dict[str, float], float, float]:
        """Gradients of this rank's micro-batches; (batch-wide stats sums, the first micro-batch's
        max |log r|, the max |log r| over on-policy rows) — NaN / 0 for NFT, which has no ratio.
        `rank`/`world_size` are the data-parallel ones; the loss is scaled by world_size·sp (see
        the module doc)."""
        cfg = self.cfg
        method = self.method
        keys = method.keys
        self.optimizer.zero_grad(set_to_none=True)
        sums = torch.zeros(len(keys), dtype=torch.float64)
        onp_max = torch.zeros(world_size, dtype=torch.float64)  # one slot per rank: a sum-reduce gives the max
        first_logratio = float("nan")
        for i, mb in enumerate(method.micro_batches(rows, cfg.optim.micro_batch, rank, world_size)):
            loss, s = method.micro_loss(self, rows, mb, cond_all, lam_kl)
            (loss * (world_size * sp)).backward()
            sums += torch.stack([s[k].double().cpu() for k in keys])
            if i == 0 and "logratio_absmax" in s:
                first_logratio = float(s["logratio_absmax"])
            if "onpolicy/logratio_absmax" in s:
                onp_max[rank] = max(float(onp_max[rank]), float(s["onpolicy/logratio_absmax"]))
        if reduce is not None:
            sums, onp_max = reduce(torch.cat([sums, onp_max])).split([len(keys), world_size])
        return dict(zip(keys, sums.tolist(), strict=True)), first_logratio, float(onp_max.max())

    def _optimizer_step(self, loss: float) -> float:
        """Clip, step the fp32 masters, round them into the compute weights; the pre-clip grad norm.
        A non-finite loss or norm (batch-wide: every rank agrees) skips the step."""
        policy = self.policy
        policy.grads_to_master()
        grad_norm = torch.nn.utils.clip_grad_norm_(policy.optim_parameters(), self.cfg.optim.grad_clip)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        if not finite_guard.finite(loss, float(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            self.version += 1
            return float(grad_norm)
        self.optimizer.step()
        policy.master_to_params()
        self.version += 1
        if self.cfg.optim.ema_decay > 0:
            policy.update_ema(ema_decay_at(self.cfg.optim.ema_decay, self.version))
        return float(grad_norm)

    def _move_anchors(self, stats: dict[str, float]) -> None:
        """After the step: the method's anchors and λ_KL move (learner/methods/)."""
        self.method.after_step(self, stats)

    def measures_pi0(self, version: int | None = None) -> bool:
        """Whether the step at `version` (default: the current) measures the KL to π_0 for the
        health checks with an extra no-grad forward (the method decides)."""
        return self.method.measures_pi0(self, self.version if version is None else version)

    def shard(self, mesh) -> None:
        """FSDP2-shard the policy's module in place (before the first step) and re-point the
        Policy and the optimizer at the sharded parameters.

        The sharded fp32 parameters become the master weights; FSDP2's MixedPrecisionPolicy
        gathers them in the compute dtype the sampler holds (param bf16, reduce fp32). LoRA
        adapters are fp32 and compute in fp32, as on the rollout side.
        """
        policy, opt = self.policy, self.optimizer
        if len(opt.param_groups) != 1 or opt.state:
            raise RuntimeError("shard before the first optimizer step, with one parameter group")
        param_dtype = policy.prepare_for_sharding()
        # Identical starting weights on every rank (LoRA's A is drawn from each process's RNG).
        for t in policy.module.state_dict().values():
            dist.broadcast(t.data, src=0)
        fsdp.shard_model(policy.module, mesh, param_dtype=param_dtype, offload=self.cfg.learner.cpu_offload)
        policy.rebind()
        self._after_sharding()
        opt.param_groups[0]["params"] = policy.optim_parameters()

    def _after_sharding(self) -> None:
        policy = self.policy
        # the root stays gathered after a forward (reshard_after_forward=False): after an anchor's
        # weights are swapped into the shards, that copy would be the anchor's in the next forward
        policy.after_swap = lambda: fsdp.reshard(policy.module)

    # --- weights and checkpoints -------------------------------------------------------

    @property
    def exports_ema(self) -> bool:
        """Whether the exported policy is the weights' moving average (optim.ema_decay > 0)."""
        return "ema" in self.policy.anchors

    def exported(self, ema: bool = True) -> AbstractContextManager:
        """The live module holds the exported policy for the block: the moving average when
        `ema` and the run keeps one, else what the rollouts are sent: the method's rollout anchor
        (DiffusionNFT's sampling policy v_old, section 6b) or the live weights as they are."""
        if ema and self.exports_ema:
            return self.policy.swapped("ema")
        if not ema and self.method.rollout_anchor is not None:
            return self.policy.swapped(self.method.rollout_anchor)
        return nullcontext()

    def weights_payload(self, ema: bool = False) -> dict[str, Tensor]:
        """Adapter-only for LoRA (see Policy.weights_payload), else the full state dict; CPU tensors.
        ema: the moving average's weights instead of the live ones (when it is kept)."""
        with self.exported(ema):
            return self.policy.weights_payload()

    def state_dict(self) -> dict:
        rng = {"torch": torch.get_rng_state(), "python": _py_rng_to_list(random.getstate())}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        return {"version": self.version, "finetune": self.cfg.optim.finetune,
                "policy": self.policy.state_dict(), "optimizer": self.optimizer.state_dict(),
                "kl": self.kl.state_dict(), "rng": rng}

    def load_state_dict(self, state: dict) -> None:
        if state["finetune"] != self.cfg.optim.finetune:
            raise ValueError(f"checkpoint was trained with optim.finetune={state['finetune']!r}, "
                             f"this run uses {self.cfg.optim.finetune!r}")
        self.policy.load_state_dict(state["policy"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.kl.load_state_dict(state["kl"])
        self.version = int(state["version"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(_py_rng_from_list(state["rng"]["python"]))
        if "cuda" in state["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])

    def save_checkpoint(self, dir: str | Path, extra: dict | None = None) -> Path:
        """Atomically write `<dir>/step_<version>`; keeps cfg.train.keep_checkpoints of them."""
        return checkpoint.save(dir, self.version, self.state_dict(), dict(extra or {}),
                               self.cfg.train.keep_checkpoints)

    def load_checkpoint(self, dir: str | Path) -> dict:
        """Restore from a checkpoint dir (or the newest under a root); returns the driver's `extra`."""
        state, extra, _ = checkpoint.load(dir, map_location=self.device)
        self.load_state_dict(state)
        return extra


def ema_decay_at(decay: float, version: int) -> float:
    """The average's decay after optimizer step `version`: min(decay, (1+t)/(10+t)), so that the
    first steps move it (at t = 1, by 8/11) instead of holding it at the base."""
    return min(decay, (1.0 + version) / (10.0 + version))


def _py_rng_to_list(state: tuple) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _py_rng_from_list(state: list) -> tuple:
    version, internal, gauss = state
    return (version, tuple(internal), gauss)
