"""Soak: the quickstart through the real CLI (`vgrpo train`, then `vgrpo resume`) for a given
number of minutes under attack at random intervals; then the accounting. Not a CI test.

    python -m benchmarks.soak --minutes 3 [--every 10 30]
        [--attacks kill,flip,nonfinite,untrainable,server,sigterm] [--pause] [--seed 0]
        [--config configs/quickstart.yaml] [key.path=value ...]

The run is `vgrpo train --no-eval` with `bank.aof=true` and unlimited actor restarts, in a child
process. Attacks (benchmarks/soak_attacks.py), one every MIN_S..MAX_S seconds: each kind once
first, in random order (one that finds nothing to attack yet comes again), then drawn uniformly
(kill twice as often): `kill` SIGKILLs a random rollout or reward actor's process; `flip` flips
8–32 bits in a random stored entry; `nonfinite` writes +inf/NaN into one (with a valid checksum);
`untrainable` stamps a queued member with a policy version from the future; `server` SIGKILLs
the embedded valkey-server (the driver must start it again on its AOF); `sigterm` SIGTERMs
`vgrpo train`, which must checkpoint and exit 143, and runs `vgrpo resume` on the run (`kill` and
`sigterm` wait until the current process has trained a step: an actor killed while it loads
stops the run by design, cluster/driver/startup.py, and a run SIGTERMed before its first
checkpoint is removed). `--pause`
also SIGSTOPs the driver once, half-way, for 1.5× `bank.lease_ttl_s`. The entries are damaged
through the actors' user (the run's URL file), as the soak is outside the run.

At the end the soak SIGTERMs the run (once it has trained a step, as a `sigterm` attack waits
for: one SIGTERMed before that has no checkpoint to resume, or no handler yet), reopens its bank
from the AOF (run_dir/redis) and reports: faults injected and survived per kind (survived: the
run trained a step after it; after a `sigterm`, the resumed run past its checkpoint), groups
produced / trained / still queued / dropped on the way to the learner (whole groups corrupt or
quarantined: their conditions are drawn again), lost (pushed, never trained, not dropped and no
longer queued) and duplicated (trained twice), prompt-stream cursors skipped (a dropped group's
condition never drawn again, against the last checkpoint's open cursors), the damaged entries
and where they went, and the non-finite tensors of the last checkpoint. It exits 1 unless none
is lost or duplicated, no cursor is skipped, every untrainable entry that was pulled is
quarantined, every damaged entry that was pulled is counted corrupt, the weights are finite and
the run never stopped for good (exited other than by the soak's SIGTERM).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

SIGTERM_EXIT = 143   # what `vgrpo train` / `vgrpo resume` return when SIGTERM stopped them
ROLES = {"rollout": "RolloutWorker", "reward": "RewardActor"}   # Ray's process title per actor class


@dataclass
class Soak:
    """All the soak's state, across the run's restarts."""

    run_dir: Path
    cfg: object                                   # the run's resolved config (common.config.RunConfig)
    proc: subprocess.Popen | None = None          # `vgrpo train`, then each `vgrpo resume`
    exits: list[int] = field(default_factory=list)   # each process's exit code
    started_at: int = 0                           # the step the current process started at
    bank: object | None = None                    # the live run's MemoryBank, as the actors' user
    faults: list[tuple[str, int]] = field(default_factory=list)   # (kind, last step when injected)
    damaged: dict[str, list[str]] = field(default_factory=lambda: {"flip": [], "nonfinite": [], "untrainable": []})
    was_queued: set[str] = field(default_factory=set)   # damaged while a member of a queued group
    stopped_for_good: str | None = None

    def start(self, *cli: str) -> None:
        self.bank = None   # a new process: a new server password
        self.started_at = self.step()
        self.proc = subprocess.Popen([sys.executable, "-m", "cluster.cli", *cli])

    def alive(self) -> bool:
        if self.proc.poll() is None:
            return True
        if self.stopped_for_good is None:
            self.exits.append(self.proc.returncode)
            status = _read_json(self.run_dir / "status.json")
            self.stopped_for_good = f"exit {self.proc.returncode}: {status.get('reason')}"
        return False

    def step(self) -> int:
        """The last step metrics.jsonl records."""
        try:
            lines = (self.run_dir / "metrics.jsonl").read_text().splitlines()
            return int(json.loads(lines[-1])["step"]) if lines else 0
        except (OSError, ValueError, KeyError):
            return 0

    def stop(self) -> int:
        """SIGTERM the run and wait for its checkpoint and exit."""
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout=600)
        self.exits.append(rc)
        return rc

    def connect(self):
        """The live run's bank, through the URL its driver handed the actors."""
        import redis

        from benchmarks.soak_attacks import bank_url
        from memory_bank.bank import MemoryBank

        if self.bank is None:
            url = bank_url(self.run_dir / "redis")
            if url is None:
                raise RuntimeError("the run's bank URL file is not there (yet)")
            self.bank = MemoryBank(redis.Redis.from_url(url), self.cfg.bank)
        return self.bank


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--every", type=float, nargs=2, default=(10.0, 30.0), metavar=("MIN_S", "MAX_S"),
                   help="seconds between attacks, drawn uniformly")
    p.add_argument("--attacks", default="kill,flip,nonfinite,untrainable,server,sigterm",
                   help="comma-separated: each once first, in random order, then drawn uniformly each "
                   "time (kill twice as often)")
    p.add_argument("--pause", action="store_true", help="SIGSTOP the driver once past its bank lease")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config", default="configs/quickstart.yaml")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)

    from common.config import load_config

    # unlimited restarts: the soak kills more often than a pool's default restart budget allows
    overrides = ["train.steps=100000", "run.name=soak-" + time.strftime("%Y%m%d-%H%M%S"), "bank.aof=true",
                 "pools.rollout.max_restarts=-1", "pools.reward.max_restarts=-1", *args.overrides]
    cfg = load_config(args.config, overrides)
    soak = Soak(Path(cfg.run.root) / cfg.run.name, cfg)
    rng = random.Random(args.seed)
    attacks = [a for a in args.attacks.split(",") for _ in range(2 if a == "kill" else 1)]
    first = rng.sample(sorted(set(attacks)), len(set(attacks)))   # each kind once first, in random order
    soak.start("train", "-c", args.config, "--no-eval", *overrides)
    t0 = time.monotonic()
    end = t0 + args.minutes * 60
    pause_at = t0 + args.minutes * 30 if args.pause else float("inf")
    while soak.alive() and time.monotonic() < end:
        time.sleep(rng.uniform(*args.every))
        if not soak.alive():
            break
        kind = "pause" if time.monotonic() >= pause_at else first.pop() if first else rng.choice(attacks)
        if kind == "pause":
            pause_at = float("inf")
        try:
            attack(soak, kind, rng)
        except Exception as e:  # noqa: BLE001  (nothing to attack yet, an entry went meanwhile)
            print(f"[soak] {kind} failed: {type(e).__name__}: {e}", flush=True)
            done = {k.split("_")[0] for k, _ in soak.faults}
            if kind in attacks and kind not in first and kind not in done:   # comes again until done once
                first.append(kind)
    elapsed = time.monotonic() - t0
    # the last process stops as the attacks' did: once it has trained a step (its handlers are up)
    while soak.alive() and soak.step() <= soak.started_at and time.monotonic() < t0 + elapsed + 600:
        time.sleep(2)
    if soak.alive() and soak.stop() != SIGTERM_EXIT:
        soak.stopped_for_good = f"exit {soak.exits[-1]} on the soak's final SIGTERM"
    report = account(soak, elapsed)
    print(json.dumps(report, indent=2))
    (soak.run_dir / "soak.json").write_text(json.dumps(report, indent=2))
    fate = report["damaged"]
    ok = report["groups_lost"] == 0 and report["groups_duplicated"] == 0 and report["cursors_skipped"] == 0
    ok = ok and report["stopped_for_good"] is None and report["weights_nonfinite"] == 0
    ok = ok and report["weights_checked"] > 0
    ok = ok and fate["untrainable_pulled_not_quarantined"] == 0 and fate["corrupt_uncounted"] == 0
    return 0 if ok else 1


