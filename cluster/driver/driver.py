"""The control plane: which group is drawn next, when the learner steps, which weights are current.

The driver moves no rollout data (docs/architecture.md). Each rollout actor generates a group,
scores it with the reward pool and pushes it into the Redis bank itself; the driver gets a
`GroupReceipt`. The learner's rank 0 pulls the batch from the bank and commits it itself; the
driver gets a `PullReceipt` (ids and versions) and the step's scalars. Weights go from the
learner to the rollout actors by object reference.

Dispatch is continuous: each rollout actor gets its next group as soon as it delivers one.
`sync` makes exactly the step's groups at the current version, then trains. `async` keeps at
most `train.max_staleness` steps of groups (queued or in flight) ahead of the learner, and
dispatches only while the bank has room; it never drops a sample.

Failures. A rollout or reward actor that dies is restarted by Ray; a group that fails (actor
death, `sampler.timeout_s`, reward failure or an invalid reward, a corrupt fresh group the
bank drops) is drawn again from the same cursor, so the prompt stream does not change. Redis
outages are retried with backoff for `bank.outage_s`, then the run stops cleanly; a dead
learner or a weight-sync timeout stops the run with one clear line (`stop_reason`). Every
group drawn from the prompt stream is tracked in `open` (cursor -> group id) until it is
trained, so a checkpoint records exactly which groups a resume must keep in the bank or draw again.
"""

from __future__ import annotations

import logging
import shutil
import signal
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cluster.data.manifests import check_task, side_by_side
from cluster.data.prompts import load_prompts
from cluster.driver.step_record import StepExporter, step_record
from cluster.driver.weight_registry import remote_registry
from cluster.health.hook import DriverHealth
from cluster.runs.run_dir import RunDir
from cluster.runs.tracking import step_videos, tiled
from common.config import RunConfig
from common.metrics import Metrics
from common.types import Condition, GroupReceipt, PullReceipt
from common.weights import WeightsRecord

log = logging.getLogger("vgrpo.driver")

SEED_SPACE = 1_000_000  # training seeds stay below the toy world's evaluation seeds
MAX_FAILED_IN_ROW = 12  # groups failing one after another (dead actor, broken reward): stop
POLL_S = 0.5            # the longest the producer sleeps between looks at its actors


def group_id(cursor: int, version: int, attempt: int = 0) -> str:
    """Group ids carry the prompt-stream cursor they were drawn at (see cursor_of); a group
    drawn again after a failure gets an attempt suffix, so no two pushes share an id."""
    return f"g{cursor:07d}-v{version}" + (f"-a{attempt}" if attempt else "")


def cursor_of(gid: str) -> int | None:
    head = gid.split("-", 1)[0]
    return int(head[1:]) if head[:1] == "g" and head[1:].isdigit() else None


def version_of(gid: str) -> int | None:
    """The policy version in a group id `g0000012-v3[-a1]`, or None for another id."""
    part = gid.split("-")[1:2]
    return int(part[0][1:]) if part and part[0][:1] == "v" and part[0][1:].isdigit() else None


@dataclass
class Flight:
    """One group on its way through a rollout actor: weights, then stage, then deliver."""

    cursor: int
    gid: str
    stage: Any                      # ObjectRef of the stage call
    deliver: Any                    # ObjectRef of the deliver call (submitted with it)
    sync: Any = None                # ObjectRef of a set_weights call before it, or None
    sync_version: int = -1
    deadline: float = 0.0           # of the phase now running
    staged: bool = False


class StopRun(Exception):
    """Raised inside the loop when the run cannot go on (the reason is in the message)."""


