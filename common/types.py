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
class Cond:
    """An encoded condition: the tensors a family's transformer reads beside the latents.

    The rollout encodes each condition once; the encoded condition travels with the group and
    the bank stores it once per condition (memory_bank/keys.py: `cond_record`), so the learner
    runs no text encoder, image encoder or VAE. `tensors` are the conditional inputs, `uncond`
    the unconditional ones for CFG (None without CFG; its names are among `tensors`'). Every
    tensor has the batch as its first dim, so a Cond is repeated, indexed and concatenated by
    row. Per family, for B rows:
    - toy: text [B, L, D] word embeddings; image [B, 4, H, W] first frame + mask (zeros for T2V);
    - wan: encoder_hidden_states [B, L, D] (UMT5); I2V adds condition [B, 4 + C, F, H, W] (the
      first-frame mask and VAE latents) and, for Wan 2.1, encoder_hidden_states_image [B, N, D]
      (CLIP); Wan 2.2 TI2V-5B's I2V instead first_frame [B, C, 1, H, W] (the first frame's VAE
      latents, held as the first latent frame);
    - hunyuan15: encoder_hidden_states [B, L, D] and encoder_attention_mask [B, L] (Qwen2.5-VL),
      encoder_hidden_states_2 [B, L2, D2] and encoder_attention_mask_2 [B, L2] (ByT5),
      image_embeds [B, 729, D_img] (SigLIP; zeros for T2V), cond_latents [B, C, F, H, W] and
      mask [B, 1, F, H, W] (the first frame's VAE latents; zeros for T2V).
    `encoder` names what encoded it (family, path, dtype, task, resolution, negative prompt;
    rollout_worker/models/base.encoder_fingerprint), part of the bank's key for it.
    """

    tensors: dict[str, Tensor]
    uncond: dict[str, Tensor] | None = None
    encoder: str = ""

    def _map(self, fn) -> Cond:
        return Cond({k: fn(v) for k, v in self.tensors.items()},
                    None if self.uncond is None else {k: fn(v) for k, v in self.uncond.items()},
                    self.encoder)

    @property
    def rows(self) -> int:
        return next(iter(self.tensors.values())).shape[0]

    def repeat(self, n: int) -> Cond:
        """Each row repeated n times in place: [B, ...] → [B·n, ...]."""
        return self._map(lambda t: t.repeat_interleave(n, dim=0))

    def index(self, idx) -> Cond:
        return self._map(lambda t: t[idx])

    def to(self, device) -> Cond:
        return self._map(lambda t: t.to(device))

    def nbytes(self) -> int:
        ts = [*self.tensors.values(), *(self.uncond or {}).values()]
        return sum(t.numel() * t.element_size() for t in ts)

    @staticmethod
    def cat(conds: list[Cond]) -> Cond:
        """The rows of several conditions, in order ([B_1 + B_2 + …, ...]); they must hold the
        same tensors (one model encoded them)."""
        first = conds[0]
        for c in conds[1:]:
            if set(c.tensors) != set(first.tensors) or (c.uncond is None) != (first.uncond is None) \
                    or set(c.uncond or {}) != set(first.uncond or {}):
                raise ValueError(f"encoded conditions hold different tensors ({sorted(first.tensors)} vs "
                                 f"{sorted(c.tensors)}); one batch needs one model's encoding")
        if len(conds) == 1:
            return first
        tensors = {k: torch.cat([c.tensors[k] for c in conds]) for k in first.tensors}
        uncond = None if first.uncond is None else \
            {k: torch.cat([c.uncond[k] for c in conds]) for k in first.uncond}
        return Cond(tensors, uncond, first.encoder)


@dataclass
class Condition:
    """One prompt (plus a first frame for image-to-video) that a group is generated for."""

    id: str                        # stable id, e.g. a hash of prompt (+ image)
    prompt: str
    image: Tensor | None = None    # uint8 [H, W, 3] first frame for I2V, else None
    # I2V by reference: a file the rollout and reward roles read themselves
    # (common/images.condition_image), so the pixels never travel through the driver; `image`
    # stays None then. The learner never reads it: it trains on the encoded condition (Cond).
    image_path: str | None = None
    negative_prompt: str | None = None  # from a dataset manifest, else the model's default
    name: str | None = None        # a dataset row's own id (file names of samples), else None

    @property
    def is_i2v(self) -> bool:
        return self.image is not None or self.image_path is not None


@dataclass
class Trajectory:
    """One member of a group: the trained transitions of its SDE rollout.

    Only the steps this member trains are stored. `x[j] → x_next[j]` is step `step_indices[j]`,
    from σ = spec.sigmas[k] to spec.sigmas[k+1]; `logp_old[j]` is its element-averaged log-prob
    under the policy that sampled it, computed from exactly these stored tensors with the scheme
    `spec` describes (name, every argument, the schedule), which is all the learner replays it
    with. Trajectory alignment uses a winner's or loser's x_{k+1} only where that member trained
    (so stored) step k. `cond` is the encoded condition it was sampled with (one row), shared by
    the members of a group and stored once per condition in the bank.
    A rollout that records no step (DiffusionNFT's ODE rollouts, grpo.loss=nft) has
    `step_indices == []` and x, x_next, logp_old None: its loss reads only `final_latents` and `cond`.
    """

    condition: Condition
    group_id: str
    member: int
    seed: int
    spec: SchemeSpec               # the SDE scheme and the whole schedule σ_0 … σ_T it sampled with
    guidance_scale: float
    policy_version: int
    step_indices: list[int]        # K trained steps k, increasing (K = 0: none recorded)
    x: Tensor | None               # [K, C, F, H, W] latents at the trained steps; None when K = 0
    x_next: Tensor | None          # [K, C, F, H, W] the sampled next latents; None when K = 0
    logp_old: Tensor | None        # [K] fp32; None when K = 0
    final_latents: Tensor          # [C, F, H, W]
    frames: Tensor | None = None   # uint8 [F, H, W, 3] decoded video
    cond: Cond | None = None       # the encoded condition it was sampled with, one row ([1, ...])
    mu_old: Tensor | None = None   # [K, C, F, H, W] fp32 sampling policy's mean μ_old per recorded step
    trained_times: int = 0         # how often the learner has used it
    bank_id: str | None = None     # memory-bank entry id, set when read back from the bank

    @property
    def num_steps(self) -> int:
        return len(self.step_indices)

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

    @property
    def cond(self) -> Cond | None:
        """The encoded condition its members were sampled with (one object, shared)."""
        return self.members[0].cond if self.members else None

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
    failure: str | None = None     # reward | invalid | bank_unavailable | bank_full | lease_lost | error
    detail: str = ""               # one line: why it failed
    step: int = -1                 # the driver's step when the receipt arrived (set by the driver)


@dataclass
class PullReceipt:
    """What the learner's rank 0 tells the driver about the batch it pulled from the bank.

    `dropped` lists fresh groups dropped on the way out: corrupt (the bank), untrainable
    (quarantined) or sampled with other settings (learner/admit.py), each with its reason in
    `reasons`; when it is not empty the batch was given back to the queue and nothing is trained
    (the driver draws those conditions again first). `box` is [object ref of the TrainBatch] for the other ranks
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
    reasons: dict[str, str] = field(default_factory=dict)     # dropped group id -> why
    notes: list[str] = field(default_factory=list)            # what rank 0 took out of the batch, for the log
    box: list | None = None
