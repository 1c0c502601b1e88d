"""What the method tests (test_nft, test_grpo_guard, test_dgpo, test_awm) share: a config built
from a method's base sections, a parametric velocity, an ODE batch of final latents, the fresh
groups a short training run scores, and the one-line config refusal."""

from __future__ import annotations

import pytest
import torch

from common.config import ConfigError, RunConfig, load_config
from common.sde import ODE, Schedule
from common.types import Condition, Group, Scores, TrainBatch, Trajectory

SHAPE = (3, 2, 4, 4)


def method_cfg(base: dict, **sections) -> RunConfig:
    """`base`'s sections with `sections` merged over them, key by key."""
    merged = {k: dict(v) for k, v in base.items()}
    for k, v in sections.items():
        merged[k] = {**merged.get(k, {}), **v}
    return RunConfig.model_validate(merged)


def linear_velocity(W: torch.Tensor, b: torch.Tensor):
    """A parametric velocity v(x, σ) = W·x·(1 + σ) + b over the channel axis."""
    def v(x, sigma, cond=None):
        return torch.einsum("ij,bj...->bi...", W, x) * (1 + sigma.view(-1, 1, 1, 1, 1)) + b.view(1, -1, 1, 1, 1)
    return v


def ode_batch(rewards: list[list[float]], version: int, steps: int = 10, seed: int = 0) -> TrainBatch:
    """One ODE group per reward list (members carry only final latents), at policy version 0."""
    sched = Schedule.linear(steps, 3.0)
    g = torch.Generator().manual_seed(seed)
    groups = []
    for gi, rs in enumerate(rewards):
        cond = Condition(f"c{gi}", f"prompt {gi}")
        members = [Trajectory(condition=cond, group_id=f"g{gi}", member=i, seed=0, spec=ODE().spec(sched),
                              guidance_scale=1.0, policy_version=0, step_indices=[], x=None, x_next=None,
                              logp_old=None, final_latents=torch.randn(SHAPE, generator=g)) for i in range(len(rs))]
        r = torch.tensor(rs)
        groups.append(Group(cond, f"g{gi}", 0, members, Scores(["h"], r.view(-1, 1)), r))
    return TrainBatch(groups, version=version)


def assert_refused_in_one_line(base: list[str], override: str, named: str) -> None:
    """`base` loads; with `override` it is refused in one line naming `named`."""
    load_config(None, base)
    with pytest.raises(ConfigError) as e:
        load_config(None, [*base, override])
    assert named in str(e.value) and "\n" not in str(e.value)


def scored_groups(model, cfg: RunConfig, step: int, version: int, n: int = 2) -> list[Group]:
    """`n` fresh groups of conditions c0.. sampled at `step`, each member scored by the mean of its
    final latents' first channel (a reward the tiny model can learn)."""
    from rollout_worker.sampler import sample_group  # heavy: the sampler and its models

    out = []
    for c in range(n):
        grp = sample_group(model, Condition(f"c{c}", f"prompt {c}"), cfg, seed=10 * step + c, policy_version=version)
        grp.composite = torch.stack([t.final_latents[0].mean() for t in grp.members])
        grp.scores = Scores(["h"], grp.composite.view(-1, 1))
        out.append(grp)
    return out
