"""The control plane: which group is drawn next, when the learner steps, which weights are current.

The driver moves no rollout data (docs/architecture.md). Each rollout actor generates a group,
scores it with the reward pool and pushes it into the Redis bank itself; the driver gets a
`GroupReceipt`. The learner's rank 0 pulls the batch from the bank and commits it itself; the
driver gets a `PullReceipt` (ids and versions) and the step's scalars. Weights go from the
learner to the rollout actors by object reference.

The loop reads generate → score → store → train → publish; its parts each have a module:
- `state.DriverState`: what a checkpoint records (step, cursor, open groups, counters);
- `stream.PromptStream`: which condition and seed come next;
- `fleet.RolloutFleet`: dispatch groups to rollout actors, collect receipts, handle failures;
- `publish.Publisher`: the newest weights as the version actors load next;
- `drops.Drops`: groups taken out on the way to the learner (corrupt, quarantined, other settings);
- `pools.Placement`: every pool placed one way, in a placement group.

Dispatch is continuous: each rollout actor gets its next group as soon as it delivers one.
`sync` makes exactly the step's groups at the current version, then trains. `async` keeps at
most `train.max_staleness` steps of groups (queued or in flight) ahead of the learner, and
dispatches only while the bank has room; it never drops a sample.

Failures. A rollout or reward actor that dies is restarted by Ray; a group that fails is drawn
again from the same cursor (fleet.py). Redis outages are retried with backoff for
`bank.outage_s`, then the run stops cleanly; a dead learner or a weight-sync timeout stops the
run with one clear line (`stop_reason`). Every group drawn is tracked in `state.open` until it is
trained, so a checkpoint records exactly which groups a resume must keep or draw again.
"""

from __future__ import annotations

import logging
import shutil
import signal
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

import reward_worker.actor
from cluster.data.manifests import check_task
from cluster.data.prompts import load_prompts
from cluster.driver.checkpoint import try_write
from cluster.driver.cluster_check import check_resources, probe_roles
from cluster.driver.drops import Drops
from cluster.driver.errors import ConfigStop, LeaseStop, StopRun, bank_call, is_lease_lost
from cluster.driver.fleet import RolloutFleet
from cluster.driver.pools import Placement, RayHandle, init_ray, pool_processes, wait_placed
from cluster.driver.preflight import check_model_path
from cluster.driver.producer import Producer
from cluster.driver.publish import Publisher
from cluster.driver.resume import restore
from cluster.driver.startup import Startup
from cluster.driver.state import DriverState, cursor_of
from cluster.driver.step_record import StepExporter, step_record
from cluster.driver.stream import PromptStream
from cluster.driver.versions import Versions
from cluster.driver.watchdog import guard
from cluster.driver.weight_registry import start_registry
from cluster.evaluation.run_eval import evaluate_run, step_videos
from cluster.health.hook import DriverHealth
from cluster.runs.run_dir import RunDir
from common.actors import ByName, kill_and_wait
from common.config import RunConfig
from common.methods import method_of
from common.metrics import Metrics
from common.types import PullReceipt
from learner.checkpoint import DiskFull, disk_full_line, is_disk_full
from learner.finite_guard import GROUPS, SKIPPED
from memory_bank.connect import connect_bank, resolve_redis_url
from memory_bank.errors import BankUnavailable
from memory_bank.ownership import claim_namespace
from memory_bank.ref import make_ref
from memory_bank.url_server import UrlServer
from reward_worker.actor import RewardClient, actor_names

log = logging.getLogger("vgrpo.driver")

POLL_S = 0.5  # the longest the producer sleeps between looks at its actors


@dataclass
class Started:
    """What setup started, so teardown stops exactly that, whatever point setup reached."""

    ray: RayHandle | None = None
    redis: Any = None              # the embedded redis-server, when this run started one
    secret_dir: Path | None = None
    lease: Any = None
    placements: list[Placement] = field(default_factory=list)
    actors: list = field(default_factory=list)  # reward actors, rollout actors, the weight registry
    watchdog: Any = None           # stops the redis-server and deletes the URL file if the driver is killed


