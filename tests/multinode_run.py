"""Short training runs on a multi-node Ray cluster (RAY_ADDRESS), for tests/test_multinode.py.

Run on the head node: one run per TRANSPORT:STEPS argument, one after the other in this one
process (its imports are paid once), each a driver on the shrunk toy quickstart config with an
embedded Redis. Each writes what the test checks as JSON under OUT_DIR/TRANSPORT: where each
actor sat (node IPs, before the run and after it), the bank's ledger (pushed, trained, queued),
the receipts' versions, the counts and the stop reason. `PROGRESS` is written once the actors
are placed, so the test knows which node to kill.

    python tests/multinode_run.py OUT_DIR object_store:2 collective:3
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = "a red square moving right\na red square moving up\n"


def _ask(ray, actors, fn) -> list:
    """fn(worker) on each actor, waiting while one restarts (its calls fail at once meanwhile)."""
    deadline = time.monotonic() + 300
    while True:
        try:
            return ray.get([a.__ray_call__.remote(fn) for a in actors], timeout=300)
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _where(ray, actors) -> list[str]:
    return _ask(ray, actors, lambda self: __import__("ray").util.get_node_ip_address())


def _placed(ray, driver) -> dict[str, list[str]]:
    return {"rollout": _where(ray, driver.rollouts), "reward": _where(ray, list(driver.rewards.actors.values())),
            "learner": _where(ray, driver.learner.ranks)}


def main(out: Path, transport: str, steps: int) -> None:
    import ray

    from cluster.driver.driver import Driver
    from cluster.runs.run_dir import RunDir
    from common.config import load_config

    out.mkdir(parents=True, exist_ok=True)
    (out / "prompts.txt").write_text(PROMPTS)
    cfg = load_config(ROOT / "configs/quickstart.yaml", [
        f"weight_sync.transport={transport}", "weight_sync.timeout_s=120", "weight_sync.checksum=true",
        "train.mode=sync", f"train.steps={steps}", "train.groups_per_step=2", "train.eval_seeds=1",
        "train.checkpoint_every=100", "sampler.group_size=4", "schedule.steps=4", "bank.capacity=64",
        "health.eval_every=0", "log.video_every=0", "pools.rollout.max_restarts=8",
        f"train.prompts={out / 'prompts.txt'}", f"run.root={out}", f"run.name={transport}"])
    run_dir = RunDir.create(cfg)
    driver = Driver(cfg, run_dir)
    result: dict = {"transport": transport}
    try:
        driver.setup()  # joins RAY_ADDRESS; its placement groups wait for the nodes' resources
        result["nodes"] = {n["NodeManagerAddress"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
        result["head"] = ray.util.get_node_ip_address()
        result["redis_host"] = driver.redis.host if driver.redis is not None else None
        result["redis_listen"] = driver.redis.listen if driver.redis is not None else None
        result["url_by"] = {"file": driver.bank_ref.file is not None, "server": driver.bank_ref.server is not None}
        result["placed"] = _placed(ray, driver)
        (out / "PROGRESS").write_text(json.dumps(result))
        driver.run()
        result["placed_after"] = _placed(ray, driver)
        result["versions"] = _ask(ray, driver.rollouts, lambda self: self.version())
        bank, k = driver.bank, driver.bank.keys
        result["done"] = [g.decode() for g in bank.r.lrange(k.done, 0, -1)]
        result["queued"] = bank.queued_ids()
        result["receipts"] = [{"id": r.group_id, "version": r.version, "step": r.step, "actor": r.actor}
                              for r in driver.receipts if r.ok]
        result["counts"] = dict(driver.counts)
        result["stop_reason"] = driver.stop_reason
        result["generation"] = driver.publisher.group.generation
        result["rows"] = [json.loads(x) for x in run_dir.metrics_file.read_text().splitlines()]
    finally:
        driver.teardown()
    (out / "RESULT").write_text(json.dumps(result))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")  # the test's log
    for arg in sys.argv[2:]:
        transport, steps = arg.split(":")
        main(Path(sys.argv[1]) / transport, transport, int(steps))
