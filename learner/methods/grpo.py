"""GRPO on recorded SDE steps: the clipped surrogate with the equalizer, the dual-KL terms and
trajectory alignment (docs/algorithm.md sections 3-6; the math is learner/losses.py)."""

from __future__ import annotations

from learner.losses import LossConfig, compute_loss
from learner.methods.base import Declared
from learner.rows import build_rows, micro_batches

KEYS = ["loss", "loss/policy", "loss/kl", "loss/align", "ratio_mean", "approx_kl", "clipfrac",
        "kl/d_anchor", "kl/d_step", "onpolicy/rows", "onpolicy/clip", "onpolicy/approx_kl", "kl/d_pi0"]


class GRPO(Declared):
    keys = KEYS

    def __init__(self, cfg):
        super().__init__(cfg)
        self.loss_cfg = LossConfig.from_run(cfg)

    def rows(self, batch, version: int):
        rows = build_rows(batch, self.cfg)
        rows.on_policy = rows.policy_version == version  # sampled by the weights about to be updated
        return rows

    def micro_batches(self, rows, size: int, rank: int, world_size: int):
        return micro_batches(rows, size, rank, world_size)

    def micro_loss(self, trainer, rows, mb, cond_all, lam_kl: float, pi0: bool | None = None):
        """One micro-batch's share of L_total (with grad) and its stats sums; see losses.compute_loss.
        pi0: also the KL to π_0 for the health checks (default: when this step measures it)."""
        lc, policy = self.loss_cfg, trainer.policy
        pi0 = self.measures_pi0(trainer, trainer.version) if pi0 is None else pi0
        mb = mb.to(trainer.device)
        cond = cond_all.index(mb.cond_idx)
        nxt = mb.sigma_next  # MeanFlow checkpoints also read the step's end (the sampler passes it too)
        # anchors first: swapping weights after the grad forward would corrupt backward
        anchor_v = policy.anchor_velocity(lc.anchor, mb.x.float(), mb.sigma, cond, nxt) if lc.anchor else None
        pi0_v = policy.anchor_velocity("pi0", mb.x.float(), mb.sigma, cond, nxt) if pi0 else None  # health only

        def velocity(x, sigma, c):
            return policy.velocity(x, sigma, c, nxt)

        return compute_loss(mb, cond, velocity, rows.scheme, lc, lam_kl, rows.n, rows.n_align, anchor_v, pi0_v)

    def step_stats(self, trainer, stats, onpolicy_absmax: float) -> None:
        stats.update(_onpolicy_stats(stats, onpolicy_absmax))
        if self.loss_cfg.anchor == "pi0":
            stats["kl/d_pi0"] = stats["kl/d_anchor"]
        elif not self.measures_pi0(trainer, trainer.version - 1):
            del stats["kl/d_pi0"]  # not measured at this step

    def after_step(self, trainer, stats) -> None:
        """The moving anchor's refresh and λ_KL's update."""
        cfg, lc, policy = self.cfg, self.loss_cfg, trainer.policy
        if trainer.version % cfg.kl.anchor_period == 0 and "moving" in policy.anchors:
            policy.refresh("moving")
        measured_kl = (lc.beta_anchor * stats["kl/d_anchor"] if lc.anchor else 0.0) + \
                      (lc.beta_step * stats["kl/d_step"] if lc.uses_step else 0.0)
        trainer.kl.update(measured_kl)

    def measures_pi0(self, trainer, version: int) -> bool:
        """Every health.kl_pi0_every steps, when π_0 is kept (LoRA keeps it) and is not the loss's
        own anchor (then D_anchor is that KL already): an extra no-grad forward."""
        every = self.cfg.health.kl_pi0_every
        return (every > 0 and version % every == 0 and "pi0" in trainer.policy.anchors
                and self.loss_cfg.anchor != "pi0")


def _onpolicy_stats(stats: dict[str, float], logratio_absmax: float) -> dict[str, float]:
    """Clip fraction, approx-KL and max |log r| over the rows the pre-update weights sampled
    (NaN when the batch has none: every row stale or from the bank)."""
    n = stats.pop("onpolicy/rows")
    clip, akl = stats.pop("onpolicy/clip"), stats.pop("onpolicy/approx_kl")
    nan = float("nan")
    return {"onpolicy_rows": n, "clipfrac_onpolicy": clip / n if n else nan,
            "approx_kl_onpolicy": akl / n if n else nan, "logratio_onpolicy_absmax": logratio_absmax if n else nan}
