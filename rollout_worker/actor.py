"""The rollout actor: one model on one pool slot; verbs `stage` + `deliver` (the data plane),
`generate`, `evaluate_pairs`, `set_weights`, `version`, `ping`.

Data plane. `stage(condition, seed, group_id, cursor)` generates a group and keeps it here;
`deliver(group_id)` hands its frames to the reward pool (its own RewardClient over the reward
actors it was given), and pushes the scored group into the bank on its own connection (a
`BankRef`: the Redis URL by reference). Only a `GroupReceipt` goes back to the driver. The
two calls are separate so the driver can bound generation (`sampler.timeout_s`) apart from
scoring and storing; it submits both at once, and Ray runs them back to back.

`RolloutWorker` is the plain class (usable without Ray, and the place to add methods such
as a collective-transport receive); `RolloutActor = ray.remote(RolloutWorker)` is what the
driver creates, with `create_rollout_actors(cfg)` placing it on the `rollout` pool.

Restarts. Ray re-runs the constructor of a restarted actor with the same arguments, so the
constructor loads weights before the actor can generate:
- `weights_ref`: a published record (or an ObjectRef to one) loaded first;
- `latest_weights`: where the newest published record lives, asked next — the name of a
  named Ray actor, or its handle, whose `latest()` method returns a record or None; or any
  zero-argument callable returning one.
A published record is a `common.weights_record.WeightsRecord` (version, weights, checksum).

Sequence parallelism (`pools.rollout.parallel.sp` > 1): the actor is the leader of sp processes
that generate every group together (rollout_worker/sp_group.py); the driver talks to it alone.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import ray
import torch
from torch import Tensor

from common.actor_metrics import exports_generate, exports_weight_load
from common.config import RunConfig, validate
from common.images import resolve_images, reward_images
from common.retry import retry_outage
from common.sde import Schedule
from common.types import Condition, Group, GroupReceipt, Scores
from common.weights import verify
from common.weights_record import StreamedWeights, WeightsRecord
from memory_bank.errors import (
    BankError,
    BankFull,
    BankTooSmall,
    BankUnavailable,
    DuplicateGroup,
    LeaseLost,
)
from reward_worker.actor import RewardClient, RewardFailed, RewardTimeout, actor_names
from rollout_worker.condition_cache import ConditionCache
from rollout_worker.models import build_model
from rollout_worker.models.base import copy_weights
from rollout_worker.models.lora import inject_lora
from rollout_worker.sampler import sample_group, sample_videos
from rollout_worker.sp_group import SPFollowers, group_digest, join_sp_group
from rollout_worker.weight_receiver import BucketGauge, WeightReceiver, load_streamed

log = logging.getLogger(__name__)

LatestWeights = str | Callable[[], WeightsRecord | None] | Any  # actor name, callable, or actor handle


class RolloutWorker:
    """Holds one model and generates groups with it, stamped with the weights' policy version."""

    def __init__(self, cfg: RunConfig | dict, actor_index: int = 0, weights_ref: Any = None,
                 latest_weights: LatestWeights | None = None, rewards: dict[str, list] | None = None,
                 bank: Any = None, sp_rank: int = 0):
        self.cfg = cfg if isinstance(cfg, RunConfig) else validate(cfg, source="rollout actor config")
        torch.set_num_threads(self.cfg.pools.rollout.torch_threads)
        self.actor_index, self.sp_rank = actor_index, sp_rank
        # SP leader: start the followers first, so they build their models while this one does
        self._followers = None
        if sp_rank == 0 and self.cfg.pools.rollout.parallel.sp > 1:
            self._followers = SPFollowers(RolloutActor, self.cfg, actor_index)
        # simulated GPUs (pools.simulated_gpus): Ray's share only, the model stays on the CPU
        self.model = build_model(self.cfg, "cpu" if self.cfg.pools.simulated_gpus else None)
        if self.cfg.optim.finetune == "lora":
            # the learner publishes only the adapter: hold the same (zero-effect) adapter to load it
            inject_lora(self.model.trainable_module(), self.cfg.model.family, self.cfg.optim)
        if self._followers is not None:
            self._followers.join(self.model)  # one process group; the transformers split over it
        self._version = 0
        self._torn: int | None = None  # a version whose load stopped part-way (see _load)
        self._sp_targets = None        # an SP follower's forwarded load in progress (sp_load_begin)
        self._gauge = BucketGauge()    # the receive buckets alive (both transports)
        self._incarnation = uuid.uuid4().hex  # this process: a restart is a new one (see ping)
        self._reward_actors, self._bank_ref = rewards, bank   # the data plane (see deliver)
        self._rewards = self._bank = None                     # connected on first use
        self._staged: dict[str, tuple[Group, int, float]] = {}
        s = self.cfg.sampler  # encoded conditions, reused by a condition's later groups
        self._conds = ConditionCache(s.cond_cache_entries, s.cond_cache_mb * 2**20)
        for record in (_resolve(weights_ref), _fetch_latest(latest_weights)):
            if record is not None:
                self.set_weights(_resolve(record.weights), record.version, record.checksum)

    @exports_generate
    def generate(self, condition: Condition, seed: int, group_id: str | None = None) -> Group:
        self._check_whole()
        follow = self._followers.submit("sp_generate", condition, seed, group_id) if self._followers else []
        group = sample_group(self.model, condition, self.cfg, seed=seed, policy_version=self._version,
                             group_id=group_id, cache=self._conds)
        if self._followers is not None:
            self._followers.check(follow, group_digest(group), f"group {group.group_id}")
        return group

    def _check_whole(self) -> None:
        if self._torn is not None:
            raise RuntimeError(f"rollout actor {self.actor_index}: the load of weights v{self._torn} stopped "
                               f"part-way, so it holds no whole version; it generates after a full load")

    # --- an SP follower's verbs (the leader calls them; see rollout_worker/sp_group.py) ---

    def join_sp(self, host: str, port: int) -> int:
        join_sp_group(self.model, host, port, self.sp_rank, self.cfg.pools.rollout.parallel.sp,
                      self.cfg.sampler.timeout_s)
        return self.sp_rank

    def sp_generate(self, condition: Condition, seed: int, group_id: str | None) -> str:
        """The leader's group, generated in step with it (no decode); returns its digest."""
        self._check_whole()
        group = sample_group(self.model, condition, self.cfg, seed=seed, policy_version=self._version,
                             group_id=group_id, decode=False, cache=self._conds)
        return group_digest(group)

    def sp_sample_videos(self, prompts: list[str], seeds: list[int], scheme: str, images) -> bool:
        self.sample_videos(prompts, seeds, scheme, images, decode=False)
        return True

    def sp_load_begin(self, version: int, names: list[str]) -> None:
        """A collective load the leader forwards bucket by bucket: not whole until sp_load_end."""
        self._sp_targets, self._torn = self.model.weight_targets(names), int(version)

    def sp_load_bucket(self, views: dict[str, Tensor]) -> None:
        copy_weights(self._sp_targets, views)

    def sp_load_end(self, version: int) -> None:
        self._version, self._torn, self._sp_targets = int(version), None, None

    # --- the data plane: generate here, score with the reward pool, push into the bank ---

    def stage(self, condition: Condition, seed: int, group_id: str, cursor: int) -> dict:
        """Generate a group and keep it for `deliver`; returns only its id, version and time."""
        t0 = time.monotonic()
        group = self.generate(condition, seed, group_id)
        seconds = time.monotonic() - t0
        self._staged = {group_id: (group, cursor, seconds)}  # an undelivered older group is dropped
        return {"group_id": group_id, "version": group.policy_version, "seconds": seconds}

    def deliver(self, group_id: str) -> GroupReceipt:
        """Score the staged group with the reward pool and push it into the bank."""
        group, cursor, gen_s = self._staged.pop(group_id)
        frames = group.frames()                                            # uint8 [G, F, H, W, 3]
        rec = GroupReceipt(group_id, group.condition.id, cursor, group.policy_version, actor=self.actor_index,
                           size=group.size, frame_bytes=frames.numel(),
                           latent_bytes=sum(m.nbytes() for m in group.members) - frames.numel()
                           + (group.cond.nbytes() if group.cond is not None else 0),
                           seconds={"generate": gen_s})
        if not self._score(group, frames, rec):
            return rec
        for m in group.members:
            m.frames = None  # the bank does not store frames
        return self._store(group, rec)

    def _score(self, group: Group, frames: Tensor, rec: GroupReceipt) -> bool:
        """Score with the reward pool: the frames go from here to the reward actors through the
        object store. Sets group.scores and composite; False (with `rec` failed) if it cannot."""
        client = self._reward_client()
        before = (sum(client.timeouts.values()), sum(client.failures.values()))
        t0 = time.monotonic()
        try:
            scores = client.score(frames, [group.condition.prompt] * group.size,
                                  reward_images(group.condition, group.size))
        except (RewardFailed, RewardTimeout) as e:
            # a replica Ray is restarting comes back by itself: the driver waits instead of counting it
            self._failed(rec, "reward_restarting" if getattr(e, "restarting", False) else "reward", str(e))
            return False
        finally:
            rec.seconds["score"] = time.monotonic() - t0
            rec.reward_timeouts = sum(client.timeouts.values()) - before[0]
            rec.reward_failures = sum(client.failures.values()) - before[1]
        if not bool(scores.valid.all()):
            rec.invalid_members = int((~scores.valid).sum())
            self._failed(rec, "invalid", f"{rec.invalid_members} members with a non-finite reward")
            return False
        group.scores, group.composite = scores, client.heads.composite(scores)
        return True

    def _store(self, group: Group, rec: GroupReceipt) -> GroupReceipt:
        """Push the scored group into the bank, retried while Redis is unreachable (for up to
        bank.outage_s); every other bank error fails the receipt with its kind."""
        t0, outage_s, retried = time.monotonic(), self.cfg.bank.outage_s, []

        def push() -> None:
            try:
                self._open_bank().push_group(group)
            except DuplicateGroup:
                if not retried:
                    raise
                # a retry after a dropped connection: the first try got through

        try:
            retry_outage(push, outage_s=outage_s, what="push_group", errors=BankUnavailable,
                         on_retry=lambda *_: retried.append(True))
        except BankUnavailable as e:
            return self._failed(rec, "bank_unavailable",
                                f"memory bank unreachable for {outage_s:.0f}s during push_group ({e})")
        except DuplicateGroup as e:
            return self._failed(rec, "bank_error", str(e))
        except BankTooSmall as e:  # one step cannot fit bank.max_bytes: no retry helps
            return self._failed(rec, "fatal", str(e))
        except BankFull as e:  # no room now: the driver waits for space and draws it again
            return self._failed(rec, "bank_full", str(e))
        except LeaseLost as e:  # another run holds the namespace: the driver stops this one
            return self._failed(rec, "lease_lost", str(e))
        except BankError as e:
            return self._failed(rec, "bank_error", str(e))
        rec.seconds["store"] = time.monotonic() - t0
        return rec

    def _failed(self, rec: GroupReceipt, kind: str, detail: str) -> GroupReceipt:
        rec.ok, rec.failure, rec.detail = False, kind, detail.splitlines()[0] if detail else kind
        return rec

    def _reward_client(self):
        if self._rewards is None:
            if not self._reward_actors:
                raise RuntimeError(f"rollout actor {self.actor_index} was created without reward actors: "
                                   "pass rewards= to score and push groups itself")
            models = self.cfg.rewards.models
            self._rewards = RewardClient(self._reward_actors, dict(zip(actor_names(models), models, strict=True)),
                                         offset=self.actor_index)
        return self._rewards

    def _open_bank(self):
        if self._bank is None:
            if self._bank_ref is None:
                raise RuntimeError(f"rollout actor {self.actor_index} was created without a bank reference")
            self._bank = self._bank_ref.open()
            self._bank.expect_step(self.cfg.train.groups_per_step)  # a step that cannot fit: refused at once
        return self._bank

    @exports_weight_load
    def set_weights(self, payload: dict[str, Tensor] | StreamedWeights, version: int,
                    checksum: str | None = None) -> bool:
        """Load a payload if its version is newer than ours; a stale push is ignored (returns False).
        A streamed payload is checked and loaded bucket by bucket (weight_receiver.load_streamed)."""
        if version <= self._version and self._torn is None:
            log.info("rollout %d: ignoring weights v%d (holding v%d)", self.actor_index, version, self._version)
            return False
        who = f"rollout actor {self.actor_index} weights v{version}"
        if not isinstance(payload, StreamedWeights):
            verify(payload, checksum, who=who)
        # SP followers load the same payload themselves (a streamed one from the object store)
        follow = self._followers.submit("set_weights", payload, version, checksum) if self._followers else []
        if isinstance(payload, StreamedWeights):
            names = [e["name"] for e in payload.manifest["entries"]]
            timeout = self.cfg.weight_sync.timeout_s
            return self._load(version, names, lambda sink: load_streamed(
                payload, checksum, sink, self.model.device, who, self._gauge, timeout), follow)
        return self._load(version, list(payload), lambda sink: sink(payload), follow)

    def _load(self, version: int, names: list[str], run: Callable, follow: list | None = None) -> bool:
        """Run `run(sink)`, which feeds every bucket to `sink`; the version changes once all are in.
        A failure after the first bucket leaves a partial load: the actor refuses to generate
        until a whole version is loaded (`_torn`). SP followers: `follow` are their own loads
        (waited for here); None forwards every bucket to them (the collective transport, which
        only the leader receives)."""
        targets = self.model.weight_targets(names)  # unknown keys: refused before any bucket loads
        loaded, fw = [], self._followers if follow is None else None
        if fw is not None:
            follow = fw.submit("sp_load_begin", version, names)

        def sink(views: dict[str, Tensor]) -> None:
            loaded.append(len(views))
            copy_weights(targets, views)
            if fw is not None:  # serialized now, so the receive buffer may be reused; a compact copy of
                # each view (a view of the bucket would pickle the whole bucket's storage with it)
                bucket = {k: v.detach().to("cpu", copy=True) for k, v in views.items()}
                follow.extend(fw.submit("sp_load_bucket", bucket))

        try:
            run(sink)
            if fw is not None:
                follow.extend(fw.submit("sp_load_end", version))
            if self._followers is not None:
                self._followers.wait(follow)
        except BaseException:
            if loaded or self._followers is not None:  # an SP group whose ranks may differ is not whole
                self._torn = int(version)
            raise
        self._version, self._torn = int(version), None
        return True

    def version(self) -> int:
        return self._version

    def sample_videos(self, prompts: list[str], seeds: list[int], scheme: str = "ode",
                      images: list[str] | Tensor | None = None, decode: bool = True) -> Tensor:
        """Evaluation videos with the current weights, one per (prompt, seed) (I2V: `images`, a
        first-frame path per video, read here). uint8 [B, F, H, W, 3]"""
        m = self.cfg.model
        follow = self._followers.submit("sp_sample_videos", prompts, seeds, scheme, images) \
            if self._followers else []
        out = sample_videos(self.model, prompts, seeds, Schedule.from_config(self.cfg.schedule), scheme,
                            images=resolve_images(images, len(prompts), m.height, m.width),
                            forward_batch_size=self.cfg.sampler.forward_batch_size, decode=decode)
        if self._followers is not None:
            self._followers.wait(follow)
        return out

    def evaluate_pairs(self, prompts: list[str], seeds: list[int], images: list[str] | None = None,
                       keep: Sequence[int] = (), weights: WeightsRecord | None = None) -> tuple[Scores, dict[int, Tensor]]:
        """ODE videos of the pairs, scored here with the reward pool (the frames go to the reward
        actors through the object store, as in `deliver`). Returns the Scores [B, H] and, for the
        positions in `keep` only, the frames uint8 [F, H, W, 3] (what the caller renders).
        `weights`: sample with these instead of the held version, for this call alone (`evaluating`).
        A reward model that fails raises RewardFailed / RewardTimeout naming it."""
        with self.evaluating(weights):
            frames = self.sample_videos(prompts, seeds, "ode", images)
        scores = self._reward_client().score(frames, list(prompts), images)
        # clone: a view would carry the whole batch's storage with it when pickled
        return scores, {j: frames[j].clone() for j in keep}

    @contextmanager
    def evaluating(self, record: WeightsRecord | None) -> Iterator[None]:
        """Inside the block the model holds `record`'s weights (None: no change); after it, the
        held version's weights again, bit for bit, and the version never changes: rollouts never
        sample them. For an evaluation of a policy the rollouts do not sample (DiffusionNFT's θ,
        while they sample v_old). The held weights wait on the CPU; SP followers swap in step."""
        if record is None:
            yield
            return
        self._check_whole()
        held = self._swap_in(record)
        try:
            if self._followers is not None:
                self._followers.wait(self._followers.submit("sp_eval_begin", record))
            yield
        finally:
            copy_weights(*held)
            if self._followers is not None:
                self._followers.wait(self._followers.submit("sp_eval_end"))

    def _swap_in(self, record: WeightsRecord) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """Load `record` (checked as set_weights checks it); returns (targets, their held values on the CPU)."""
        payload = _resolve(record.weights)
        names = [e["name"] for e in payload.manifest["entries"]] if isinstance(payload, StreamedWeights) else list(payload)
        targets = self.model.weight_targets(names)
        held = {k: t.detach().to("cpu", copy=True) for k, t in targets.items()}
        who = f"rollout actor {self.actor_index} evaluation weights v{record.version}"
        try:
            if isinstance(payload, StreamedWeights):
                load_streamed(payload, record.checksum, lambda views: copy_weights(targets, views), self.model.device,
                              who, self._gauge, self.cfg.weight_sync.timeout_s)
            else:
                verify(payload, record.checksum, who=who)
                copy_weights(targets, payload)
        except BaseException:
            copy_weights(targets, held)  # a failed load leaves the held version whole
            raise
        return targets, held

    def sp_eval_begin(self, record: WeightsRecord) -> None:
        """An SP follower's side of `evaluating`: load the record, keep the held weights."""
        self._eval_held = self._swap_in(record)

    def sp_eval_end(self) -> None:
        held, self._eval_held = getattr(self, "_eval_held", None), None
        if held is not None:  # None: its sp_eval_begin failed and restored the held weights itself
            copy_weights(*held)

    # --- the collective weight transport (learner/weight_sync.py is the sending side) ---

    def join_weight_group(self, host: str, port: int, prefix: str, rank: int, world_size: int,
                          backend: str, timeout_s: float) -> int:
        """Join the publisher's weight group as `rank`; returns once the group is built."""
        if getattr(self, "_receiver", None) is None:
            self._receiver = WeightReceiver()
        self._receiver.join(host, port, prefix, rank, world_size, backend, timeout_s)
        return rank

    def receive_weights(self, version: int, manifest: dict) -> bool:
        """Take part in the broadcast of `version` and load it bucket by bucket, as set_weights
        does (stale: drained, not loaded; a bucket whose digest differs: refused)."""
        receiver = getattr(self, "_receiver", None)
        if receiver is None:
            raise RuntimeError(f"rollout actor {self.actor_index}: receive_weights before join_weight_group")
        receiver.gauge = self._gauge
        if int(manifest.get("version", -1)) != version:
            receiver.receive(manifest, None, self.model.device)  # drained: the group stays in step
            raise ValueError(f"rollout actor {self.actor_index}: manifest says v{manifest.get('version')}, "
                             f"call says v{version}")
        if version <= self._version and self._torn is None:
            receiver.receive(manifest, None, self.model.device)
            return False
        names = [e["name"] for e in manifest["entries"]]
        try:
            self.model.weight_targets(names)
        except KeyError:
            receiver.receive(manifest, None, self.model.device)
            raise
        return self._load(version, names, lambda sink: receiver.receive(manifest, sink, self.model.device))

    def weight_buckets(self, reset: bool = False) -> dict:
        """The receive buckets' bytes and count: alive now and at most at once (since `reset`)."""
        g = self._gauge
        out = {"live_bytes": g.live, "peak_bytes": g.peak, "live": g.count, "peak": g.peak_count}
        if reset:
            g.reset()
        return out

    def ping(self) -> dict:
        """Who answers: the index, the version held, the process's incarnation (a restarted actor
        answers with a new one, so a caller can tell it is not the process it knew) and its SP
        degree; an SP leader adds every rank's (version, degree)."""
        from rollout_worker.models.sp import sp_degree  # heavy: diffusers

        out = {"actor_index": self.actor_index, "version": self._version, "family": self.model.family,
               "incarnation": self._incarnation, "sp": sp_degree(self.model.transformers())}
        if self._followers is not None:  # every rank of the SP group answers: its version and degree
            answers = self._followers.wait(self._followers.submit("ping"))
            out["sp_ranks"] = [(self._version, out["sp"])] + [(p["version"], p["sp"]) for p in answers]
        return out


RolloutActor = ray.remote(RolloutWorker)


def create_rollout_actors(cfg: RunConfig, *, count: int | None = None, weights_ref: Any = None,
                          latest_weights: LatestWeights | None = None) -> list:
    """`count` (default pools.rollout.num_actors) actors on the `rollout` resource, sized by the pool."""
    pool = cfg.pools.rollout
    n = pool.num_actors if count is None else count  # SP leaders; each starts sp - 1 followers
    return [RolloutActor.options(resources={"rollout": 1}, num_cpus=pool.num_cpus, num_gpus=pool.num_gpus,
                                 max_restarts=pool.max_restarts)
            .remote(cfg, i, weights_ref, latest_weights) for i in range(n)]


def _resolve(ref: Any) -> Any:
    return ray.get(ref) if isinstance(ref, ray.ObjectRef) else ref


def _fetch_latest(source: LatestWeights | None) -> WeightsRecord | None:
    if source is None:
        return None
    if isinstance(source, str):
        source = ray.get_actor(source)
    if isinstance(source, ray.actor.ActorHandle):
        return _resolve(ray.get(source.latest.remote()))
    if callable(source):
        return _resolve(source())
    raise TypeError(f"latest_weights must be an actor name, an actor handle or a callable, got {type(source)}")
