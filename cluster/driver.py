"""The one controller loop: generate → score → store → train → publish.

`sync` runs the stages in turn. `async` runs generate → score → store in a producer thread
that stays at most `train.max_staleness` versions ahead of the learner: it pauses when ahead
(samples are never dropped) and respects the bank's backpressure. Before a rollout actor
generates again it holds the newest published version.

Roles never call each other; only this module wires them.

Failures. A rollout or reward actor that dies is restarted by Ray and its work is refilled;
Redis outages are retried with backoff for `bank.outage_s`, then the run stops cleanly; a dead
learner or a weight-sync timeout stops the run with one clear line (`stop_reason`). Every group
drawn from the prompt stream is tracked in `open` (cursor -> group id) until it is trained, so
a checkpoint records exactly which groups a resume must keep in the bank or draw again.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from cluster.datasets import check_task, reward_images, side_by_side
from cluster.health import group_spread
from cluster.health_hook import DriverHealth
from cluster.prompts import load_prompts
from cluster.run_dir import RunDir
from cluster.step_record import StepExporter, step_record
from cluster.tracking import eval_grid, step_videos
from cluster.weight_registry import remote_registry
from common.config import RunConfig
from common.metrics import Metrics
from common.types import Condition, Group

log = logging.getLogger("vgrpo.driver")

SEED_SPACE = 1_000_000  # training seeds stay below the toy world's evaluation seeds
MAX_FAILED_IN_ROW = 12  # groups failing one after another (dead actor, broken reward): stop


def group_id(cursor: int, version: int) -> str:
    """Group ids carry the prompt-stream cursor they were drawn at (see cursor_of)."""
    return f"g{cursor:07d}-v{version}"


def cursor_of(gid: str) -> int | None:
    head = gid.split("-", 1)[0]
    return int(head[1:]) if head[:1] == "g" and head[1:].isdigit() else None


class StopRun(Exception):
    """Raised inside the loop when the run cannot go on (the reason is in the message)."""


class Driver:
    def __init__(self, cfg: RunConfig, run_dir: RunDir, console=None):
        self.cfg, self.run_dir, self.console = cfg, run_dir, console
        self.step = 0                 # optimizer steps done == the learner's policy version
        self.cursor = 0               # groups drawn from the prompt stream so far
        self.stop_requested = threading.Event()
        self.timers: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self.lock = threading.Lock()
        self.latest: tuple[int, Any] | None = None   # (version, payload ref) not yet published
        self.actor_version: list[int] = []
        self.metrics = Metrics(backend="memory", role="driver", pool="driver")
        self.exporter = StepExporter(self.metrics, {})
        self.open: dict[int, str | None] = {}   # drawn, not yet trained: cursor -> pushed group id
        self.replay: list[int] = []             # cursors a resume draws again before new ones
        self.uncommitted: list[str] = []        # trained, but Redis was down for the commit
        self.failed_in_row = 0
        self.stop_reason: str | None = None     # why the run stopped early (None: finished or Ctrl-C)
        self.learner_lost = False
        self.health = DriverHealth(cfg, run_dir, self.note, StopRun)  # training health (cluster/health.py)

    # --- 1. set-up ---------------------------------------------------------------------------

    def setup(self, resume: Path | None = None) -> None:
        import ray

        from cluster.pools import actor_options, in_group, init_ray, placement_group_for
        from learner.actor import LearnerGroup
        from memory_bank.connect import connect_bank
        from memory_bank.ownership import claim_namespace
        from reward_worker.actor import RewardClient, actor_names, create_reward_actors
        from rollout_worker.actor import RolloutActor

        cfg = self.cfg
        check_model_path(cfg)
        self.conditions = load_prompts(cfg.train.prompts)
        check_task(self.conditions, cfg.model.task, cfg.train.prompts)
        # 1. Ray: join RAY_ADDRESS or start a local cluster that declares the role resources
        self.ray_handle = init_ray(cfg)
        self.metrics = Metrics.auto(role="driver", pool="driver")
        self.exporter = StepExporter(self.metrics, {r: Metrics.auto(role=r, pool=r)
                                                    for r in ("rollout", "reward", "learner")})
        # 2. the memory bank: a configured Redis, or an embedded redis-server for this run
        self.bank, self.redis = connect_bank(cfg.bank, data_dir=self.run_dir.path / "redis")
        self.lease = claim_namespace(self.bank, str(self.run_dir.path.resolve()), resume=resume is not None)
        self.bank.expect_step(cfg.train.groups_per_step)  # one step's groups must fit bank.max_bytes
        # 3. pools: a placement group keeps the rollout pool's actors together
        n_roll = max(1, cfg.pools.rollout.num_actors)
        self.rollout_pg = placement_group_for(cfg.pools.rollout, "rollout", n_roll)
        if self.rollout_pg is not None:
            ray.get(self.rollout_pg.ready(), timeout=300)
        self.registry = remote_registry().options(name=f"vgrpo-weights-{id(self):x}", num_cpus=0).remote()
        self.rollouts = [
            RolloutActor.options(**actor_options(cfg.pools.rollout, "rollout", **in_group(self.rollout_pg, i)))
            .remote(cfg, i, None, self.registry) for i in range(n_roll)]
        self.actor_version = [0] * n_roll
        reward_actors = create_reward_actors(cfg.rewards.models, cfg.pools.reward)
        self.rewards = RewardClient(reward_actors, dict(zip(actor_names(cfg.rewards.models),
                                                            cfg.rewards.models, strict=True)))
        self.learner = LearnerGroup(cfg)
        # 4. resume, or start from version 0 (every role built the same base weights)
        if resume is not None:
            self._restore(resume)
        ray.get([a.ping.remote() for a in self.rollouts], timeout=600)

    def _restore(self, ckpt: Path) -> None:
        """Learner state (weights, optimizer, λ_KL controller, RNG), step, data cursor, counters,
        the bank's per-condition entries; then reconcile the fresh queue with the stream."""
        from memory_bank.dump import restore_bank
        from memory_bank.dump import step_dir as bank_step_dir

        extra = self.learner.load_checkpoint(ckpt)
        self.note(restore_bank(self.bank, bank_step_dir(ckpt, int(extra["step"]))))  # before any requeue
        self.step = int(extra["step"])
        self.cursor = int(extra["cursor"])
        self.counts.update({k: int(v) for k, v in (extra.get("counts") or {}).items()})
        self.bank.requeue_pending()
        self._finish_commit(extra.get("uncommitted") or [])
        if extra.get("bank"):
            self.bank.restore(extra["bank"])
        # Groups still queued are trained as they are; groups drawn but not queued (in flight at the
        # checkpoint, or trained only by the lost run after it) are drawn again from their cursors.
        queued = self.bank.queued_ids()
        present = {c: g for g in queued if (c := cursor_of(g)) is not None}
        top = max([self.cursor - 1, *present]) + 1
        opened = {int(c) for c in (extra.get("open") or {})}
        self.replay = sorted((opened | set(range(self.cursor, top))) - set(present))
        self.cursor = top
        self.open = {**{c: None for c in self.replay}, **present}
        self.counts["groups_produced"] = self.counts["groups_trained"] + len(queued)
        self.counts["groups_pulled"] = self.counts["groups_trained"]  # pending groups were requeued
        self.run_dir.truncate_metrics(self.step)
        self._publish_now(self.step)
        self.note(f"resumed from {ckpt} at step {self.step}: {len(queued)} groups queued, "
                  f"{len(self.replay)} drawn again")

    def _finish_commit(self, gids: list[str]) -> None:
        """Groups the saved learner already trained, whose commit Redis missed: commit them now."""
        if not gids:
            return
        from common.types import TrainBatch

        batch = self.bank.pull(len(gids), self.step)
        keep = [i for i, g in enumerate(batch.fresh) if g.group_id in set(gids)]
        self.bank.commit(TrainBatch(fresh=[batch.fresh[i] for i in keep],
                                    bank=[batch.bank[i] for i in keep], version=self.step), self.step)
        self.bank.requeue_pending()  # anything else pulled goes back
        self.note(f"committed {len(keep)} groups trained before the last stop")

    # --- 2. stages ---------------------------------------------------------------------------

    def next_condition(self) -> tuple[Condition, int, int]:
        """The prompt stream: an epoch-wise permutation of the prompts, a seed per group, the cursor."""
        with self.lock:
            if self.replay:
                n = self.replay.pop(0)
            else:
                n = self.cursor
                self.cursor += 1
            self.open[n] = None
        epoch, i = divmod(n, len(self.conditions))
        order = np.random.default_rng([self.cfg.train.seed, epoch]).permutation(len(self.conditions))
        seed = int(np.random.default_rng([self.cfg.train.seed, 7, n]).integers(SEED_SPACE))
        return self.conditions[order[i]], seed, n

    def _abandon(self, n: int) -> None:
        """A drawn group that failed before it was stored: the stream refills it with a new cursor."""
        with self.lock:
            self.open.pop(n, None)
        self.failed_in_row += 1
        if self.failed_in_row >= MAX_FAILED_IN_ROW:
            raise StopRun(f"{self.failed_in_row} groups in a row failed to generate or score; "
                          "see the log for each failure")

    def generate_round(self, n: int) -> list[Group]:
        """Up to n groups, one per rollout actor at a time, scored and stored; failed groups refilled."""
        import ray

        stored: list[Group] = []
        while len(stored) < n and not self.stop_requested.is_set():
            self._publish_pending()
            calls = {}
            for i, actor in enumerate(self.rollouts[: n - len(stored)]):
                cond, seed, cursor = self.next_condition()
                gid = group_id(cursor, self.actor_version[i])
                calls[actor.generate.remote(cond, seed, gid)] = (i, cursor)
            t0 = time.monotonic()
            deadline = t0 + self.cfg.sampler.timeout_s
            pending = list(calls)
            while pending:
                # score each group as soon as its actor returns it
                ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
                if not ready:
                    self._on_rollout_timeout([calls[r] for r in pending])
                    break
                ref = ready[0]
                i, cursor = calls[ref]
                try:
                    group = ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    self._on_rollout_failure(i, e)
                    self._abandon(cursor)
                    continue
                if not pending:
                    self.timers["generate"] += time.monotonic() - t0
                if self._score_and_store(group):
                    with self.lock:
                        self.open[cursor] = group.group_id
                    self.failed_in_row = 0
                    stored.append(group)
                else:
                    self._abandon(cursor)
        return stored

    def _on_rollout_timeout(self, late: list[tuple[int, int]]) -> None:
        """Rollout actors past sampler.timeout_s (a hung device, a stuck kernel): restart them."""
        import ray

        for i, cursor in late:
            self.counts["rollout_timeouts"] += 1
            self.metrics.inc("vgrpo_errors_total", 1, kind="rollout_timeout")
            self.note(f"rollout actor {i} did not return a group within {self.cfg.sampler.timeout_s:.0f}s "
                      "(sampler.timeout_s); restarting it")
            ray.kill(self.rollouts[i], no_restart=False)  # Ray starts a fresh process
            self._on_rollout_failure(i, TimeoutError("sampler.timeout_s"))
            self._abandon(cursor)

    def _on_rollout_failure(self, i: int, err: Exception) -> None:
        """A rollout actor died: Ray restarts it; it gets the current weights before it generates."""
        if self.actor_version[i] != -1:  # the first failure since it last took weights: one restart
            self.counts["actor_restarts"] += 1  # exported with the step's record
            self.note(f"rollout actor {i} failed ({type(err).__name__}); it restarts and reloads weights")
        else:  # calls to an actor that is still restarting fail at once (ActorUnavailableError)
            log.debug("rollout actor %d still restarting (%s)", i, type(err).__name__)
        self.actor_version[i] = -1  # forces a publish to it before its next group
        # while Ray restarts it, calls fail at once: back off instead of burning refills
        time.sleep(min(0.25 * (self.failed_in_row + 1), 5.0))

    def _score_and_store(self, group: Group) -> bool:
        """Score and push one group; False when it must be refilled (nothing of it is stored)."""
        from reward_worker.actor import RewardFailed, RewardTimeout

        t0 = time.monotonic()
        try:
            scores = self.rewards.score(group.frames(), [group.condition.prompt] * group.size,
                                        reward_images(group.condition, group.size))
        except (RewardFailed, RewardTimeout) as e:
            self.counts["groups_refilled"] += 1
            self.note(f"reward failed for group {group.group_id} ({e}); refilling")
            return False
        finally:
            self.timers["score"] += time.monotonic() - t0
        if not bool(scores.valid.all()):
            self.counts["groups_refilled"] += 1
            self.counts["invalid_members"] += int((~scores.valid).sum())
            self.metrics.inc("vgrpo_invalid_rewards_total", int((~scores.valid).sum()), head="any")
            return False  # a group with an invalid member is refilled, never half-trained
        group.scores = scores
        group.composite = self.rewards.composite(scores)
        t0 = time.monotonic()
        while not (self._bank("wait_for_space", self.bank.wait_for_space, timeout_s=5.0)
                   and self._bank("push_group", self._push, group)):  # False: full, wait again
            if self.stop_requested.is_set():
                return False
        self.timers["store"] += time.monotonic() - t0
        self.counts["groups_produced"] += 1
        self.counts["videos"] += group.size
        return True

    def _push(self, group: Group) -> bool:
        from memory_bank.errors import BankFull, DuplicateGroup

        try:
            self.bank.push_group(group)
        except BankFull:
            return False
        except DuplicateGroup:
            if not getattr(self, "_pushing_again", False):
                raise
            # a retry after a dropped connection: the first try got through
        finally:
            self._pushing_again = False
        return True

    def _pull(self, n: int, version: int):
        self.bank.requeue_pending()  # a pull whose answer was lost left its groups pending
        return self.bank.pull(n, version)

    def _bank(self, what: str, fn, *args, **kw):
        """A bank call retried with backoff while Redis is unreachable, for up to bank.outage_s."""
        from memory_bank.errors import BankUnavailable

        deadline, delay = time.monotonic() + self.cfg.bank.outage_s, 0.25
        while True:
            try:
                return fn(*args, **kw)
            except BankUnavailable as e:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StopRun(f"memory bank unreachable for {self.cfg.bank.outage_s:.0f}s during {what} "
                                  f"({e}); stopping") from None
                self.metrics.inc("vgrpo_errors_total", 1, kind="redis_unreachable")
                log.warning("%s; retrying %s in %.1fs (%.0fs left)", e, what, min(delay, left), left)
                time.sleep(min(delay, left))
                delay = min(delay * 2, 5.0)
                self._pushing_again = what == "push_group"

    def train(self) -> dict[str, float]:
        """Pull fresh groups (plus bank entries of their conditions), take one optimizer step."""
        import ray

        t0 = time.monotonic()
        batch = self._bank("pull", self._pull, self.cfg.train.groups_per_step, self.step)
        if not batch.fresh:
            raise StopRun("the bank returned no fresh groups to train on")
        self.counts["groups_pulled"] += len(batch.fresh)
        try:
            stats = self.learner.train_step(batch)
        except ray.exceptions.RayActorError as e:
            self.learner_lost = True  # its pulled groups stay pending; a resume requeues them
            raise StopRun(f"the learner died ({type(e).__name__}); continue from the last checkpoint "
                          f"with: vgrpo resume {self.run_dir.path}") from None
        with self.lock:
            for g in batch.fresh:
                self.open.pop(cursor_of(g.group_id), None)
        self.counts["groups_trained"] += len(batch.fresh)
        staleness = [self.step - g.policy_version for g in batch.fresh]
        self.step += 1
        try:
            self._bank("commit", self.bank.commit, batch, self.step)
        except StopRun:
            self.uncommitted = [g.group_id for g in batch.fresh]  # the checkpoint commits them on resume
            raise
        self.timers["train"] += time.monotonic() - t0
        values = dict(stats.values)
        values["staleness_mean"] = float(np.mean(staleness))
        values["staleness_max"] = float(np.max(staleness))
        values["bank_entries_used"] = float(sum(len(b) for b in batch.bank))
        rewards = np.stack([g.composite.numpy() for g in batch.fresh])
        values["reward_mean"] = float(rewards.mean())
        for h_i, h in enumerate(batch.fresh[0].scores.heads):
            values[f"reward/{h}"] = float(np.mean([g.scores.values[:, h_i].mean().item() for g in batch.fresh]))
        values.update(group_spread(batch.fresh))  # health: zero-spread share per head
        return values

    def publish(self) -> None:
        """Make the learner's newest weights the version rollout actors load before generating again."""
        if self.cfg.weight_sync.transport == "object_store":
            ref = self.learner.weights_payload_ref()  # stays in the object store; no copy here
            self.registry.set.remote(self.step, [ref])
        else:
            ref = None
        with self.lock:
            self.latest = (self.step, ref)

    def _publish_pending(self) -> None:
        """Called by the producer between rounds, when the rollout actors are idle."""
        with self.lock:
            latest = self.latest
        if latest is not None and any(v < latest[0] for v in self.actor_version):
            self._publish_now(*latest)

    def _publish_now(self, version: int, ref=None) -> None:
        import ray

        t0 = time.monotonic()
        if self.cfg.weight_sync.transport == "object_store":
            if ref is None:
                ref = self.learner.weights_payload_ref()
                self.registry.set.remote(version, [ref])
            checksum = None
            if self.cfg.weight_sync.checksum:
                from common.weights import checksum as digest

                checksum = digest(ray.get(ref))
            calls = [a.set_weights.remote(ref, version, checksum) for a in self.rollouts]
            timeout = self.cfg.weight_sync.timeout_s
            _, late = ray.wait(calls, num_returns=len(calls), timeout=timeout)
            if late:
                who = ", ".join(f"rollout actor {calls.index(c)}" for c in late)
                raise StopRun(f"weight sync of version {version} timed out: {who} did not answer "
                              f"within {timeout}s (weight_sync.timeout_s)")
            held = []
            for i, c in enumerate(calls):
                try:
                    ray.get(c)
                    held.append(version)
                except ray.exceptions.RayActorError as e:  # restarting: it loads the registry's weights
                    self._on_rollout_failure(i, e)
                    held.append(-1)
                except ray.exceptions.RayTaskError as e:
                    self._learner_check()
                    raise StopRun(f"weight sync of version {version} failed on rollout actor {i}: "
                                  f"{e.cause if getattr(e, 'cause', None) else e}") from None
            self.actor_version = held
        else:
            try:
                self.learner.publish(self.rollouts)
            except ray.exceptions.RayError as e:
                cause = getattr(e, "cause", None) or e  # WeightSyncTimeout names the late peer
                self._learner_check()
                raise StopRun(f"weight sync of version {version} failed: {type(cause).__name__}: "
                              f"{str(cause).splitlines()[0] if str(cause) else ''}") from None
            self.actor_version = [version] * len(self.rollouts)
        seconds = time.monotonic() - t0
        self.timers["publish"] += seconds
        self.metrics.observe("vgrpo_weight_sync_seconds", seconds)

    def _learner_check(self) -> None:
        """Mark the learner lost when its ranks no longer answer (no checkpoint can be written)."""
        import ray

        try:
            ray.get([r.version.remote() for r in self.learner.ranks], timeout=30)
        except Exception:
            self.learner_lost = True

    # --- 3. the loops ------------------------------------------------------------------------

    def run(self, progress=None) -> None:
        self.t_start = time.monotonic()
        self.videos_at_start = self.counts["videos"]
        prev = signal.signal(signal.SIGINT, self._on_sigint) if threading.current_thread() is threading.main_thread() else None
        try:
            self.health.heldout(self, start=True)  # health: the held-out baseline
            if self.cfg.train.mode == "sync":
                self._run_sync(progress)
            else:
                self._run_async(progress)
        except StopRun as e:
            # a clean stop: the caller writes a checkpoint (unless the learner is gone)
            self.stop_reason = str(e)
            self.stop_requested.set()
            log.error("run stopped at step %d: %s", self.step, e)
            self.note(f"stopping at step {self.step}: {e}")
        finally:
            if prev is not None:
                signal.signal(signal.SIGINT, prev)

    def _on_sigint(self, signum, frame) -> None:
        if self.stop_requested.is_set():
            raise KeyboardInterrupt
        self.stop_requested.set()
        self.note("Ctrl-C: finishing the current step, then writing a checkpoint (Ctrl-C again to abort)")

    def _run_sync(self, progress) -> None:
        gps = self.cfg.train.groups_per_step
        while self.step < self.cfg.train.steps and not self.stop_requested.is_set():
            queued = self.counts["groups_produced"] - self.counts["groups_trained"]  # > 0 after a resume
            self.generate_round(max(0, gps - queued))
            if self.stop_requested.is_set():
                break
            self._after_step(self.train(), progress)
            self.publish()
            self._publish_pending()
            self.health.heldout(self)  # health: every health.eval_every steps

    def _run_async(self, progress) -> None:
        gps, ahead = self.cfg.train.groups_per_step, max(1, self.cfg.train.max_staleness)
        error: list[BaseException] = []
        produced = threading.Condition()

        def producer() -> None:
            try:
                while not self.stop_requested.is_set():
                    with produced:
                        # stay at most `ahead` steps of groups in front of the learner; groups the
                        # learner has pulled no longer count, so the next ones are made meanwhile
                        while (self.counts["groups_produced"] - self.counts["groups_pulled"] >= ahead * gps
                               and not self.stop_requested.is_set()):
                            produced.wait(timeout=0.5)
                    if self.stop_requested.is_set():
                        break
                    self.generate_round(min(gps, len(self.rollouts)))
                    with produced:
                        produced.notify_all()
            except BaseException as e:  # surfaced in the main thread
                error.append(e)
                self.stop_requested.set()
                with produced:
                    produced.notify_all()

        thread = threading.Thread(target=producer, name="vgrpo-producer", daemon=True)
        thread.start()
        try:
            while self.step < self.cfg.train.steps and not self.stop_requested.is_set():
                with produced:
                    while (self.counts["groups_produced"] - self.counts["groups_pulled"] < gps
                           and not self.stop_requested.is_set()):
                        produced.wait(timeout=0.5)
                if self.stop_requested.is_set():
                    break
                record = self.train()
                with produced:
                    produced.notify_all()
                self._after_step(record, progress)
                self.publish()
                self.health.heldout(self)  # health: with the weights the actors hold now
        finally:
            self.stop_requested.set()
            with produced:
                produced.notify_all()
            thread.join(timeout=600)
        if error:
            raise error[0]

    def _after_step(self, stats: dict[str, Any], progress) -> None:
        from memory_bank.errors import BankUnavailable

        try:  # the step is logged even when Redis just went away; the next bank call decides
            bank = self.bank.stats()
        except BankUnavailable:
            bank = None
        record = step_record(self.step, time.monotonic() - self.t_start, stats, self.counts, self.timers,
                             self.videos_at_start, bank)
        self.health.on_step(record, self.metrics)  # health: checks, and their keys in the row
        self.run_dir.log(record)
        self.exporter.export(record, self.counts)
        if progress is not None:
            progress.update(record)
        if self.step % 5 == 0 or self.step == self.cfg.train.steps:
            self.run_dir.plot_rewards(self.heads())
        step_videos(self)  # every log.video_every steps: the fixed eval pairs as one video
        if self.step % self.cfg.train.checkpoint_every == 0:
            self.checkpoint()
        self.health.raise_if_stopped()  # health: a `stop` finding ends the run (the caller checkpoints)

    def heads(self) -> list[str]:
        return [h for hs in self.rewards.head_names.values() for h in hs]

    # --- 4. evaluation ------------------------------------------------------------------------

    def evaluate(self, label: str, gifs: int = 4):
        """ODE samples on the fixed (prompt, seed) evaluation pairs, scored by the reward role."""
        from cluster.evaluate import EvalResult, sample_pairs
        from cluster.media import write_gif
        from common.toyworld import eval_seeds

        self._publish_pending()
        conds = load_prompts(self.cfg.train.eval_prompts)
        check_task(conds, self.cfg.model.task, self.cfg.train.eval_prompts)
        seeds = eval_seeds(self.cfg.train.eval_seeds)
        pairs = [(c.prompt, s) for c in conds for s in seeds]
        images = [c.image_path for c in conds for _ in seeds] if conds[0].is_i2v else None  # by path
        t0 = time.monotonic()
        frames = sample_pairs(self.rollouts, pairs, images)
        scores = self.rewards.score(frames, [p for p, _ in pairs], images)
        composite = self.rewards.composite(scores)
        result = EvalResult(scores.heads, scores.values.numpy(), composite.numpy())
        self.eval_frames = getattr(self, "eval_frames", {}) | {label: (frames.numpy(), len(seeds))}  # before_after.png
        for i in range(min(gifs, len(pairs))):
            k = i * len(seeds)  # the first seed of each prompt
            video = side_by_side(frames[k].numpy(), conds[i], self.cfg.model)  # I2V: first frame beside it
            name = conds[i].name or pairs[k][0].replace(' ', '_')  # a dataset row's id, else the prompt
            write_gif(video, self.run_dir.samples / f"{label}_{i}_{name}.gif")
        self.run_dir.log_video(f"videos/{label}", eval_grid(frames.numpy(), len(seeds), self.cfg.log.video_pairs), self.step)
        self.note(f"evaluation '{label}': {len(pairs)} videos in {time.monotonic() - t0:.1f}s, "
                  f"composite {composite.mean():.3f}")
        return result

    # --- 5. checkpoints and teardown ---------------------------------------------------------

    def checkpoint(self) -> Path | None:
        """Learner state plus what a resume needs: step, cursor, open groups, counters, the bank's
        watermark. None when the learner is gone (the last checkpoint stands)."""
        from safetensors.torch import save_file

        from memory_bank.dump import dump_bank
        from memory_bank.errors import BankUnavailable

        if self.learner_lost:
            self.note("no checkpoint: the learner is gone; the last checkpoint stands")
            return None
        with self.lock:
            extra = {"step": self.step, "cursor": self.cursor, "open": {str(c): g for c, g in self.open.items()},
                     "counts": dict(self.counts), "uncommitted": list(self.uncommitted)}
        try:
            extra["bank"] = self.bank.snapshot()
        except BankUnavailable as e:  # the bank's own entries stay in Redis (AOF); resume requeues
            extra["bank"] = None
            self.note(f"checkpoint without a bank watermark: {e}")
        path = self.learner.save_checkpoint(self.run_dir.checkpoints, extra)
        if (lost := dump_bank(self.bank, path)) is not None:  # the bank's data rides along
            self.note(lost)
        # the published weights too, so `vgrpo eval/sample` can load the policy without the learner
        payload = {k: v.contiguous() for k, v in self.learner.weights_payload().items()}
        save_file(payload, str(path / "policy.safetensors"))
        self.note(f"checkpoint written: {path}")
        return path

    def teardown(self) -> None:
        from common.actors import kill_and_wait

        if getattr(self, "learner", None) is not None:
            try:
                self.learner.shutdown()
            except Exception as e:  # teardown goes on; the next step frees what is left
                log.warning("teardown: %s", e)
        actors = [*getattr(self, "rollouts", []), *getattr(getattr(self, "rewards", None), "actors", {}).values()]
        if getattr(self, "registry", None) is not None:
            actors.append(self.registry)
        kill_and_wait(actors)
        if getattr(self, "rollout_pg", None) is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.rollout_pg)
        if getattr(self, "lease", None) is not None:
            self.lease.release()
        if getattr(self, "redis", None) is not None:
            self.redis.stop()
        if getattr(self, "ray_handle", None) is not None:
            self.ray_handle.shutdown()

    def note(self, text: str) -> None:
        if self.console is not None:
            self.console.log(text)
        log.info(text)


def check_model_path(cfg: RunConfig) -> None:
    """Fail before any actor starts when model.path is missing or plainly incomplete."""
    from rollout_worker.models.base import ModelLoadError, is_local, require_dir

    path = cfg.model.path
    if cfg.model.family == "toy":
        if path is not None and not Path(path).exists():
            raise ModelLoadError(f"model.path {path!r} does not exist")
        from rollout_worker.models.toy import ToyVideoModel
        return ToyVideoModel.check(cfg)  # damaged weights: one line here, not a traceback per actor
    if path is None:
        raise ModelLoadError(f"model.path is required for model.family = {cfg.model.family!r}")
    if is_local(path):
        require_dir(path, ["model_index.json"], f"model.family = {cfg.model.family!r}")