class Driver:
    def __init__(self, cfg: RunConfig, run_dir: RunDir, console=None, reward_factory=None):
        self.cfg, self.run_dir, self.console = cfg, run_dir, console
        self.reward_factory = reward_factory  # tests: a reward model that misbehaves on purpose
        self.state = DriverState()
        self.started = Started()
        self.stop_requested = threading.Event()
        self.timers: dict[str, float] = defaultdict(float)
        self.metrics = Metrics(backend="memory", role="driver", pool="driver")
        self.exporter = StepExporter(self.metrics, {})
        self.stop_reason: str | None = None     # why the run stopped early (None: finished or a signal)
        self.stop_code = 1                      # `vgrpo train`'s exit status for that stop
        self.stopped_by: str | None = None      # "Ctrl-C" or "SIGTERM": the signal that asked the run to stop
        self.phase = "loop"                     # what a stop signal does now (`_on_signal`)
        self._prev_signals: dict = {}           # the handlers run() replaced; teardown puts them back
        self.learner_lost = False
        self.lease_lost = False
        self.checkpoint_failed: str | None = None  # why the last checkpoint could not be written (a full disk)
        # training health (cluster/health/); `numerics` reads the skipped-in-a-row count the state keeps
        self.health = DriverHealth(cfg, run_dir, self.note, StopRun, lambda: self.state.skipped_in_a_row)
        self.stream = PromptStream([], cfg.train.seed, self.state)
        self.drops = Drops(self.state, self.note)  # groups taken out on the way to the learner
        # set by setup(): the bank, the pools and the loop's parts
        self.bank = self.redis = self.bank_ref = self.actor_cfg = self.rewards = self.learner = None
        self.fleet: RolloutFleet | None = None
        self.publisher: Publisher | None = None
        self.eval_frames: dict[str, tuple[np.ndarray, int]] = {}  # label -> frames of before_after.png
        self.eval_prompts: list[str] = []                        # its row labels
        self.t_start, self.videos_at_start = time.monotonic(), 0
        self.tag = uuid.uuid4().hex[:8]  # names this run's named actors (two runs in one process: compare)
        self.startup = Startup()         # waits for the role actors to load; the first that fails stops the run

    # the state the loop and the tests read
    step = property(lambda self: self.state.step)
    cursor = property(lambda self: self.state.cursor)
    counts = property(lambda self: self.state.counts)
    open = property(lambda self: self.state.open)
    conditions = property(lambda self: self.stream.conditions)
    rollouts = property(lambda self: self.fleet.actors if self.fleet is not None else [])
    receipts = property(lambda self: self.fleet.receipts)

    # --- 1. set-up ---------------------------------------------------------------------------

    def setup(self, resume: Path | None = None) -> None:
        cfg, s = self.cfg, self.started
        check_model_path(cfg)
        self.stream.conditions = load_prompts(cfg.train.prompts, cfg.data)
        check_task(self.stream.conditions, cfg.model.task, cfg.train.prompts)
        # 1. Ray: join RAY_ADDRESS or start a local cluster that declares the role resources
        s.ray = init_ray(cfg)
        self.metrics = Metrics.auto(role="driver", pool="driver")
        self.exporter = StepExporter(self.metrics, {r: Metrics.auto(role=r, pool=r)
                                                    for r in ("rollout", "reward", "learner")})
        # 2. the cluster preflight (cluster/driver/cluster_check.py): every pool has its resources,
        #    then one task per role and node, in the role's own bundle, checks what it reads and writes
        wait_s = check_resources(cfg, local=s.ray.started_here and not s.ray.joined, note=self.note)
        placements = self._place_pools(wait_s)
        probe_roles(cfg, placements, self.run_dir, self.note)
        # 3. the memory bank; actors get its URL by reference, never as an argument
        self._connect_bank(resume is not None)
        # 4. the actors: every role loads at once; the first that fails stops the run (startup.py)
        self._start_pools(placements)
        # 5. resume, or start from version 0 (every role built the same base weights)
        if resume is not None:
            self._restore(resume)
        self.startup.get([a.ping.remote() for a in self.rollouts], 600,
                         [f"rollout actor {i}" for i in range(len(self.rollouts))])

    def _connect_bank(self, resume: bool) -> None:
        """A configured Redis, or an embedded redis-server for this run. The driver's own
        connection does bookkeeping only; actors get the URL by reference."""
        cfg, s = self.cfg, self.started
        spans = s.ray.spans_nodes()  # an embedded Redis listens where other nodes reach it, too
        host = _node_ip() if spans else None  # None: one node (bank.embedded_listen auto: unix)
        self.bank, s.redis = connect_bank(cfg.bank, data_dir=self.run_dir.path / "redis", host=host)
        self.redis = s.redis
        s.lease = claim_namespace(self.bank, str(self.run_dir.location.resolve()), resume=resume)
        self.bank_ref, s.secret_dir = make_ref(cfg.bank, self._bank_url())
        self._guard()
        if spans and self.bank_ref.file:  # readers on other nodes ask a UrlServer here for the file's URL
            node, server = self._url_server(self.bank_ref.file)
            self.bank_ref = replace(self.bank_ref, node=node, server=server)
        # actors get the config without the URL: Ray keeps actor arguments in its control store
        self.actor_cfg = cfg.model_copy(update={"bank": self.bank_ref.cfg})
        self.bank.expect_step(cfg.train.groups_per_step)  # the producers' banks check it at their first push

    def _guard(self) -> None:
        """A SIGKILLed driver runs no teardown: its watchdog does it (cluster/driver/watchdog.py)."""
        s = self.started
        s.watchdog = guard(s.ray.own_session if s.ray is not None else None, s.redis, s.secret_dir)

    def _place_pools(self, wait_s: float) -> list[Placement]:
        """A placement group per pool (reward, rollout, learner), waited for together."""
        cfg, s = self.cfg, self.started
        placements = [Placement.request(pool, role, count // pool.parallel.sp)
                      for role, (pool, count) in pool_processes(cfg).items()]
        s.placements += placements
        wait_placed(placements, wait_s)
        return placements

    def _url_server(self, path: str) -> tuple[str, ByName]:
        """A UrlServer (memory_bank/url_server.py) pinned to this node and named: actors get its name, by
        value. Returns (this node's id, the server by name)."""
        # heavy: ray
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        node, name = ray.get_runtime_context().get_node_id(), f"vgrpo-bank-url-{self.tag}"
        server = ray.remote(UrlServer).options(
            name=name, num_cpus=0, max_restarts=-1, max_task_retries=-1,  # a crash is restarted on the same node
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(path)
        self.started.actors.append(server)
        return node, ByName(name)

    def _start_pools(self, placements: list[Placement]) -> None:
        """Every role's actors, loading at once; the driver waits for them with `self.startup`, which
        stops the run in one line when one fails. Rollout actors get the reward actors, the weight
        registry and the bank's URL server by name: their constructor arguments are plain data, so a
        restart never depends on an object Ray may have lost."""
        # heavy: ray, torch
        from learner.actor import LearnerGroup
        from rollout_worker.actor import RolloutActor

        cfg, s = self.cfg, self.started
        pools = cfg.pools
        n_roll = max(1, pools.rollout.num_actors)
        reward_pg, rollout_pg, learner_pg = placements
        names = actor_names(cfg.rewards.models)
        n_rep = max(1, pools.reward.num_actors)
        reward_name = lambda k: f"vgrpo-reward-{self.tag}-{k}"  # noqa: E731 - model-major, as placed
        models = cfg.rewards.models  # simulated GPUs: Ray's share only, every scorer on the CPU
        if pools.simulated_gpus:
            models = [m.model_copy(update={"device": "cpu"}) for m in models]
        reward_actors = reward_worker.actor.create_reward_actors(
            models, pools.reward, self.reward_factory,
            lambda k: {**reward_pg.options(k), "name": reward_name(k)})
        for m, actors in reward_actors.items():
            for j, a in enumerate(actors):
                s.actors.append(a)
                self.startup.watch(f"reward actor {m}" + (f"#{j}" if j else ""), a)
        by_name = {m: [ByName(reward_name(names.index(m) * n_rep + j)) for j in range(n_rep)] for m in names}
        registry_name = f"vgrpo-weights-{self.tag}"
        registry = start_registry(registry_name)
        rollouts = [RolloutActor.options(**rollout_pg.options(i))
                    .remote(self.actor_cfg, i, None, registry_name, by_name, self.bank_ref) for i in range(n_roll)]
        s.actors += [*rollouts, registry]
        for i, a in enumerate(rollouts):
            self.startup.watch(f"rollout actor {i}", a)
        self.fleet = RolloutFleet(cfg, rollouts, self.state, self.stream, versions=Versions(n_roll),
                                  on_sync_error=self._learner_check, timers=self.timers, metrics=self.metrics,
                                  note=self.note, serve_record=lambda: self.publisher.serve_record(now=True))
        self.learner = LearnerGroup(self.actor_cfg, bank=self.bank_ref, placement=learner_pg.options,
                                    wait=self.startup.get)
        firsts = [actors[0] for actors in reward_actors.values()]
        self.startup.get([a.heads.remote() for a in firsts], 900.0,
                         [f"reward actor {m}" for m in reward_actors])
        self.rewards = RewardClient(reward_actors, dict(zip(names, cfg.rewards.models, strict=True)))
        self.publisher = Publisher(cfg, self.learner, self.fleet, registry, on_learner_error=self._learner_check,
                                   timers=self.timers, metrics=self.metrics, learner_died=self._learner_died)

    def _bank_url(self) -> str:
        if self.redis is not None:
            return self.redis.url.get_secret_value()
        url, _ = resolve_redis_url(self.cfg.bank)   # bank.redis_url, its file or its variable
        return url

    def _restore(self, ckpt: Path) -> None:
        """Learner state (weights, optimizer, λ_KL controller, RNG), the driver's state and the
        bank's entries (cluster/driver/resume.py); then the restored version is published."""
        commit = lambda gids, step: self._bank("commit", self.learner.commit_ids, gids, step)  # noqa: E731
        restore(self.state, self.learner.load_checkpoint(ckpt), ckpt, self.bank, commit, self.note)
        if (torn := self.run_dir.truncate_metrics(self.state.step)) is not None:
            self.note(torn)
        self.publisher.publish(self.state.step)
        s = self.state
        queued = s.counts["groups_produced"] - s.counts["groups_trained"]
        self.note(f"resumed from {ckpt} at step {s.step}: {queued} groups queued, {len(s.replay)} drawn again")

    def _bank(self, what: str, fn, *args, **kw):
        try:
            return bank_call(what, fn, *args, outage_s=self.cfg.bank.outage_s, metrics=self.metrics, **kw)
        except Exception as e:
            if is_lease_lost(e):  # a script refused this run: the same stop as the lease thread's
                raise LeaseStop(self.cfg.bank.namespace) from None
            raise

    # --- 2. the producer ---------------------------------------------------------------------

    def _may_dispatch(self, ahead: int) -> bool:
        """async: the step's weights are out, and there is room in the staleness window (queued +
        in flight) and in the bank."""
        if self.publisher.published < self.state.step:
            return False
        c = self.state.counts
        waiting = c["groups_produced"] - c["groups_pulled"] + len(self.fleet.busy)
        return waiting < ahead * self.cfg.train.groups_per_step and self._has_space()

    def generate_round(self, n: int) -> None:
        """sync: n groups stored at the current version, each actor fed as soon as it is free."""
        stored, fleet = 0, self.fleet
        while stored < n and not self.stop_requested.is_set():
            self.publisher.serve_record()  # collective: a restarted actor's weights, when it asked
            for i in range(len(fleet.actors)):
                if i not in fleet.busy and stored + len(fleet.busy) < n:
                    if not self._has_space():
                        self._wait_for_space()
                    fleet.dispatch(i)
            stored += sum(r.ok for r in fleet.collect(POLL_S))

    def _has_space(self) -> bool:
        """Room in the bank for one more group of the size the actors reported (they push it)."""
        return self._bank("has_space", self.bank.has_space, self.fleet.group_bytes)

    def _wait_for_space(self) -> None:
        # the bank logs while it stays full; a step that cannot fit was refused at its first push
        while not self._bank("wait_for_space", self.bank.wait_for_space, timeout_s=5.0,
                             nbytes=self.fleet.group_bytes):
            if self.stop_requested.is_set():
                return

    # --- 3. the learner ----------------------------------------------------------------------

    def train(self) -> dict[str, float] | None:
        """Rank 0 pulls fresh groups (plus bank entries of their conditions), every rank takes one
        optimizer step, rank 0 commits. None when a fresh group was dropped on the way (corrupt,
        untrainable, other settings) or the step raised on the batch (quarantined whole): their
        cursors are drawn again and nothing is trained until the step's groups are all there
        (cluster/driver/drops.py)."""
        import ray  # heavy: ray

        from common.dispatch import why_lost  # heavy: ray

        t0, s = time.monotonic(), self.state
        self._check_lease()
        try:
            pulled: PullReceipt = self._bank("pull", self.learner.pull, self.cfg.train.groups_per_step, s.step)
            for line in pulled.notes:
                self.note(line)
            if pulled.dropped:
                self.drops.refill(pulled.dropped, pulled.reasons)
                return None
            if not pulled.group_ids:
                raise StopRun("the bank returned no fresh groups to train on")
            if self.drops.superseded(self.learner, pulled, self._bank):
                return None
            with s.lock:
                s.counts["groups_pulled"] += len(pulled.group_ids)
            stats = self.drops.train_or_quarantine(self.learner, pulled, self._bank)
            if stats is None:
                return None
            with s.lock:
                for g in pulled.group_ids:
                    s.open.pop(cursor_of(g), None)
                s.counts["groups_trained"] += len(pulled.group_ids)
                s.step += 1
            self._commit(pulled.group_ids)
        except ray.exceptions.RayActorError as e:
            # its pulled groups stay pending; a resume requeues them
            raise self._learner_died(f"the learner died ({why_lost(e)})") from None
        self.timers["train"] += time.monotonic() - t0
        self._skipped(stats.values)
        return _step_values(stats.values, pulled, s.step - 1)

    def _skipped(self, values: dict[str, Any]) -> None:
        """The learner's finite-update guard skipped the step (learner/finite_guard.py): counted (in
        all, and in a row: a checkpoint keeps both) and said, naming the groups; the health check
        `numerics` stops the run when it goes on."""
        skipped = values.get(SKIPPED) == 1.0
        with self.state.lock:
            self.state.skipped_in_a_row = self.state.skipped_in_a_row + 1 if skipped else 0
            if skipped:
                self.state.counts["updates_skipped"] += 1
        if not skipped:
            return
        self.note(f"step {self.state.step}: non-finite loss or gradient (loss {values.get('loss')}, grad norm "
                  f"{values.get('grad_norm')}): the optimizer step was skipped, the weights are unchanged; "
                  f"from group(s) {values.get(GROUPS)}")

    def _commit(self, gids: list[str]) -> None:
        try:
            self._bank("commit", self.learner.commit, self.state.step)
        except StopRun:
            self.state.uncommitted = list(gids)  # the checkpoint commits them on resume
            raise

    def export_policy(self) -> None:
        """Every rollout actor loads the run's exported policy: the newest weights, or with
        optim.ema_decay their moving average, which the final evaluation then samples. The average
        (or θ, where the rollouts sampled a method's anchor: DiffusionNFT's v_old) goes out as
        version step + 1 (actors load only newer versions; no step trains after it)."""
        if self.cfg.optim.ema_decay <= 0 and method_of(self.cfg).rollout_anchor is None:
            self.fleet.sync_idle(POLL_S)  # the actors sample the newest weights: they hold it
            return
        self.fleet.wait_idle(POLL_S)  # a collective push must not meet an actor mid-group
        self.publisher.publish(self.state.step, ema=True)
        self.fleet.sync_idle(POLL_S)
        what = (f"the moving average of the weights (optim.ema_decay {self.cfg.optim.ema_decay})"
                if self.cfg.optim.ema_decay > 0 else "the trained weights θ, not the rollouts' sampling policy")
        self.note(f"the rollout actors hold the exported policy: {what} after step {self.state.step}")

    def _learner_died(self, what: str) -> StopRun:
        """The stop for a learner that died, wherever the driver saw it: marked lost (no checkpoint
        is tried from it), and the line says how to go on."""
        self.learner_lost = True
        return StopRun(f"{what}; continue from the last checkpoint with: vgrpo resume {self.run_dir.location}")

    def _learner_check(self) -> None:
        """Mark the learner lost when its ranks no longer answer (no checkpoint can be written)."""
        import ray  # heavy: ray

        try:
            ray.get([r.version.remote() for r in self.learner.ranks], timeout=30)
        except Exception:
            self.learner_lost = True

    # --- 4. the loops ------------------------------------------------------------------------

    def run(self, progress=None) -> None:
        self.t_start, self.videos_at_start = time.monotonic(), self.state.counts["videos"]
        main = threading.current_thread() is threading.main_thread()
        # SIGTERM is what Kubernetes sends before it evicts a pod: it stops the run like Ctrl-C.
        # The handlers stay until teardown is done (`_restore_signals`): the stop's own checkpoint
        # and teardown come after run() returns, and a second signal then must not kill the driver
        if main and not self._prev_signals:
            self._prev_signals = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        self.phase = "loop"
        try:
            self._heldout(start=True)  # health: the held-out baseline
            (self._run_sync if self.cfg.train.mode == "sync" else self._run_async)(progress)
            if self.state.step >= self.cfg.train.steps:
                self.export_policy()  # a finished run leaves every rollout actor on the exported policy
        except (StopRun, OSError, DiskFull) as e:
            if isinstance(e, OSError):  # a full disk under the run dir (a metrics row, a plot): one line
                e = self._disk_full(e)
            elif isinstance(e, DiskFull):  # a checkpoint's write, whatever layer reported it: its line
                e = StopRun(str(e))
            # a clean stop: the caller writes a checkpoint (unless the learner or the lease is gone)
            self.lease_lost = self.lease_lost or isinstance(e, LeaseStop)
            self.stop_reason = str(e)
            self.stop_code = 2 if isinstance(e, ConfigStop) else 1  # 2: the settings, not a fault
            self.stop_requested.set()
            log.error("run stopped at step %d: %s", self.state.step, e)
            self.note(f"stopping at step {self.state.step}: {e}")
        finally:
            self.phase = "final"  # the stop's checkpoint next: a signal is logged and ignored (`_on_signal`)

    def _restore_signals(self) -> None:
        """The handlers run() replaced, back (teardown's last act)."""
        prev, self._prev_signals = self._prev_signals, {}
        for s, handler in prev.items():
            signal.signal(s, handler)

    def _disk_full(self, e: OSError) -> StopRun:
        """The run stops at this step in one line naming the file; any other OSError goes on up."""
        if not is_disk_full(e):
            raise e
        path = e.filename or self.run_dir.path  # a write() that ran out has no file name: the run dir
        return StopRun(disk_full_line(self.run_dir.checkpoints, self.state.step, path))

    def _on_signal(self, signum, frame) -> None:
        """`phase` "loop": the first signal stops the run after the current step, a second aborts
        it (KeyboardInterrupt). "final" (from the loop's end until the stop's own checkpoint is
        written, and again during teardown): every signal is logged and ignored, so the checkpoint
        is written whole and what the run started is stopped; only SIGKILL cuts that short.
        "after" (a finished run's last evaluation, lifecycle.py): a signal aborts it, and
        teardown still runs."""
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        if self.phase == "after":
            raise KeyboardInterrupt
        if self.phase == "final":
            self.note(f"{name}: ignored, the run is writing its last checkpoint and stopping what it "
                      "started (SIGKILL aborts, and leaves them behind)")
            return
        if self.stop_requested.is_set():
            raise KeyboardInterrupt
        self.stopped_by = name
        self.stop_requested.set()
        self.note(f"{self.stopped_by}: finishing the current step, then writing a checkpoint "
                  "(Ctrl-C again to abort)")

    def _check_lease(self) -> None:
        """A run whose bank lease another run took must not train, commit or checkpoint again."""
        lease = self.started.lease
        if lease is not None and lease.lost:
            raise LeaseStop(self.cfg.bank.namespace)

    def _step(self, progress, published=None) -> bool:
        """Train one step on the queued groups, publish (then `published()`), record. False when
        nothing was trained (a corrupt group was dropped: its replacement comes first)."""
        record = self.train()
        if record is None:
            return False
        self.publisher.publish(self.state.step)
        if published is not None:
            published()
        self._after_step(record, progress)
        return True

    def _run_sync(self, progress) -> None:
        c = self.state.counts
        while self.state.step < self.cfg.train.steps and not self.stop_requested.is_set():
            queued = c["groups_produced"] - c["groups_trained"]  # > 0 after a resume
            self.generate_round(max(0, self.cfg.train.groups_per_step - queued))
            if self.stop_requested.is_set():
                break
            if self._step(progress):
                self._heldout()  # health: every health.eval_every steps

    def _run_async(self, progress) -> None:
        gps, c = self.cfg.train.groups_per_step, self.state.counts
        with Producer(self.fleet, lambda: self._may_dispatch(max(1, self.cfg.train.max_staleness)),
                      self.stop_requested, POLL_S) as producer:
            while self.state.step < self.cfg.train.steps and not self.stop_requested.is_set():
                producer.wait_until(lambda: c["groups_produced"] - c["groups_pulled"] >= gps,
                                    tick=self.publisher.serve_record)
                if self.stop_requested.is_set():
                    break
                if self._step(progress, published=producer.wake):
                    self._heldout()  # health: with the weights the actors hold now

    def _after_step(self, stats: dict[str, Any], progress) -> None:
        s = self.state
        try:  # the step is logged even when Redis just went away; the next bank call decides
            bank = self.bank.stats()
        except BankUnavailable:
            bank = None
        record = step_record(s.step, time.monotonic() - self.t_start, stats, s.counts, self.timers,
                             self.videos_at_start, bank)
        self.health.on_step(record, self.metrics)  # health: checks, and their keys in the row
        self.run_dir.log(record)
        self.exporter.export(record, s.counts)
        if progress is not None:
            progress.update(record)
        if s.step % 5 == 0 or s.step == self.cfg.train.steps:
            self.run_dir.plot_rewards(self.heads())
        step_videos(self.cfg, s.step, self.rollouts, self.run_dir)  # every log.video_every steps
        if s.step % self.cfg.train.checkpoint_every == 0 and self.checkpoint() is None and self.checkpoint_failed:
            raise StopRun(self.checkpoint_failed)
        self.health.raise_if_stopped()  # health: a `stop` finding ends the run (the caller checkpoints)

    def _heldout(self, start: bool = False) -> None:
        self.health.heldout(self.state.step, self.rollouts, self.rewards.heads, self.metrics, start=start,
                            policy=self._evaluated_policy)

    def _evaluated_policy(self):
        """What an evaluation during training samples: the exported policy (θ, or with
        optim.ema_decay its moving average; section 9). None where the rollout actors sample θ
        and so hold it; where they sample a method's anchor instead (DiffusionNFT's v_old,
        section 6b), the exported policy's record, which they load for the evaluation alone."""
        if method_of(self.cfg).rollout_anchor is None:
            return None
        return self.learner.weights_record(self.state.step, self.cfg.weight_sync.checksum, ema=True)

    def heads(self) -> list[str]:
        return list(self.rewards.heads.names)

    # --- 5. evaluation ------------------------------------------------------------------------

    def evaluate(self, label: str, gifs: int = 4):
        """The fixed evaluation pairs, ODE-sampled by the rollout actors with the newest weights and
        scored by the reward role (cluster/evaluation/run_eval.py); keeps what before_after.png shows."""
        self.fleet.sync_idle(POLL_S)
        ev = evaluate_run(self.cfg, self.rollouts, self.rewards.heads, self.run_dir, self.state.step, label, gifs,
                          self.note)
        self.eval_frames[label] = (ev.shown, ev.shown_per)
        self.eval_prompts = ev.prompts
        return ev.result

    # --- 6. checkpoints and teardown ---------------------------------------------------------

    def checkpoint(self) -> Path | None:
        """Learner state plus what a resume needs (cluster/driver/checkpoint.py). None when the
        learner is gone (the last checkpoint stands)."""
        if self.learner_lost or self.lease_lost or (self.started.lease is not None and self.started.lease.lost):
            why = "the learner is gone" if self.learner_lost else "another run holds the bank's lease"
            self.note(f"no checkpoint: {why}; the last checkpoint stands")
            return None
        path, self.checkpoint_failed = try_write(self.learner, self.bank, self.state, self.run_dir.checkpoints,
                                                 self.note)
        if self.checkpoint_failed:  # one line; the run stops at this step (`_after_step`), the last one stands
            self._learner_check()
            self.note(f"no checkpoint: {self.checkpoint_failed}")
        return path

    def teardown(self) -> None:
        """Stop what setup started, in reverse order (setup may have stopped part-way)."""
        self.phase = "final"
        try:
            self._stop_started()
        finally:
            self._restore_signals()  # only now: a signal during the last checkpoint or this is ignored

    def _stop_started(self) -> None:
        s = self.started
        if self.learner is not None:
            try:
                self.learner.shutdown()
            except Exception as e:  # teardown goes on; the next step frees what is left
                log.warning("teardown: %s", e)
        kill_and_wait(s.actors)
        for p in s.placements:
            p.remove()
        if s.lease is not None:
            s.lease.release()
        if s.redis is not None:
            s.redis.stop()
        if s.secret_dir is not None:
            shutil.rmtree(s.secret_dir, ignore_errors=True)
        if s.ray is not None:
            s.ray.shutdown()
        if s.watchdog is not None:  # done by hand: it has nothing left to do
            s.watchdog.stop()

    def note(self, text: str) -> None:
        if self.console is not None:
            self.console.log(text)
        log.info(text)


def _node_ip() -> str:
    import ray  # heavy: ray

    return ray.util.get_node_ip_address()  # the address Ray itself uses for this node


def _step_values(values: dict[str, float], pulled: PullReceipt, step: int) -> dict[str, float]:
    """The step's scalars: the learner's, plus staleness, bank use and the pulled rewards."""
    out = dict(values)
    staleness = [step - v for v in pulled.versions]
    out["staleness_mean"] = float(np.mean(staleness))
    out["staleness_max"] = float(np.max(staleness))
    out["bank_entries_used"] = float(pulled.bank_entries)
    out["reward_mean"] = pulled.reward_mean
    out.update({f"reward/{h}": v for h, v in pulled.head_means.items()})
    out.update(pulled.spread)  # health: zero-spread share per head (computed on rank 0)
    return out