class Driver:
    def __init__(self, cfg: RunConfig, run_dir: RunDir, console=None, reward_factory=None):
        self.cfg, self.run_dir, self.console = cfg, run_dir, console
        self.reward_factory = reward_factory  # tests: a reward model that misbehaves on purpose
        self.step = 0                 # optimizer steps done == the learner's policy version
        self.cursor = 0               # groups drawn from the prompt stream so far
        self.stop_requested = threading.Event()
        self.timers: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self.lock = threading.Lock()
        self.latest: WeightsRecord | None = None  # object store: the newest published version
        self.published = 0                 # newest version the rollout actors may load
        self.actor_version: list[int] = []
        self.busy: dict[int, Flight] = {}  # rollout actor index -> its group in flight
        self.group_bytes = 0               # the largest group the actors stored (bank space per group)
        self.receipts: deque[GroupReceipt] = deque(maxlen=100_000)  # what the actors reported
        self.metrics = Metrics(backend="memory", role="driver", pool="driver")
        self.exporter = StepExporter(self.metrics, {})
        self.open: dict[int, str | None] = {}   # drawn, not yet trained: cursor -> pushed group id
        self.replay: list[int] = []             # cursors drawn again before new ones
        self.attempts: dict[int, int] = defaultdict(int)  # cursor -> times it failed in this run
        self.uncommitted: list[str] = []        # trained, but Redis was down for the commit
        self.failed_in_row = 0
        self.stop_reason: str | None = None     # why the run stopped early (None: finished or Ctrl-C)
        self.learner_lost = False
        self._secret_dir: Path | None = None
        self.health = DriverHealth(cfg, run_dir, self.note, StopRun)  # training health (cluster/health/checks.py)

    # --- 1. set-up ---------------------------------------------------------------------------

    def setup(self, resume: Path | None = None) -> None:
        import ray

        from cluster.driver.pools import actor_options, in_group, init_ray, placement_group_for
        from learner.actor import LearnerGroup
        from memory_bank.connect import connect_bank
        from memory_bank.ownership import claim_namespace
        from memory_bank.ref import make_ref
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
        # 2. the memory bank: a configured Redis, or an embedded redis-server for this run. The
        #    driver's own connection does bookkeeping only; actors get the URL by reference.
        self.bank, self.redis = connect_bank(cfg.bank, data_dir=self.run_dir.path / "redis")
        self.lease = claim_namespace(self.bank, str(self.run_dir.path.resolve()), resume=resume is not None)
        self.bank_ref, self._secret_dir = make_ref(cfg.bank, self._bank_url())
        # actors get the config without the URL: Ray keeps actor arguments in its control store
        self.actor_cfg = cfg.model_copy(update={"bank": self.bank_ref.cfg})
        self.bank.expect_step(cfg.train.groups_per_step)  # the producers' banks check it at their first push
        # 3. pools: the reward pool first (rollout actors score with it), then the rollout pool
        reward_actors = (create_reward_actors(cfg.rewards.models, cfg.pools.reward) if self.reward_factory is None
                         else create_reward_actors(cfg.rewards.models, cfg.pools.reward, self.reward_factory))
        self.rewards = RewardClient(reward_actors, dict(zip(actor_names(cfg.rewards.models),
                                                            cfg.rewards.models, strict=True)))
        n_roll = max(1, cfg.pools.rollout.num_actors)
        self.rollout_pg = placement_group_for(cfg.pools.rollout, "rollout", n_roll)
        if self.rollout_pg is not None:
            ray.get(self.rollout_pg.ready(), timeout=300)
        self.registry = remote_registry().options(name=f"vgrpo-weights-{id(self):x}", num_cpus=0).remote()
        self.rollouts = [
            RolloutActor.options(**actor_options(cfg.pools.rollout, "rollout", **in_group(self.rollout_pg, i)))
            .remote(self.actor_cfg, i, None, self.registry, reward_actors, self.bank_ref) for i in range(n_roll)]
        self.actor_version = [0] * n_roll
        self.learner = LearnerGroup(self.actor_cfg, bank=self.bank_ref)
        # 4. resume, or start from version 0 (every role built the same base weights)
        if resume is not None:
            self._restore(resume)
        ray.get([a.ping.remote() for a in self.rollouts], timeout=600)

    def _bank_url(self) -> str:
        import os

        if self.redis is not None:
            return self.redis.url.get_secret_value()
        if self.cfg.bank.redis_url is not None:
            return self.cfg.bank.redis_url.get_secret_value()
        return os.environ[self.cfg.bank.redis_url_env]

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
        # what the lost run sampled after the checkpoint carries version numbers the resumed learner
        # reuses for other weights: it would pass as on-policy, so it goes (its cursors drawn again)
        lost = [g for g in self.bank.queued_ids() if (v := version_of(g)) is not None and v > self.step]
        groups, entries = self.bank.discard(lost, after_version=self.step)
        if groups or entries:
            self.note(f"discarded {groups} queued groups and {entries} bank entries sampled after the "
                      f"checkpoint (step {self.step}) by weights this resume rolls back")
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
        self.publish()
        self.note(f"resumed from {ckpt} at step {self.step}: {len(queued)} groups queued, "
                  f"{len(self.replay)} drawn again")

    def _finish_commit(self, gids: list[str]) -> None:
        """Groups the saved learner already trained, whose commit Redis missed: commit them now."""
        if gids:
            n = self._bank("commit", self.learner.commit_ids, gids, self.step)
            self.note(f"committed {n} groups trained before the last stop")

    # --- 2. the prompt stream ----------------------------------------------------------------

    def next_condition(self) -> tuple[Condition, int, int]:
        """The prompt stream: an epoch-wise permutation of the prompts, a seed per group, the cursor.

        A cursor drawn again after a failure keeps its condition; its seed changes with the
        attempt, so a failure the seed caused is not repeated."""
        with self.lock:
            if self.replay:
                n = self.replay.pop(0)
            else:
                n = self.cursor
                self.cursor += 1
            self.open[n] = None
            attempt = self.attempts[n]
        epoch, i = divmod(n, len(self.conditions))
        order = np.random.default_rng([self.cfg.train.seed, epoch]).permutation(len(self.conditions))
        key = [self.cfg.train.seed, 7, n] + ([attempt] if attempt else [])
        seed = int(np.random.default_rng(key).integers(SEED_SPACE))
        return self.conditions[order[i]], seed, n

    def _abandon(self, n: int) -> None:
        """A drawn group that failed before it was stored: its cursor is drawn again next."""
        with self.lock:
            self.open[n] = None
            self.attempts[n] += 1
            if n not in self.replay:
                self.replay.insert(0, n)
        self.failed_in_row += 1
        if self.failed_in_row >= MAX_FAILED_IN_ROW:
            raise StopRun(f"{self.failed_in_row} groups in a row failed to generate or score; "
                          "see the log for each failure")

    # --- 3. the producer: dispatch groups, collect receipts -----------------------------------

    def _dispatch(self, i: int) -> None:
        """Give rollout actor i its next group (its weights first when it is behind)."""
        actor = self.rollouts[i]
        sync, sync_version = None, -1
        latest = self.latest
        if latest is not None and self.actor_version[i] < latest.version:
            # by reference: the actor maps the packed payload from the object store
            sync = actor.set_weights.remote(latest.weights, latest.version, latest.checksum)
            sync_version = latest.version
        cond, seed, cursor = self.next_condition()
        version = sync_version if sync is not None else max(self.actor_version[i], 0)
        gid = group_id(cursor, version, self.attempts[cursor])
        now = time.monotonic()
        self.busy[i] = Flight(cursor, gid, actor.stage.remote(cond, seed, gid, cursor), actor.deliver.remote(gid),
                              sync, sync_version,
                              now + (self.cfg.weight_sync.timeout_s if sync is not None else self.cfg.sampler.timeout_s))

    def _deliver_budget(self) -> float:
        """The longest scoring and storing may take: every reward try, plus a Redis outage."""
        tries = max(m.timeout_s * (m.retries + 1) for m in self.cfg.rewards.models)
        return tries + self.cfg.bank.outage_s + 30.0

    def _collect(self, timeout: float) -> list[GroupReceipt]:
        """Wait up to `timeout` for the next event of any group in flight; handle what arrived."""
        import ray

        if not self.busy:
            return []
        refs = {}
        for i, f in self.busy.items():
            ref = f.sync if f.sync is not None else (f.deliver if f.staged else f.stage)
            refs[ref] = i
        nearest = min(f.deadline for f in self.busy.values())
        wait = max(0.0, min(timeout, nearest - time.monotonic()))
        ready, _ = ray.wait(list(refs), num_returns=1, timeout=wait)
        got: list[GroupReceipt] = []
        for ref in ready:
            rec = self._on_event(refs[ref], ref)
            if rec is not None:
                got.append(rec)
        now = time.monotonic()
        for i, f in list(self.busy.items()):
            if f.deadline <= now and self.busy.get(i) is f:
                self._on_late(i, f)
        return got

    def _on_event(self, i: int, ref) -> GroupReceipt | None:
        import ray

        f = self.busy[i]
        now = time.monotonic()
        try:
            out = ray.get(ref)
        except ray.exceptions.RayActorError as e:
            del self.busy[i]
            self._on_rollout_failure(i, e)
            self._abandon(f.cursor)
            return None
        except ray.exceptions.RayTaskError as e:
            del self.busy[i]
            cause = getattr(e, "cause", None) or e
            if ref is f.sync:  # a checksum mismatch or a payload the model cannot load: no retry helps
                self._learner_check()
                raise StopRun(f"weight sync of version {f.sync_version} failed on rollout actor {i}: "
                              f"{cause}") from None
            self.note(f"rollout actor {i}: group {f.gid} failed ({type(cause).__name__}: "
                      f"{str(cause).splitlines()[0] if str(cause) else ''}); drawing it again")
            self._abandon(f.cursor)
            return None
        if ref is f.sync:
            self.actor_version[i] = f.sync_version
            f.sync, f.deadline = None, now + self.cfg.sampler.timeout_s
            return None
        if not f.staged:
            f.staged, f.deadline = True, now + self._deliver_budget()
            self.actor_version[i] = max(self.actor_version[i], int(out["version"]))
            return None
        del self.busy[i]
        self._on_receipt(out)
        return out

    def _on_late(self, i: int, f: Flight) -> None:
        if f.sync is not None:
            timeout = self.cfg.weight_sync.timeout_s
            raise StopRun(f"weight sync of version {f.sync_version} timed out: rollout actor {i} did not "
                          f"answer within {timeout}s (weight_sync.timeout_s)")
        del self.busy[i]
        self._on_rollout_timeout(i, f.cursor, "generate" if not f.staged else "score and store")

    def _on_receipt(self, rec: GroupReceipt) -> None:
        rec.step = self.step
        self.receipts.append(rec)
        with self.lock:
            for k in ("generate", "score", "store"):
                self.timers[k] += rec.seconds.get(k, 0.0)
            self.counts["reward_timeouts"] += rec.reward_timeouts
            self.counts["reward_failures"] += rec.reward_failures
        if rec.ok:
            self.group_bytes = max(self.group_bytes, rec.latent_bytes)
            with self.lock:
                self.open[rec.cursor] = rec.group_id
                self.counts["groups_produced"] += 1
                self.counts["videos"] += rec.size
            self.failed_in_row = 0
            return
        if rec.failure in ("bank_unavailable", "fatal"):
            raise StopRun(f"{rec.detail}; stopping")
        self.counts["groups_refilled"] += 1
        if rec.failure == "invalid":
            self.counts["invalid_members"] += rec.invalid_members
            self.metrics.inc("vgrpo_invalid_rewards_total", rec.invalid_members, head="any")
        self.note(f"group {rec.group_id} not stored ({rec.failure}: {rec.detail}); drawing it again")
        self._abandon(rec.cursor)

    def _on_rollout_timeout(self, i: int, cursor: int, phase: str) -> None:
        """A rollout actor past its deadline (a hung device, a stuck kernel): restart it."""
        import ray

        self.counts["rollout_timeouts"] += 1
        self.metrics.inc("vgrpo_errors_total", 1, kind="rollout_timeout")
        limit = (f"within {self.cfg.sampler.timeout_s:.0f}s (sampler.timeout_s)" if phase == "generate"
                 else "in time (rewards.models[].timeout_s and retries, bank.outage_s)")
        self.note(f"rollout actor {i} did not {phase} its group {limit}; restarting it")
        ray.kill(self.rollouts[i], no_restart=False)  # Ray starts a fresh process
        self._on_rollout_failure(i, TimeoutError(phase))
        self._abandon(cursor)

    def _on_rollout_failure(self, i: int, err: Exception) -> None:
        """A rollout actor died: Ray restarts it; it gets the current weights before it generates."""
        if self.actor_version[i] != -1:  # the first failure since it last took weights: one restart
            self.counts["actor_restarts"] += 1  # exported with the step's record
            self.note(f"rollout actor {i} failed ({type(err).__name__}); it restarts and reloads weights")
        else:  # calls to an actor that is still restarting fail at once (ActorUnavailableError)
            log.debug("rollout actor %d still restarting (%s)", i, type(err).__name__)
        self.actor_version[i] = -1  # forces the weights to it before its next group
        # while Ray restarts it, calls fail at once: back off instead of burning refills
        time.sleep(min(0.25 * (self.failed_in_row + 1), 5.0))

    def _may_dispatch(self, ahead: int | None) -> bool:
        """async: room in the staleness window (queued + in flight) and in the bank."""
        if ahead is None:
            return True
        gps = self.cfg.train.groups_per_step
        if self.published < self.step:  # the step's weights are not out yet
            return False
        waiting = self.counts["groups_produced"] - self.counts["groups_pulled"] + len(self.busy)
        return waiting < ahead * gps and self._has_space()

    def generate_round(self, n: int) -> list[GroupReceipt]:
        """sync: n groups stored at the current version, each actor fed as soon as it is free."""
        stored: list[GroupReceipt] = []
        while len(stored) < n and not self.stop_requested.is_set():
            for i in range(len(self.rollouts)):
                if i not in self.busy and len(stored) + len(self.busy) < n:
                    if not self._has_space():
                        self._wait_for_space()
                    self._dispatch(i)
            stored += [r for r in self._collect(POLL_S) if r.ok]
        return stored

    def _has_space(self) -> bool:
        """Room in the bank for one more group of the size the actors reported (they push it)."""
        return self._bank("has_space", self.bank.has_space, self.group_bytes)

    def _wait_for_space(self) -> None:
        # the bank logs while it stays full; a step that cannot fit was refused at its first push
        while not self._bank("wait_for_space", self.bank.wait_for_space, timeout_s=5.0, nbytes=self.group_bytes):
            if self.stop_requested.is_set():
                return

    def _bank(self, what: str, fn, *args, **kw):
        """A bank call (here or on the learner) retried with backoff while Redis is unreachable,
        for up to bank.outage_s."""
        import ray

        from memory_bank.errors import BankUnavailable

        deadline, delay = time.monotonic() + self.cfg.bank.outage_s, 0.25
        while True:
            try:
                return fn(*args, **kw)
            except (BankUnavailable, ray.exceptions.RayTaskError) as e:
                cause = e if isinstance(e, BankUnavailable) else getattr(e, "cause", None)
                if not isinstance(cause, BankUnavailable):
                    raise
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StopRun(f"memory bank unreachable for {self.cfg.bank.outage_s:.0f}s during {what} "
                                  f"({str(cause).splitlines()[0]}); stopping") from None
                self.metrics.inc("vgrpo_errors_total", 1, kind="redis_unreachable")
                log.warning("%s; retrying %s in %.1fs (%.0fs left)", cause, what, min(delay, left), left)
                time.sleep(min(delay, left))
                delay = min(delay * 2, 5.0)

    # --- 4. the learner ----------------------------------------------------------------------

    def train(self) -> dict[str, float] | None:
        """Rank 0 pulls fresh groups (plus bank entries of their conditions), every rank takes one
        optimizer step, rank 0 commits. None when the bank dropped a corrupt fresh group: its
        cursor is drawn again and nothing is trained until the step's groups are all there."""
        import ray

        t0 = time.monotonic()
        gps = self.cfg.train.groups_per_step
        try:
            pulled: PullReceipt = self._bank("pull", self.learner.pull, gps, self.step)
            if pulled.dropped:
                self._refill_dropped(pulled.dropped)
                return None
            if not pulled.group_ids:
                raise StopRun("the bank returned no fresh groups to train on")
            with self.lock:
                self.counts["groups_pulled"] += len(pulled.group_ids)
            stats = self.learner.train_pulled(pulled)
        except ray.exceptions.RayActorError as e:
            self.learner_lost = True  # its pulled groups stay pending; a resume requeues them
            raise StopRun(f"the learner died ({type(e).__name__}); continue from the last checkpoint "
                          f"with: vgrpo resume {self.run_dir.path}") from None
        with self.lock:
            for g in pulled.group_ids:
                self.open.pop(cursor_of(g), None)
            self.counts["groups_trained"] += len(pulled.group_ids)
        staleness = [self.step - v for v in pulled.versions]
        self.step += 1
        try:
            self._bank("commit", self.learner.commit, self.step)
        except StopRun:
            self.uncommitted = list(pulled.group_ids)  # the checkpoint commits them on resume
            raise
        except ray.exceptions.RayActorError as e:
            self.learner_lost = True
            raise StopRun(f"the learner died ({type(e).__name__}); continue from the last checkpoint "
                          f"with: vgrpo resume {self.run_dir.path}") from None
        self.timers["train"] += time.monotonic() - t0
        values = dict(stats.values)
        values["staleness_mean"] = float(np.mean(staleness))
        values["staleness_max"] = float(np.max(staleness))
        values["bank_entries_used"] = float(pulled.bank_entries)
        values["reward_mean"] = pulled.reward_mean
        for h, v in pulled.head_means.items():
            values[f"reward/{h}"] = v
        values.update(pulled.spread)  # health: zero-spread share per head (computed on rank 0)
        return values

    def _refill_dropped(self, gids: list[str]) -> None:
        """Fresh groups the bank dropped as corrupt: no longer queued; their cursors are drawn again."""
        with self.lock:
            for g in gids:
                n = cursor_of(g)
                self.counts["groups_produced"] -= 1
                self.counts["groups_dropped"] += 1
                if n is not None:
                    self.open[n] = None
                    self.attempts[n] += 1
                    if n not in self.replay:
                        self.replay.insert(0, n)
        self.note(f"the bank dropped {len(gids)} corrupt fresh group(s) ({', '.join(gids)}); "
                  "drawing their conditions again")

    def export_policy(self) -> None:
        """Every rollout actor loads the run's exported policy: the newest weights, or with
        optim.ema_decay their moving average, which the final evaluation then samples. The average
        goes out as version step + 1 (actors load only newer versions; no step trains after it)."""
        if self.cfg.optim.ema_decay <= 0:
            self._sync_idle_actors()
            return
        self._wait_idle()  # a collective push must not meet an actor mid-group
        self.publish(ema=True)
        self._sync_idle_actors()
        self.note(f"the rollout actors hold the exported policy: the moving average of the weights "
                  f"(optim.ema_decay {self.cfg.optim.ema_decay}) after step {self.step}")

    def publish(self, ema: bool = False) -> None:
        """Make the learner's newest weights the version rollout actors load before their next group
        (ema: the weights' moving average, as version step + 1; see export_policy)."""
        import ray

        t0 = time.monotonic()
        if self.cfg.weight_sync.transport == "object_store":
            record = self.learner.weights_record(self.step + int(ema), self.cfg.weight_sync.checksum, ema)
            self.registry.set.remote(record)  # a restarted actor's source
            with self.lock:
                self.latest = record
        else:
            try:
                self.learner.publish(self.rollouts, ema=ema)
            except ray.exceptions.RayError as e:
                cause = getattr(e, "cause", None) or e  # WeightSyncTimeout names the late peer
                self._learner_check()
                raise StopRun(f"weight sync of version {self.step} failed: {type(cause).__name__}: "
                              f"{str(cause).splitlines()[0] if str(cause) else ''}") from None
            self.actor_version = [self.step + int(ema)] * len(self.rollouts)
        self.published = self.step
        seconds = time.monotonic() - t0
        self.timers["publish"] += seconds
        self.metrics.observe("vgrpo_weight_sync_seconds", seconds)

    def _wait_idle(self) -> None:
        """Until no rollout actor has a group in flight (their receipts are collected)."""
        while self.busy:
            self._collect(POLL_S)

    def _sync_idle_actors(self) -> None:
        """Every rollout actor holds the newest version (before an evaluation; actors are idle)."""
        import ray

        self._wait_idle()
        latest = self.latest
        if latest is None:
            return
        calls = {i: self.rollouts[i].set_weights.remote(latest.weights, latest.version, latest.checksum)
                 for i, v in enumerate(self.actor_version) if v < latest.version}
        timeout = self.cfg.weight_sync.timeout_s
        _, late = ray.wait(list(calls.values()), num_returns=len(calls), timeout=timeout)
        if late:
            who = ", ".join(f"rollout actor {i}" for i, c in calls.items() if c in late)
            raise StopRun(f"weight sync of version {latest.version} timed out: {who} did not answer "
                          f"within {timeout}s (weight_sync.timeout_s)")
        for i, c in calls.items():
            try:
                ray.get(c)
                self.actor_version[i] = latest.version
            except ray.exceptions.RayActorError as e:  # restarting: it loads the registry's weights
                self._on_rollout_failure(i, e)

    def _learner_check(self) -> None:
        """Mark the learner lost when its ranks no longer answer (no checkpoint can be written)."""
        import ray

        try:
            ray.get([r.version.remote() for r in self.learner.ranks], timeout=30)
        except Exception:
            self.learner_lost = True

    # --- 5. the loops ------------------------------------------------------------------------

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
            if self.step >= self.cfg.train.steps:
                self.export_policy()  # a finished run leaves every rollout actor on the exported policy
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
            record = self.train()
            if record is None:
                continue  # a corrupt group was dropped: make its replacement first
            self.publish()
            self._after_step(record, progress)
            self.health.heldout(self)  # health: every health.eval_every steps

    def _run_async(self, progress) -> None:
        gps, ahead = self.cfg.train.groups_per_step, max(1, self.cfg.train.max_staleness)
        error: list[BaseException] = []
        produced = threading.Condition()
        done = threading.Event()

        def producer() -> None:
            try:
                while not done.is_set():
                    for i in range(len(self.rollouts)):
                        if i not in self.busy and not done.is_set() and self._may_dispatch(ahead):
                            self._dispatch(i)
                    if not self.busy:
                        with produced:
                            produced.wait(timeout=POLL_S)
                        continue
                    if self._collect(POLL_S):
                        with produced:
                            produced.notify_all()
                # the run is over: let the groups in flight land, so `open` and the counts are exact
                deadline = time.monotonic() + (0 if self.stop_requested.is_set() else 120)
                while self.busy and time.monotonic() < deadline:
                    self._collect(POLL_S)
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
                        produced.wait(timeout=POLL_S)
                if self.stop_requested.is_set():
                    break
                record = self.train()
                if record is None:
                    continue
                self.publish()
                with produced:
                    produced.notify_all()
                self._after_step(record, progress)
                self.health.heldout(self)  # health: with the weights the actors hold now
        finally:
            done.set()
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

    # --- 6. evaluation ------------------------------------------------------------------------

    def evaluate(self, label: str, gifs: int = 4):
        """ODE samples on the fixed (prompt, seed) evaluation pairs, scored by the reward role.

        Each rollout actor samples its share and scores it through its own reward client
        (cluster/evaluation/evaluate.score_pairs); the driver gets every pair's score row, and frames only
        for the few pairs it renders: the GIFs, the tracker's grid and before_after.png."""
        from cluster.evaluation.before_after import shown_pairs
        from cluster.evaluation.evaluate import EvalResult, score_pairs
        from cluster.runs.media import write_gif
        from cluster.runs.tracking import grid_pairs
        from common.toyworld import eval_seeds

        self._sync_idle_actors()
        conds = load_prompts(self.cfg.train.eval_prompts)
        check_task(conds, self.cfg.model.task, self.cfg.train.eval_prompts)
        seeds = eval_seeds(self.cfg.train.eval_seeds)
        pairs = [(c.prompt, s) for c in conds for s in seeds]
        images = [c.image_path for c in conds for _ in seeds] if conds[0].is_i2v else None  # by path
        per = len(seeds)
        gif_pairs = [i * per for i in range(min(gifs, len(conds)))]  # the first seed of each prompt
        grid = grid_pairs(len(pairs), per, self.cfg.log.video_pairs)
        shown, shown_per = shown_pairs(len(pairs), per)
        t0 = time.monotonic()
        scores, frames = score_pairs(self.rollouts, pairs, images, keep={*gif_pairs, *grid, *shown})
        composite = self.rewards.composite(scores)
        result = EvalResult(scores.heads, scores.values.numpy(), composite.numpy())
        self.eval_frames = getattr(self, "eval_frames", {}) | {label: (_stack(frames, shown), shown_per)}  # before_after.png
        self.eval_prompts = [c.prompt for c in conds]  # its row labels
        for i, k in enumerate(gif_pairs):
            video = side_by_side(frames[k].numpy(), conds[i], self.cfg.model)  # I2V: first frame beside it
            name = conds[i].name or pairs[k][0].replace(' ', '_')  # a dataset row's id, else the prompt
            write_gif(video, self.run_dir.samples / f"{label}_{i}_{name}.gif")
        self.run_dir.log_video(f"videos/{label}", tiled(_stack(frames, grid)), self.step)
        self.note(f"evaluation '{label}': {len(pairs)} videos in {time.monotonic() - t0:.1f}s "
                  f"({len(frames)} came back to render), composite {composite.mean():.3f}")
        return result

    # --- 7. checkpoints and teardown ---------------------------------------------------------

    def checkpoint(self) -> Path | None:
        """Learner state plus what a resume needs: step, cursor, open groups, counters, the bank's
        watermark. None when the learner is gone (the last checkpoint stands)."""
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
        if extra["bank"] is None:  # Redis is unreachable: nothing to dump either
            self.note("checkpoint without the bank's data: Redis was unreachable")
        elif (lost := dump_bank(self.bank, path)) is not None:  # the bank's data rides along
            self.note(lost)
        # the published weights too, so `vgrpo eval/sample` can load the policy without the learner
        # (written by the learner's rank 0: the weights do not pass through the driver)
        self.learner.save_policy(path / "policy.safetensors")
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
        if self._secret_dir is not None:
            shutil.rmtree(self._secret_dir, ignore_errors=True)
        if getattr(self, "ray_handle", None) is not None:
            self.ray_handle.shutdown()

    def note(self, text: str) -> None:
        if self.console is not None:
            self.console.log(text)
        log.info(text)


def _stack(frames: dict, order: list[int]) -> np.ndarray:
    """The kept evaluation frames of the pairs in `order`, uint8 [len(order), F, H, W, 3]."""
    return np.stack([frames[k].numpy() for k in order])


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
