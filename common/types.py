"""The data contract between roles: what a rollout produces, a reward adds and the learner reads.

Every object that crosses a role boundary carries the `policy_version` that made it.
Tensors are CPU tensors; shapes are written beside each field.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from common.sde import SchemeSpec


@dataclass
class Condition:
    """One prompt (plus a first frame for image-to-video) that a group is generated for."""

    id: str                        # stable id, e.g. a hash of prompt (+ image)
    prompt: str
    image: Tensor | None = None    # uint8 [H, W, 3] first frame for I2V, else None
    # I2V by reference: a file every role reads itself (common/images.condition_image), so the
    # pixels never travel through the driver; `image` stays None then.
    image_path: str | None = None
    negative_prompt: str | None = None  # from a dataset manifest, else the model's default
    name: str | None = None        # a dataset row's own id (file names of samples), else None

    @property
    def is_i2v(self) -> bool:
        return self.image is not None or self.image_path is not None


@dataclass
class Trajectory:
    """One member of a group: the trained transitions of its SDE rollout.

    Only recorded steps are stored; a rollout that records none (DiffusionNFT's ODE rollouts,
    grpo.loss=nft) has `step_indices == []` and x, x_next, logp_old None: its loss reads only
    `final_latents` and the condition (its spec is the ODE scheme's). `x[j] → x_next[j]` is step
    `step_indices[j]`, from σ = spec.sigmas[k] to spec.sigmas[k+1]; `logp_old[j]` is its
    element-averaged log-prob under the policy that sampled it, computed from exactly these stored
    tensors with the scheme `spec` describes (name, every argument, the schedule), which is all the
    learner replays it with. A group records the
    same steps for every member: each member's trained steps, plus every step trajectory
    alignment may need a winner's or loser's next latent at. `trained_steps` says which of
    them this member trains (None: all).
    """

    condition: Condition
    group_id: str
    member: int
    seed: int
    spec: SchemeSpec               # the SDE scheme and the whole schedule σ_0 … σ_T it sampled with
    guidance_scale: float
    policy_version: int
    step_indices: list[int]        # K trained steps k (K = 0: none recorded)
    x: Tensor | None               # [K, C, F, H, W] latents at the trained steps; None when K = 0
    x_next: Tensor | None          # [K, C, F, H, W] the sampled next latents; None when K = 0
    logp_old: Tensor | None        # [K] fp32; None when K = 0
    final_latents: Tensor          # [C, F, H, W]
    frames: Tensor | None = None   # uint8 [F, H, W, 3] decoded video
    trained_steps: list[int] | None = None  # subset of step_indices this member trains; None = all
    mu_old: Tensor | None = None   # [K, C, F, H, W] fp32 sampling policy's mean μ_old per recorded step
    trained_times: int = 0         # how often the learner has used it
    bank_id: str | None = None     # memory-bank entry id, set when read back from the bank

    @property
    def num_steps(self) -> int:
        return len(self.step_indices)

    def trains(self, k: int) -> bool:
        return self.trained_steps is None or k in self.trained_steps

    def nbytes(self) -> int:
        ts = [self.x, self.x_next, self.logp_old, self.final_latents, self.mu_old, self.frames]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)


@dataclass
class Scores:
    """Reward heads for a batch of videos: `values[i, h]` is head `heads[h]` of video i (their
    weights and the composite: common/rewards.RewardHeads)."""

    heads: list[str]
    values: Tensor                 # [B, H] fp32; non-finite means the head failed for that video

    @property
    def valid(self) -> Tensor:     # [B] bool
        return torch.isfinite(self.values).all(dim=1)

    @staticmethod
    def merge(parts: list[Scores]) -> Scores:
        """Side-by-side heads of several reward models for the same videos."""
        heads = [h for p in parts for h in p.heads]
        if len(set(heads)) != len(heads):
            raise ValueError(f"reward heads collide: {heads}")
        return Scores(heads, torch.cat([p.values for p in parts], dim=1))


@dataclass
class Group:
    """G trajectories of one condition, with their scores once the reward role has run."""

    condition: Condition
    group_id: str
    policy_version: int
    members: list[Trajectory]
    scores: Scores | None = None   # [G, H]
    composite: Tensor | None = None  # [G] fp32

    @property
    def size(self) -> int:
        return len(self.members)

    def frames(self) -> Tensor:
        """uint8 [G, F, H, W, 3]."""
        return torch.stack([m.frames for m in self.members])


@dataclass
class TrainBatch:
    """What the learner trains on in one optimizer step: fresh groups plus bank entries.

    `bank[i]` holds earlier trajectories of `fresh[i].condition` (within the staleness
    bound), each with its stored rewards.
    """

    fresh: list[Group]
    bank: list[list[tuple[Trajectory, Tensor, float]]] = field(default_factory=list)
    # bank[i][j] = (trajectory, head scores [H], composite)
    version: int = 0               # the learner's policy version the batch is trained at


@dataclass
class TrainStats:
    """Scalars the learner reports per optimizer step (all floats, for metrics.jsonl)."""

    values: dict[str, float] = field(default_factory=dict)

    def __getitem__(self, k: str) -> float:
        return self.values[k]


@dataclass
class GroupReceipt:
    """What a rollout actor tells the driver about one group it generated, scored and pushed.

    The group itself went from the rollout actor to the reward pool and into the bank; the
    driver only ever sees this record (a few hundred bytes), whatever the video size.
    """

    group_id: str
    condition_id: str
    cursor: int                    # the prompt-stream position the group was drawn at
    version: int                   # policy version that generated it
    actor: int = -1                # rollout actor index
    size: int = 0                  # G members pushed
    latent_bytes: int = 0          # bytes of the stored trajectories (what went into the bank)
    frame_bytes: int = 0           # bytes of the decoded videos (what went to the reward pool)
    invalid_members: int = 0       # members with a non-finite reward (the group is then not pushed)
    reward_timeouts: int = 0       # reward calls retried after a timeout, on another actor
    reward_failures: int = 0       # reward calls retried after an error or a dead actor
    seconds: dict[str, float] = field(default_factory=dict)  # generate / score / store
    ok: bool = True
    failure: str | None = None     # reward | invalid | bank_unavailable | bank_full | error
    detail: str = ""               # one line: why it failed
    step: int = -1                 # the driver's step when the receipt arrived (set by the driver)


@dataclass
class PullReceipt:
    """What the learner's rank 0 tells the driver about the batch it pulled from the bank.

    `dropped` lists fresh groups the bank found corrupt and dropped on the way out; when it is
    not empty the batch was given back to the queue and nothing is trained (the driver draws
    those conditions again first). `box` is [object ref of the TrainBatch] for the other ranks
    (None with one rank): the driver passes it on and never reads it.
    """

    group_ids: list[str] = field(default_factory=list)
    condition_ids: list[str] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)          # policy version of each fresh group
    heads: list[str] = field(default_factory=list)
    reward_mean: float = float("nan")                          # composite, over fresh members
    head_means: dict[str, float] = field(default_factory=dict)
    bank_entries: int = 0
    spread: dict[str, float] = field(default_factory=dict)    # health: share of groups with no spread
    dropped: list[str] = field(default_factory=list)
    box: list | None = None