def attack(soak: Soak, kind: str, rng: random.Random) -> None:
    """One fault on the live run, recorded in `soak.faults` once it is done."""
    from benchmarks.soak_attacks import ATTACKS, queued_members, role_pids, server_pids

    step, pid = soak.step(), soak.proc.pid
    if kind in ("kill", "sigterm") and step <= soak.started_at:
        # a run SIGTERMed before its first checkpoint is removed, nothing to resume; an actor
        # killed while it loads stops the run at once by design (cluster/driver/startup.py)
        raise RuntimeError("no step trained since this process started: the run is still starting")
    if kind == "kill":
        role = rng.choice(sorted(ROLES))
        victims = role_pids(pid, ROLES[role])
        if not victims:
            raise RuntimeError(f"no {role} actor process (restarting?)")
        os.kill(rng.choice(victims), signal.SIGKILL)
        kind = f"kill_{role}"
    elif kind == "server":
        victims = server_pids(pid)
        if len(victims) != 1:
            raise RuntimeError(f"{len(victims)} embedded server processes, not one")
        os.kill(victims[0], signal.SIGKILL)
    elif kind == "pause":
        seconds = 1.5 * soak.cfg.bank.lease_ttl_s
        print(f"[soak] pausing the driver for {seconds:.0f} s (its lease: {soak.cfg.bank.lease_ttl_s:.0f} s)",
              flush=True)
        os.kill(pid, signal.SIGSTOP)
        time.sleep(seconds)
        os.kill(pid, signal.SIGCONT)
    elif kind == "sigterm":
        print(f"[soak] SIGTERM to vgrpo at step {step}", flush=True)
        if (rc := soak.stop()) != SIGTERM_EXIT:
            soak.stopped_for_good = f"exit {rc} on SIGTERM (expected {SIGTERM_EXIT})"
            return
        step = soak.step()   # the stop's checkpoint: the resumed run must train past it
        soak.start("resume", str(soak.run_dir), "--no-eval")
    else:
        bank = soak.connect()
        queued = queued_members(bank)
        if (eid := ATTACKS[kind](bank, rng)) is None:
            raise RuntimeError("nothing to damage")
        soak.damaged[kind].append(eid)
        soak.was_queued.update({eid} & queued)
        kind = f"{kind} ({'queued' if eid in queued else 'banked'} {eid})"
    soak.faults.append((kind.split(" ")[0], step))
    print(f"[soak] {kind} at step {step}", flush=True)


