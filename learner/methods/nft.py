"""DiffusionNFT (docs/algorithm.md section 6b): a flow-matching loss on fresh ODE rollouts' clean
final latents; the sampling policy v_old follows θ with decay nft.old_decay(t)."""

from __future__ import annotations

from learner.methods.base import Declared
from learner.nft import NFT_KEYS, build_nft_rows, nft_loss, nft_micro_batches


class NFT(Declared):
    keys = NFT_KEYS

    def rows(self, batch, version: int):
        return build_nft_rows(batch, self.cfg)

    def micro_batches(self, rows, size: int, rank: int, world_size: int):
        return nft_micro_batches(rows, size, rank, world_size)

    def micro_loss(self, trainer, rows, mb, cond_all, lam_kl: float):
        """v_old and v_π0 first, no grad; then the loss with grad."""
        policy, nc = trainer.policy, self.cfg.nft
        mb = mb.to(trainer.device)
        cond = cond_all.index(mb.cond_idx)
        old_v = policy.anchor_velocity("old", mb.xt, mb.sigma, cond)
        ref_v = policy.anchor_velocity("pi0", mb.xt, mb.sigma, cond) if nc.kl > 0 else None
        return nft_loss(mb, cond, policy.velocity, old_v, nc, self.cfg.grpo.adv_clip, rows.n, ref_v)

    def after_step(self, trainer, stats) -> None:
        trainer.policy.update_ema(self.cfg.nft.old_decay(trainer.version), "old")

    def measures_pi0(self, trainer, version: int) -> bool:
        return False  # its KL to π_0 is in the loss (nft.kl)
