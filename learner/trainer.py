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
from torch import Tensor

from common.config import RunConfig
from common.types import Cond, TrainBatch, TrainStats
from learner import checkpoint, finite_guard
from learner.kl import KLController
from learner.losses import LossConfig, compute_loss
from learner.nft import (
    NFT_KEYS,
    NFTMicroBatch,
    NFTRows,
    build_nft_rows,
    nft_loss,
    nft_micro_batches,
)
from learner.policy import Policy, Sharder
from learner.rows import MicroBatch, Rows, build_rows, micro_batches
from rollout_worker.models.base import VideoModel

ReduceFn = Callable[[Tensor], Tensor]
GRPO_KEYS = ["loss", "loss/policy", "loss/kl", "loss/align", "ratio_mean", "approx_kl", "clipfrac",
             "kl/d_anchor", "kl/d_step", "onpolicy/rows", "onpolicy/clip", "onpolicy/approx_kl", "kl/d_pi0"]


class Trainer:
    def __init__(self, cfg: RunConfig, model: VideoModel, *, device: str | torch.device | None = None):
        self.cfg, self.model = cfg, model
        self.device = torch.device(device) if device is not None else torch.device(model.device)
        self.version = 0  # optimizer steps taken; the policy version of the current weights

    def setup(self, sharder: Sharder | None = None) -> Trainer:
        """sharder: the lean sharded setup (learner/shard_load.py; the model was built empty): the
        Policy shards and loads the module before any master or anchor is made."""
        cfg = self.cfg
        # 1. losses and the anchors they need (LoRA anchors are cheap: keep π_0 and moving)
        self.loss_cfg = LossConfig.from_run(cfg)
        self.nft = cfg.grpo.loss == "nft"
        anchors = {"pi0", "moving"} if cfg.optim.finetune == "lora" else set()
        if self.loss_cfg.anchor is not None:
            anchors.add(self.loss_cfg.anchor)
        if self.nft:  # its sampling policy v_old, and π_0 for its KL
            anchors |= {"old"} | ({"pi0"} if cfg.nft.kl > 0 else set())
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

    def conditions(self, rows: Rows | NFTRows) -> Cond:
        """The batch's encoded conditions, each once, on the device: those the rollout encoded and
        the trajectories carry (the learner runs no text/image encoder and no VAE)."""
        if rows.cond is None:
            raise ValueError("the batch's trajectories carry no encoded condition (Trajectory.cond): "
                             "groups must come from rollout_worker.sampler.sample_group or the bank")
        return rows.cond.to(self.device)

    def micro_loss(self, rows: Rows, mb: MicroBatch, cond_all: Cond, lam_kl: float,
                   pi0: bool = False) -> tuple[Tensor, dict[str, Tensor]]:
        """One micro-batch's share of L_total (with grad) and its stats sums; see losses.compute_loss."""
        lc, policy = self.loss_cfg, self.policy
        mb = mb.to(self.device)
        cond = cond_all.index(mb.cond_idx)
        nxt = mb.sigma_next  # MeanFlow checkpoints also read the step's end (the sampler passes it too)
        # anchors first: swapping weights after the grad forward would corrupt backward
        anchor_v = policy.anchor_velocity(lc.anchor, mb.x.float(), mb.sigma, cond, nxt) if lc.anchor else None
        pi0_v = policy.anchor_velocity("pi0", mb.x.float(), mb.sigma, cond, nxt) if pi0 else None  # health only

        def velocity(x: Tensor, sigma: Tensor, c: Cond) -> Tensor:
            return policy.velocity(x, sigma, c, nxt)

        return compute_loss(mb, cond, velocity, rows.scheme, lc, lam_kl, rows.n, rows.n_align, anchor_v, pi0_v)

    def nft_micro_loss(self, rows: NFTRows, mb: NFTMicroBatch, cond_all: Cond) -> tuple[Tensor, dict[str, Tensor]]:
        """One micro-batch's share of DiffusionNFT's loss (learner/nft.py): v_old and v_π0 first, no grad."""
        policy, nc = self.policy, self.cfg.nft
        mb = mb.to(self.device)
        cond = cond_all.index(mb.cond_idx)
        old_v = policy.anchor_velocity("old", mb.xt, mb.sigma, cond)
        ref_v = policy.anchor_velocity("pi0", mb.xt, mb.sigma, cond) if nc.kl > 0 else None
        return nft_loss(mb, cond, policy.velocity, old_v, nc, self.cfg.grpo.adv_clip, rows.n, ref_v)

    def train_step(self, batch: TrainBatch, *, rank: int = 0, world_size: int = 1,
                   reduce: ReduceFn | None = None, sp: int = 1) -> TrainStats:
        lam_kl = self.kl.value(self.version)

        # 1. rows: advantages, step weights, winner/loser rows (NFT: noised clean latents)
        if self.nft:
            rows = build_nft_rows(batch, self.cfg)
        else:
            rows = build_rows(batch, self.cfg)
            rows.on_policy = rows.policy_version == self.version  # sampled by the weights about to be updated

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
        if not self.nft:
            stats.update(_onpolicy_stats(stats, onp_max))
            if self.loss_cfg.anchor == "pi0":
                stats["kl/d_pi0"] = stats["kl/d_anchor"]
            elif not self.measures_pi0(self.version - 1):
                del stats["kl/d_pi0"]  # not measured at this step
        stats.update({"kl/lambda": lam_kl, "kl/lambda_next": self.kl.value(self.version),
                      "grad_norm": grad_norm, "logratio_first_absmax": first_logratio,
                      "version": float(self.version), "lr": self.optimizer.param_groups[0]["lr"]})
        return TrainStats(stats)

    def _accumulate(self, rows: Rows | NFTRows, cond_all: Cond, lam_kl: float, rank: int, world_size: int,
                    reduce: ReduceFn | None, sp: int = 1) -> tuple[dict[str, float], float, float]:
        """Gradients of this rank's micro-batches; (batch-wide stats sums, the first micro-batch's
        max |log r|, the max |log r| over on-policy rows) — NaN / 0 for NFT, which has no ratio.
        `rank`/`world_size` are the data-parallel ones; the loss is scaled by world_size·sp (see
        the module doc)."""
        cfg = self.cfg
        keys = NFT_KEYS if self.nft else GRPO_KEYS
        self.optimizer.zero_grad(set_to_none=True)
        sums = torch.zeros(len(keys), dtype=torch.float64)
        onp_max = torch.zeros(world_size, dtype=torch.float64)  # one slot per rank: a sum-reduce gives the max
        first_logratio = float("nan")
        if self.nft:
            mbs = nft_micro_batches(rows, cfg.optim.micro_batch, rank, world_size)
            loss_of = lambda mb: self.nft_micro_loss(rows, mb, cond_all)  # noqa: E731
        else:
            mbs = micro_batches(rows, cfg.optim.micro_batch, rank, world_size)
            loss_of = lambda mb: self.micro_loss(rows, mb, cond_all, lam_kl, pi0=self.measures_pi0())  # noqa: E731
        for i, mb in enumerate(mbs):
            loss, s = loss_of(mb)
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
        """After the step: the moving anchor's refresh and λ_KL's update (GRPO), or NFT's v_old
        following θ with decay nft.old_decay(t)."""
        cfg, lc, policy = self.cfg, self.loss_cfg, self.policy
        if self.nft:
            policy.update_ema(cfg.nft.old_decay(self.version), "old")
            return
        if self.version % cfg.kl.anchor_period == 0 and "moving" in policy.anchors:
            policy.refresh("moving")
        measured_kl = (lc.beta_anchor * stats["kl/d_anchor"] if lc.anchor else 0.0) + \
                      (lc.beta_step * stats["kl/d_step"] if lc.uses_step else 0.0)
        self.kl.update(measured_kl)

    def measures_pi0(self, version: int | None = None) -> bool:
        """Whether the step at `version` (default: the current) measures the KL to π_0 for the health
        checks with an extra no-grad forward: every health.kl_pi0_every steps, when π_0 is kept
        (LoRA keeps it) and is not the loss's own anchor (then D_anchor is that KL already)."""
        every = self.cfg.health.kl_pi0_every
        v = self.version if version is None else version
        return (every > 0 and v % every == 0 and "pi0" in self.policy.anchors
                and self.loss_cfg.anchor != "pi0" and not self.nft)

    def shard(self, mesh) -> None:
        """FSDP2-shard the policy's module in place (before the first step) and re-point the
        Policy and the optimizer at the sharded parameters.

        The sharded fp32 parameters become the master weights; FSDP2's MixedPrecisionPolicy
        gathers them in the compute dtype the sampler holds (param bf16, reduce fp32). LoRA
        adapters are fp32 and compute in fp32, as on the rollout side.
        """
        import torch.distributed as dist

        from learner import fsdp

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
        from learner import fsdp

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
        `ema` and the run keeps one, else the live weights as they are. With `ema` false under
        grpo.loss=nft it is the sampling policy v_old: what the rollouts are sent (section 6b)."""
        if ema and self.exports_ema:
            return self.policy.swapped("ema")
        if not ema and self.nft:
            return self.policy.swapped("old")
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


def _onpolicy_stats(stats: dict[str, float], logratio_absmax: float) -> dict[str, float]:
    """Clip fraction, approx-KL and max |log r| over the rows the pre-update weights sampled
    (NaN when the batch has none: every row stale or from the bank)."""
    n = stats.pop("onpolicy/rows")
    clip, akl = stats.pop("onpolicy/clip"), stats.pop("onpolicy/approx_kl")
    nan = float("nan")
    return {"onpolicy_rows": n, "clipfrac_onpolicy": clip / n if n else nan,
            "approx_kl_onpolicy": akl / n if n else nan, "logratio_onpolicy_absmax": logratio_absmax if n else nan}


def _py_rng_to_list(state: tuple) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _py_rng_from_list(state: list) -> tuple:
    version, internal, gauss = state
    return (version, tuple(internal), gauss)