def account(soak: Soak, elapsed: float) -> dict:
    """The figures, from the stopped run's bank (reopened on its AOF), its metrics and its last
    checkpoint."""
    from benchmarks.soak_attacks import checkpoint_finite
    from memory_bank.bank import MemoryBank
    from memory_bank.embedded import EmbeddedRedis

    last = soak.step()
    ckpts = sorted((soak.run_dir / "checkpoints").glob("step_*"))
    extra = _read_json(ckpts[-1] / "extra.json") if ckpts else {}
    counts = extra.get("counts", {})
    with EmbeddedRedis(data_dir=soak.run_dir / "redis", aof=True) as server:
        bank = MemoryBank(server.admin_client(), soak.cfg.bank)
        stats = bank.stats()
        done = [g.decode() for g in bank.r.lrange(bank.keys.done, 0, -1)][::-1]   # oldest first
        dead = {g.decode() for g in bank.r.lrange(bank.keys.dead, 0, -1)}
        queued = set(bank.queued_ids()) | set(bank.pending_ids())
        fate = _fates(bank, soak.damaged, soak.was_queued, 0)
    trained = Counter(done)
    checked, nonfinite = checkpoint_finite(ckpts[-1]) if ckpts else (0, 0)
    kinds = Counter(k for k, _ in soak.faults)
    return {
        "minutes": round(elapsed / 60, 2), "mode": soak.cfg.train.mode, "steps": last,
        "processes": len(soak.exits), "exit_codes": soak.exits, "stopped_for_good": soak.stopped_for_good,
        "faults_injected": dict(kinds), "faults_survived": dict(Counter(k for k, s in soak.faults if last > s)),
        "faults_after_the_last_step": sum(last <= s for _, s in soak.faults),
        "actor_restarts_seen_by_driver": counts.get("actor_restarts"),
        "groups_produced": stats["pushed"], "groups_trained": sum(trained.values()),
        "groups_queued": len(queued), "groups_dropped": len(dead),
        "groups_lost": stats["pushed"] - len(set(trained) | dead | queued),
        "groups_duplicated": sum(n - 1 for n in trained.values() if n > 1),
        "cursors_skipped": _skipped_cursors(trained, {int(c) for c in extra.get("open", {})}),
        "groups_refilled": counts.get("groups_refilled"), "groups_quarantined": counts.get("groups_quarantined"),
        "bank": {k: stats[k] for k in ("pushed", "committed", "dropped", "corrupt", "quarantined")},
        "damaged": fate, "weights_checked": checked, "weights_nonfinite": nonfinite,
        "last_checkpoint": ckpts[-1].name if ckpts else None,
    }


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _skipped_cursors(trained: Counter[str], still_open: set[int]) -> int:
    """Prompt-stream cursors below the last one trained that were neither trained nor are still
    open: a dropped group whose condition was not drawn again would leave one."""
    from cluster.driver.state import cursor_of

    cursors = {cursor_of(g) for g in trained} - {None}
    return len(set(range(max(cursors, default=-1) + 1)) - cursors - still_open)


def _fates(bank, damaged: dict[str, list[str]], was_queued: set[str], corrupt_before: int) -> dict[str, int]:
    """Where the damaged entries went. A member of a queued group is pulled unless the soak ended
    first (then it is still stored): pulled, an untrainable one must be quarantined and a
    damaged one counted corrupt. A damaged banked entry may also leave unread (evicted by
    capacity), so it is only reported."""
    quarantined = {r["id"] for r in bank.quarantined()}
    stored = lambda e: bank.r.exists(bank.keys.blob(e)) > 0  # noqa: E731
    untrain = set(damaged["untrainable"])
    broken = {e for a in ("flip", "nonfinite") for e in damaged[a]} - untrain
    pulled_broken = {e for e in broken & was_queued if not stored(e)} - quarantined
    counted = bank.stats()["corrupt"] - corrupt_before
    return {
        **{f"{a}_injected": len(set(v)) for a, v in damaged.items()},
        "untrainable_quarantined": len(untrain & quarantined),
        "untrainable_still_queued": len({e for e in untrain - quarantined if stored(e)}),
        "untrainable_pulled_not_quarantined": len({e for e in untrain - quarantined if not stored(e)}),
        "damaged_queued_pulled": len(pulled_broken),
        "damaged_banked_gone": len({e for e in broken - was_queued if not stored(e)}),
        "corrupt_counted": counted,
        "corrupt_uncounted": max(0, len(pulled_broken) - counted),
    }


if __name__ == "__main__":
    sys.exit(main())
