"""Small scored groups for the memory-bank tests (K=3 trained steps of [C=4, F=6, 16, 16])."""

from __future__ import annotations

import torch

from common.sde import Sage, Schedule
from common.types import Condition, Group, Scores, Trajectory

SHAPE = (4, 6, 16, 16)   # [C, F, H, W]
HEADS = ["vq", "mq", "ta"]


def make_traj(cond: Condition, group_id: str, member: int, version: int, gen: torch.Generator,
              k: int = 3, shape: tuple[int, ...] = SHAPE, dtype=torch.float32) -> Trajectory:
    spec = Sage(0.5).spec(Schedule.explicit(torch.linspace(1, 0, 9).tolist()))
    return Trajectory(
        condition=cond, group_id=group_id, member=member, seed=1234 + member, spec=spec,
        guidance_scale=1.0, policy_version=version, step_indices=list(range(k)),
        x=torch.randn(k, *shape, generator=gen).to(dtype),          # [K, C, F, H, W]
        x_next=torch.randn(k, *shape, generator=gen).to(dtype),     # [K, C, F, H, W]
        logp_old=torch.randn(k, generator=gen),                     # [K]
        final_latents=torch.randn(*shape, generator=gen).to(dtype),  # [C, F, H, W]
        frames=torch.randint(0, 255, (shape[1], 8, 8, 3), dtype=torch.uint8, generator=gen),
    )


def make_group(cid: str = "c0", group_id: str = "g0", version: int = 0, g: int = 4,
               seed: int = 0, composite: list[float] | None = None, image: bool = False,
               shape: tuple[int, ...] = SHAPE) -> Group:
    gen = torch.Generator().manual_seed(seed)
    img = torch.randint(0, 255, (8, 8, 3), dtype=torch.uint8, generator=gen) if image else None
    cond = Condition(id=cid, prompt=f"a prompt for {cid} ✓", image=img)
    members = [make_traj(cond, group_id, i, version, gen, shape=shape) for i in range(g)]
    values = torch.rand(g, len(HEADS), generator=gen)                 # [G, H]
    comp = torch.tensor(composite, dtype=torch.float32) if composite is not None else values.sum(1)
    return Group(condition=cond, group_id=group_id, policy_version=version, members=members,
                 scores=Scores(list(HEADS), values), composite=comp)
