"""The one controller loop: generate → score → store → train → publish.

`sync` runs the stages in turn. `async` runs generate → score → store in a producer thread
that stays at most `train.max_staleness` versions ahead of the learner: it pauses when ahead
(samples are never dropped) and respects the bank's backpressure. Before a rollout actor
generates again it holds the newest published version.

Roles never call each other; only this module wires them.
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

from cluster.prompts import load_prompts
from cluster.run_dir import RunDir
from common.config import RunConfig
from common.metrics import Metrics
from common.types import Condition, Group

log = logging.getLogger("vgrpo.driver")

SEED_SPACE = 1_000_000  # training seeds stay below the toy world's evaluation seeds


class WeightRegistry:
    """Where a restarted rollout actor finds the newest published weights (`latest()`)."""

    def __init__(self):
        self.record: dict | None = None

    def set(self, version: int, boxed_ref: list) -> None:
        # the ref comes boxed in a list so Ray hands over the ref, not a copy of the weights
        self.record = {"version": version, "ref": boxed_ref[0]}

    def latest(self) -> dict | None:
        import ray

        if self.record is None:
            return None
        return {"version": self.record["version"], "weights": ray.get(self.record["ref"]), "checksum": None}


def _remote_registry():
    import ray

    return ray.remote(WeightRegistry)


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
        self.role_metrics: dict[str, Metrics] = {}
        self.exported: dict[str, int] = {}

    # --- 1. set-up ---------------------------------------------------------------------------

    def setup(self, resume: Path | None = None) -> None:
        import ray

        from cluster.pools import actor_options, in_group, init_ray, placement_group_for
        from learner.actor import LearnerGroup
        from memory_bank.connect import connect_bank
        from reward_worker.actor import RewardClient, actor_names, create_reward_actors
        from rollout_worker.actor import RolloutActor

        cfg = self.cfg
        self.conditions = load_prompts(cfg.train.prompts)
        # 1. Ray: join RAY_ADDRESS or start a local cluster that declares the role resources
        self.ray_handle = init_ray(cfg)
        self.metrics = Metrics.auto(role="driver", pool="driver")
        self.role_metrics = {r: Metrics.auto(role=r, pool=r) for r in ("rollout", "reward", "learner")}
        # 2. the memory bank: a configured Redis, or an embedded redis-server for this run
        self.bank, self.redis = connect_bank(cfg.bank, data_dir=self.run_dir.path / "redis")
        # 3. pools: a placement group keeps the rollout pool's actors together
        n_roll = max(1, cfg.pools.rollout.num_actors)
        self.rollout_pg = placement_group_for(cfg.pools.rollout, "rollout", n_roll)
        if self.rollout_pg is not None:
            ray.get(self.rollout_pg.ready(), timeout=300)
        self.registry = _remote_registry().options(name=f"vgrpo-weights-{id(self):x}", num_cpus=0).remote()
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
        extra = self.learner.load_checkpoint(ckpt)
        self.step = int(extra["step"])
        self.cursor = int(extra["cursor"])
        self.bank.requeue_pending()
        if extra.get("bank"):
            self.bank.restore(extra["bank"])
        self.run_dir.truncate_metrics(self.step)
        self._publish_now(self.step)
        self.note(f"resumed from {ckpt} at step {self.step}")

    # --- 2. stages ---------------------------------------------------------------------------

    def next_condition(self) -> tuple[Condition, int]:
        """The prompt stream: an epoch-wise permutation of the prompts, and a seed per group."""
        n = self.cursor
        self.cursor += 1
        epoch, i = divmod(n, len(self.conditions))
        order = np.random.default_rng([self.cfg.train.seed, epoch]).permutation(len(self.conditions))
        seed = int(np.random.default_rng([self.cfg.train.seed, 7, n]).integers(SEED_SPACE))
        return self.conditions[order[i]], seed

    def generate_round(self, n: int) -> list[Group]:
        """Up to n groups, one per rollout actor at a time, scored and stored; failed groups refilled."""
        import ray

        stored: list[Group] = []
        while len(stored) < n and not self.stop_requested.is_set():
            self._publish_pending()
            calls = {}
            for i, actor in enumerate(self.rollouts[: n - len(stored)]):
                cond, seed = self.next_condition()
                gid = f"g{self.cursor:07d}-v{self.actor_version[i]}"
                calls[actor.generate.remote(cond, seed, gid)] = i
            t0 = time.monotonic()
            pending = list(calls)
            while pending:
                # score each group as soon as its actor returns it
                (ref,), pending = ray.wait(pending, num_returns=1)
                try:
                    group = ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    self._on_rollout_failure(calls[ref], e)
                    continue
                if not pending:
                    self.timers["generate"] += time.monotonic() - t0
                if self._score_and_store(group):
                    stored.append(group)
        return stored

    def _on_rollout_failure(self, i: int, err: Exception) -> None:
        """A rollout actor died: Ray restarts it; it gets the current weights before it generates."""
        self.counts["actor_restarts"] += 1
        self.metrics.inc("vgrpo_actor_restarts_total", 1)
        self.note(f"rollout actor {i} failed ({type(err).__name__}); it restarts and reloads weights")
        self.actor_version[i] = -1  # forces a publish to it before its next group

    def _score_and_store(self, group: Group) -> bool:
        from reward_worker.actor import RewardFailed

        t0 = time.monotonic()
        try:
            scores = self.rewards.score(group.frames(), [group.condition.prompt] * group.size,
                                        None if group.condition.image is None else
                                        group.condition.image.unsqueeze(0).expand(group.size, -1, -1, -1))
        except RewardFailed as e:
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
        while not self.bank.wait_for_space(timeout_s=5.0):
            if self.stop_requested.is_set():
                return False
        self.bank.push_group(group)
        self.timers["store"] += time.monotonic() - t0
        self.counts["groups_produced"] += 1
        self.counts["videos"] += group.size
        return True

    def train(self) -> dict[str, float]:
        """Pull fresh groups (plus bank entries of their conditions), take one optimizer step."""
        t0 = time.monotonic()
        batch = self.bank.pull(self.cfg.train.groups_per_step, self.step)
        if not batch.fresh:
            raise StopRun("the bank returned no fresh groups to train on")
        stats = self.learner.train_step(batch)
        self.bank.commit(batch, self.step + 1)
        self.timers["train"] += time.monotonic() - t0
        self.counts["groups_trained"] += len(batch.fresh)
        staleness = [self.step - g.policy_version for g in batch.fresh]
        self.step += 1
        values = dict(stats.values)
        values["staleness_mean"] = float(np.mean(staleness))
        values["staleness_max"] = float(np.max(staleness))
        values["bank_entries_used"] = float(sum(len(b) for b in batch.bank))
        rewards = np.stack([g.composite.numpy() for g in batch.fresh])
        values["reward_mean"] = float(rewards.mean())
        for h_i, h in enumerate(batch.fresh[0].scores.heads):
            values[f"reward/{h}"] = float(np.mean([g.scores.values[:, h_i].mean().item() for g in batch.fresh]))
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
            ray.get([a.set_weights.remote(ref, version, checksum) for a in self.rollouts],
                    timeout=self.cfg.weight_sync.timeout_s)
        else:
            self.learner.publish(self.rollouts)
        self.actor_version = [version] * len(self.rollouts)
        seconds = time.monotonic() - t0
        self.timers["publish"] += seconds
        self.metrics.observe("vgrpo_weight_sync_seconds", seconds)

    # --- 3. the loops ------------------------------------------------------------------------

    def run(self, progress=None) -> None:
        self.t_start = time.monotonic()
        self.videos_at_start = self.counts["videos"]
        prev = signal.signal(signal.SIGINT, self._on_sigint) if threading.current_thread() is threading.main_thread() else None
        try:
            if self.cfg.train.mode == "sync":
                self._run_sync(progress)
            else:
                self._run_async(progress)
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
            self.generate_round(gps)
            if self.stop_requested.is_set():
                break
            self._after_step(self.train(), progress)
            self.publish()
            self._publish_pending()

    def _run_async(self, progress) -> None:
        gps, ahead = self.cfg.train.groups_per_step, max(1, self.cfg.train.max_staleness)
        error: list[BaseException] = []
        produced = threading.Condition()

        def producer() -> None:
            try:
                while not self.stop_requested.is_set():
                    with produced:
                        # stay at most `ahead` steps of groups in front of the learner
                        while (self.counts["groups_produced"] - self.counts["groups_trained"] >= ahead * gps
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
                    while (self.counts["groups_produced"] - self.counts["groups_trained"] < gps
                           and not self.stop_requested.is_set()):
                        produced.wait(timeout=0.5)
                if self.stop_requested.is_set():
                    break
                record = self.train()
                with produced:
                    produced.notify_all()
                self._after_step(record, progress)
                self.publish()
        finally:
            self.stop_requested.set()
            with produced:
                produced.notify_all()
            thread.join(timeout=600)
        if error:
            raise error[0]

    def _after_step(self, record: dict[str, Any], progress) -> None:
        elapsed = time.monotonic() - self.t_start
        record = {"step": self.step, "version": self.step, "time_s": round(elapsed, 3), **record}
        record["videos_per_s"] = (self.counts["videos"] - self.videos_at_start) / max(elapsed, 1e-9)
        for k in ("generate", "score", "train", "publish"):
            record[f"time/{k}"] = round(self.timers[k], 3)
        # idle ratio per role: the share of wall time it was not working for the loop
        busy = {"rollout": self.timers["generate"], "reward": self.timers["score"], "learner": self.timers["train"]}
        for role, t in busy.items():
            record[f"idle/{role}"] = max(0.0, 1.0 - t / max(elapsed, 1e-9))
        for k in ("groups_produced", "groups_trained", "groups_refilled", "invalid_members", "actor_restarts"):
            record[k] = self.counts[k]
        bank = self.bank.stats()
        record.update({"bank/entries": bank["entries"], "bank/bytes": bank["bytes"], "bank/fresh": bank["fresh"],
                       "bank/corrupt": bank["corrupt"], "bank/redis_latency_ms": bank["redis_latency_ms"]})
        self.run_dir.log(record)
        self._export(record)
        if progress is not None:
            progress.update(record)
        if self.step % 5 == 0 or self.step == self.cfg.train.steps:
            self.run_dir.plot_rewards(self.heads())
        if self.step % self.cfg.train.checkpoint_every == 0:
            self.checkpoint()

    def _export(self, record: dict[str, Any]) -> None:
        """Prometheus gauges and counters for this step (see docs/metrics.md)."""
        m = self.metrics
        m.record_stats(record)
        m.inc("vgrpo_train_steps_total", 1)
        for name, key in (("vgrpo_groups_trained_total", "groups_trained"), ("vgrpo_rollouts_total", "groups_produced"),
                          ("vgrpo_videos_total", "videos"), ("vgrpo_actor_restarts_total", "actor_restarts")):
            delta = self.counts[key] - self.exported.get(key, 0)
            if delta:
                m.inc(name, delta)
            self.exported[key] = self.counts[key]
        m.set("vgrpo_queue_depth", record["bank/fresh"], queue="fresh")
        m.set("vgrpo_bank_entries", record["bank/entries"])
        m.set("vgrpo_bank_bytes", record["bank/bytes"])
        m.observe("vgrpo_redis_latency_seconds", record["bank/redis_latency_ms"] / 1000, op="stats")
        m.observe("vgrpo_entry_staleness", record["staleness_max"])
        for role in ("rollout", "reward", "learner"):
            self.role_metrics[role].set("vgrpo_idle_ratio", record[f"idle/{role}"])

    def heads(self) -> list[str]:
        return [h for hs in self.rewards.head_names.values() for h in hs]

    # --- 4. evaluation ------------------------------------------------------------------------

    def evaluate(self, label: str, gifs: int = 4):
        """ODE samples on the fixed (prompt, seed) evaluation pairs, scored by the reward role."""
        import ray

        from cluster.evaluate import EvalResult
        from cluster.media import write_gif
        from common.toyworld import eval_seeds

        self._publish_pending()
        prompts = [c.prompt for c in load_prompts(self.cfg.train.eval_prompts)]
        seeds = eval_seeds(self.cfg.train.eval_seeds)
        pairs = [(p, s) for p in prompts for s in seeds]
        t0 = time.monotonic()
        # the pairs are split over the rollout actors; each sample depends only on its own seed
        n = len(self.rollouts)
        chunks = [pairs[i::n] for i in range(n)]
        refs = [a.sample_videos.remote([p for p, _ in c], [s for _, s in c])
                for a, c in zip(self.rollouts, chunks, strict=True) if c]
        parts = ray.get(refs)
        frames = [None] * len(pairs)
        for i, part in enumerate(parts):
            for j, f in enumerate(part):
                frames[i + j * n] = f
        import torch

        frames = torch.stack(frames)
        scores = self.rewards.score(frames, [p for p, _ in pairs], None)
        composite = self.rewards.composite(scores)
        result = EvalResult(scores.heads, scores.values.numpy(), composite.numpy())
        for i in range(min(gifs, len(pairs))):
            k = i * len(seeds)  # the first seed of each prompt
            write_gif(frames[k].numpy(), self.run_dir.samples / f"{label}_{i}_{pairs[k][0].replace(' ', '_')}.gif")
        self.note(f"evaluation '{label}': {len(pairs)} videos in {time.monotonic() - t0:.1f}s, "
                  f"composite {composite.mean():.3f}")
        return result

    # --- 5. checkpoints and teardown ---------------------------------------------------------

    def checkpoint(self) -> Path:
        from safetensors.torch import save_file

        extra = {"step": self.step, "cursor": self.cursor, "bank": self.bank.snapshot()}
        path = self.learner.save_checkpoint(self.run_dir.checkpoints, extra)
        # the published weights too, so `vgrpo eval/sample` can load the policy without the learner
        payload = {k: v.contiguous() for k, v in self.learner.weights_payload().items()}
        save_file(payload, str(path / "policy.safetensors"))
        self.note(f"checkpoint written: {path}")
        return path

    def teardown(self) -> None:
        import ray

        if getattr(self, "learner", None) is not None:
            try:
                self.learner.shutdown()
            except Exception as e:  # teardown goes on; the next step frees what is left
                log.warning("teardown: %s", e)
        actors = [*getattr(self, "rollouts", []), *getattr(getattr(self, "rewards", None), "actors", {}).values()]
        if getattr(self, "registry", None) is not None:
            actors.append(self.registry)
        for a in actors:
            ray.kill(a, no_restart=True)
        if getattr(self, "rollout_pg", None) is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.rollout_pg)
        if getattr(self, "redis", None) is not None:
            self.redis.stop()
        if getattr(self, "ray_handle", None) is not None:
            self.ray_handle.shutdown()

    def note(self, text: str) -> None:
        if self.console is not None:
            self.console.log(text)
        log.info(text)
