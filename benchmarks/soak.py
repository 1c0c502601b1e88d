"""Soak: the quickstart for a given number of minutes under attack at random intervals; then the
accounting. Not a CI test (it runs for minutes).

    python -m benchmarks.soak --minutes 3 [--every 10 30] [--attacks kill,flip,nonfinite,untrainable]
                              [--pause] [key.path=value ...]

Attacks (benchmarks/soak_attacks.py): kill a random rollout or reward actor; flip 8–32 bits in
a random stored entry; write +inf/NaN into one (with a valid checksum); stamp a queued member with
a policy version from the future; `--pause` also SIGSTOPs the whole driver once, half-way, for
1.5× `bank.lease_ttl_s`.

Reports steps done, actors restarted, groups produced / trained / still queued / dropped on the
way to the learner (whole groups corrupt or quarantined: their conditions are drawn again), groups
lost (pushed, never trained, not dropped and no longer queued) and duplicated (trained twice),
prompt-stream cursors skipped (a dropped group's condition never drawn again); the damaged entries
and where they went; and whether the learner's weights are finite. It exits 1 unless none is lost
or duplicated, no cursor is skipped, every untrainable entry that was pulled is quarantined, every damaged entry that
was pulled is counted corrupt, the weights are finite and the run did not stop.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from collections import Counter
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--every", type=float, nargs=2, default=(10.0, 30.0), metavar=("MIN_S", "MAX_S"),
                   help="seconds between kills, drawn uniformly")
    p.add_argument("--attacks", default="kill,flip,nonfinite,untrainable",
                   help="comma-separated, drawn uniformly each time (kill is drawn twice as often)")
    p.add_argument("--pause", action="store_true", help="SIGSTOP the driver once past its bank lease")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config", default="configs/quickstart.yaml")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)

    import ray
    import torch

    from benchmarks.soak_attacks import ATTACKS, pause_me, queued_members, weights_finite
    from cluster.driver.driver import Driver
    from cluster.runs.run_dir import RunDir
    from common.config import load_config
    from memory_bank.bank import MemoryBank

    torch.set_num_threads(1)
    # unlimited restarts: the soak kills more often than a pool's default restart budget allows
    cfg = load_config(args.config, ["train.steps=100000", "run.name=soak-" + time.strftime("%Y%m%d-%H%M%S"),
                                    "pools.rollout.max_restarts=-1", "pools.reward.max_restarts=-1",
                                    *args.overrides])
    driver = Driver(cfg, RunDir.create(cfg))
    rng = random.Random(args.seed)
    trained: Counter[str] = Counter()
    kills: Counter[str] = Counter()
    damaged: dict[str, list[str]] = {a: [] for a in ATTACKS}
    was_queued: set[str] = set()   # damaged while a member of a queued group: it will be pulled
    attacks = [a for a in args.attacks.split(",") for _ in range(2 if a == "kill" else 1)]
    try:
        driver.setup()
        # pushed: the receipts of the groups the rollout actors stored; trained: the bank's own
        # done list (commit appends each group it moves out of pending)
        done_before = driver.bank.r.llen(driver.bank.keys.done)
        # the damage comes from below the bank (a disk, a foreign writer): through the embedded
        # server's owner, as the actors' user may run the bank's own scripts only
        disk = (MemoryBank(driver.redis.admin_client(), driver.bank.cfg) if driver.redis is not None
                else driver.bank)
        corrupt_before = driver.bank.stats()["corrupt"]
        end = time.monotonic() + args.minutes * 60

        pause_at = [time.monotonic() + args.minutes * 30 if args.pause else float("inf")]

        def attack_once(attack: str) -> None:
            if attack == "kill":
                role = rng.choice(["rollout", "reward"])
                pool = driver.rollouts if role == "rollout" else list(driver.rewards.actors.values())
                ray.kill(rng.choice(pool), no_restart=False)
                kills[role] += 1
                print(f"[soak] killed a {role} actor at step {driver.step}", flush=True)
                return
            queued = queued_members(driver.bank)
            if (eid := ATTACKS[attack](disk, rng)) is not None:
                damaged[attack].append(eid)
                was_queued.update({eid} & queued)
                print(f"[soak] {attack}: {'queued' if eid in queued else 'banked'} entry {eid} "
                      f"at step {driver.step}", flush=True)

        def attacker():
            while not driver.stop_requested.wait(rng.uniform(*args.every)):
                if time.monotonic() >= end:
                    break
                if time.monotonic() >= pause_at[0]:   # once, half-way
                    pause_at[0] = float("inf")
                    print(f"[soak] pausing the driver for {1.5 * cfg.bank.lease_ttl_s:.0f} s (its lease: "
                          f"{cfg.bank.lease_ttl_s:.0f} s) at step {driver.step}", flush=True)
                    pause_me(1.5 * cfg.bank.lease_ttl_s).wait()
                    continue
                try:
                    attack_once(rng.choice(attacks))
                except Exception as e:  # noqa: BLE001  (e.g. the entry went while it was damaged)
                    print(f"[soak] attack failed: {type(e).__name__}: {e}", flush=True)
            driver.stop_requested.set()

        thread = threading.Thread(target=attacker, daemon=True)
        thread.start()
        t0 = time.monotonic()
        driver.run()
        elapsed = time.monotonic() - t0
        thread.join(timeout=60)
        stats = driver.bank.stats()
        pushed = [r.group_id for r in driver.receipts if r.ok]
        done = driver.bank.r.lrange(driver.bank.keys.done, 0, -1)[::-1][done_before:]
        # dropped on the way to the learner (corrupt whole, quarantined): their conditions were drawn again
        dead = {g.decode() for g in driver.bank.r.lrange(driver.bank.keys.dead, 0, -1)}
        trained.update(g.decode() for g in done)
        # every killed actor came back: all of them answer now
        ray.get([a.ping.remote() for a in driver.rollouts] +
                [a.heads.remote() for a in driver.rewards.actors.values()], timeout=300)
        queued = stats["fresh"] + stats["pending"]
        fate = _fates(driver.bank, damaged, was_queued, corrupt_before)
        finite = weights_finite(driver)
        report = {
            "minutes": round(elapsed / 60, 2), "mode": cfg.train.mode, "steps": driver.step,
            "kills": dict(kills), "actors_restarted": sum(kills.values()), "rollout_restarts_seen_by_driver": driver.counts["actor_restarts"],
            "groups_produced": len(pushed), "groups_trained": sum(trained.values()), "groups_queued": queued,
            "groups_dropped": len(set(pushed) & dead),
            "groups_lost": len(set(pushed) - set(trained) - dead) - queued,
            "cursors_skipped": _skipped_cursors(trained, driver.open),
            "groups_duplicated": sum(n - 1 for n in trained.values() if n > 1) + len(pushed) - len(set(pushed)),
            "groups_refilled": driver.counts["groups_refilled"], "stop_reason": driver.stop_reason,
            "bank": {k: stats[k] for k in ("pushed", "committed", "dropped", "corrupt", "quarantined")},
            "groups_quarantined": driver.counts["groups_quarantined"], "damaged": fate,
            "weights_finite": finite,
        }
    finally:
        driver.teardown()
    print(json.dumps(report, indent=2))
    Path(driver.run_dir.path / "soak.json").write_text(json.dumps(report, indent=2))
    ok = report["groups_lost"] == 0 and report["groups_duplicated"] == 0 and report["stop_reason"] is None
    ok = ok and report["cursors_skipped"] == 0
    ok = ok and finite and fate["untrainable_pulled_not_quarantined"] == 0 and fate["corrupt_uncounted"] == 0
    return 0 if ok else 1


def _skipped_cursors(trained: Counter[str], still_open: dict[int, str | None]) -> int:
    """Prompt-stream cursors below the last one trained that were neither trained nor are still
    open: a dropped group whose condition was not drawn again would leave one."""
    from cluster.driver.state import cursor_of

    cursors = {cursor_of(g) for g in trained} - {None}
    return len(set(range(max(cursors, default=-1) + 1)) - cursors - set(still_open))


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
