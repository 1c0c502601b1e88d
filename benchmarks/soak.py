"""Soak: the quickstart for a given number of minutes while a random rollout or reward actor is
killed at random intervals; then the group accounting. Not a CI test (it runs for minutes).

    python -m benchmarks.soak --minutes 3 [--every 10 30] [key.path=value ...]

Reports steps done, actors restarted, groups produced / trained / still queued, and groups
lost (pushed, never trained and no longer queued) and duplicated (trained twice): both must be 0.
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
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config", default="configs/quickstart.yaml")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)

    import ray
    import torch

    from cluster.driver.driver import Driver
    from cluster.runs.run_dir import RunDir
    from common.config import load_config

    torch.set_num_threads(1)
    # unlimited restarts: the soak kills more often than a pool's default restart budget allows
    cfg = load_config(args.config, ["train.steps=100000", "run.name=soak-" + time.strftime("%Y%m%d-%H%M%S"),
                                    "pools.rollout.max_restarts=-1", "pools.reward.max_restarts=-1",
                                    *args.overrides])
    driver = Driver(cfg, RunDir.create(cfg))
    rng = random.Random(args.seed)
    trained: Counter[str] = Counter()
    kills: Counter[str] = Counter()
    try:
        driver.setup()
        # pushed: the receipts of the groups the rollout actors stored; trained: the bank's own
        # done list (commit appends each group it moves out of pending)
        done_before = driver.bank.r.llen(driver.bank.keys.done)
        end = time.monotonic() + args.minutes * 60

        def killer():
            while not driver.stop_requested.wait(rng.uniform(*args.every)):
                if time.monotonic() >= end:
                    break
                role = rng.choice(["rollout", "reward"])
                pool = driver.rollouts if role == "rollout" else list(driver.rewards.actors.values())
                ray.kill(rng.choice(pool), no_restart=False)
                kills[role] += 1
                print(f"[soak] killed a {role} actor at step {driver.step}", flush=True)
            driver.stop_requested.set()

        thread = threading.Thread(target=killer, daemon=True)
        thread.start()
        t0 = time.monotonic()
        driver.run()
        elapsed = time.monotonic() - t0
        thread.join(timeout=60)
        stats = driver.bank.stats()
        pushed = [r.group_id for r in driver.receipts if r.ok]
        done = driver.bank.r.lrange(driver.bank.keys.done, 0, -1)[::-1][done_before:]
        trained.update(g.decode() for g in done)
        # every killed actor came back: all of them answer now
        ray.get([a.ping.remote() for a in driver.rollouts] +
                [a.heads.remote() for a in driver.rewards.actors.values()], timeout=300)
        queued = stats["fresh"] + stats["pending"]
        report = {
            "minutes": round(elapsed / 60, 2), "mode": cfg.train.mode, "steps": driver.step,
            "kills": dict(kills), "actors_restarted": sum(kills.values()), "rollout_restarts_seen_by_driver": driver.counts["actor_restarts"],
            "groups_produced": len(pushed), "groups_trained": sum(trained.values()), "groups_queued": queued,
            "groups_lost": len(set(pushed) - set(trained)) - queued,
            "groups_duplicated": sum(n - 1 for n in trained.values() if n > 1) + len(pushed) - len(set(pushed)),
            "groups_refilled": driver.counts["groups_refilled"], "stop_reason": driver.stop_reason,
            "bank": {k: stats[k] for k in ("pushed", "committed", "dropped", "corrupt")},
        }
    finally:
        driver.teardown()
    print(json.dumps(report, indent=2))
    Path(driver.run_dir.path / "soak.json").write_text(json.dumps(report, indent=2))
    ok = report["groups_lost"] == 0 and report["groups_duplicated"] == 0 and report["stop_reason"] is None
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
