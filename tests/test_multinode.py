"""A run on a real multi-node Ray cluster (issue 29, row 5): five Ray nodes, each in its own
network, mount, UTS and PID namespaces with its own /tmp (tests/netns_cluster.py), joined by a
bridge that exists only inside a namespace the test makes.

The head runs the driver (RAY_ADDRESS) and the embedded Redis; node b offers `reward`, node c
`learner`, nodes a and d `rollout`. Nothing from the driver's /tmp is visible on another node,
so the actors there reach the bank only if the Redis listens on the head's address and its URL
reaches them some other way than the driver's file (memory_bank/ref.py). Token auth stays on:
every node has the cluster's token. Two runs: weights by the object store, then by a collective
broadcast across nodes, during which the node holding the rollout actor is killed; the actor
restarts on the spare rollout node and the run completes with nothing lost.
"""

from __future__ import annotations

import json
import sys

import pytest
from netns_cluster import NetnsCluster, unavailable, wait_for

from cluster.driver.state import version_of

pytestmark = pytest.mark.timeout(900)
NAMES = ["head", "a", "b", "c", "d"]
ROLES = {"a": {"rollout": 1}, "b": {"reward": 1}, "c": {"learner": 1}, "d": {"rollout": 1}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = unavailable()
    if why is not None:
        pytest.skip(f"multi-node test needs network namespaces: {why}")
    base = tmp_path_factory.mktemp("netns")
    with NetnsCluster(base, NAMES) as c:
        _start(c, "head", {}, num_cpus=0)
        for name, resources in ROLES.items():  # one at a time: `ray start` gives a node 30 s to register
            _start(c, name, resources)
        yield c


def _start(c: NetnsCluster, name: str, resources: dict, num_cpus: int = 1, tries: int = 2) -> None:
    """Start node `name` and wait until it registered; once more if a busy host made it miss."""
    for attempt in range(tries):
        c.start(name, resources, num_cpus)

        def up():
            if c.nodes[name].proc.poll() is not None:
                return "exited"
            return "Ray runtime started" in c.log_tail(name, 100_000) and "up"
        if wait_for(up, 180, f"ray start on node {name}", poll_s=0.5) == "up":
            return
        if attempt == tries - 1:
            raise AssertionError(f"ray start on node {name} exited:\n{c.log_tail(name)}")
        c.kill(name)


@pytest.fixture(scope="module")
def runs(cluster):
    """Both runs, in one driver process on the head (tests/multinode_run.py): object store, then
    collective, during which the node holding the rollout actor is killed once step 1 is done."""
    c = cluster
    # on storage every node shares, at the same path inside the nodes and here: the learner (node c)
    # writes checkpoints into the driver's run directory, which the cluster preflight checks it sees
    outside = c.shared / "runs"
    inside = str(outside)
    log = c.base / "driver.log"
    proc = c.on_head([sys.executable, "tests/multinode_run.py", inside, "object_store:2", "collective:3"], log)
    killed: dict = {}
    try:
        progress = wait_for(lambda: _json(outside / "collective" / "PROGRESS") or proc.poll() is not None,
                            600, "the collective run's placement")
        if isinstance(progress, dict):
            # mid-run: step 1 is trained and published, step 2's groups are being generated
            metrics = outside / "collective" / "collective" / "metrics.jsonl"
            wait_for(lambda: (metrics.is_file() and metrics.read_text().count("\n") >= 1) or proc.poll() is not None,
                     300, "step 1 of the collective run")
            killed["node"] = c.node_of(progress["placed"]["rollout"][0])
            c.kill(killed["node"])
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, log.read_text()[-5000:]
    return {t: json.loads((outside / t / "RESULT").read_text()) for t in ("object_store", "collective")}, killed


def _json(path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _check_ledger(res: dict, steps: int) -> None:
    """Every group pushed was trained once (the bank's `done` list), each made by the version it
    trained against (sync), none left queued."""
    done, pushed = res["done"], [r["id"] for r in res["receipts"]]
    assert res["stop_reason"] is None
    assert [r["step"] for r in res["rows"]] == list(range(1, steps + 1))
    assert len(done) == len(set(done)) == steps * 2 == res["rows"][-1]["groups_trained"]
    assert sorted(done) == sorted(pushed) and res["queued"] == []
    assert all(r["version"] == r["step"] == version_of(r["id"]) for r in res["receipts"]), res["receipts"]
    assert res["versions"] == [steps]


def _on_own_nodes(c: NetnsCluster, res: dict, placed: dict) -> None:
    ip = {n: c.nodes[n].ip for n in NAMES}
    assert res["head"] == ip["head"] and res["redis_host"] == ip["head"]
    assert res["redis_listen"] == "tcp"                        # bank.embedded_listen auto, across nodes
    assert res["url_by"] == {"file": True, "server": True}      # other nodes ask the head's UrlServer
    assert placed["reward"] == [ip["b"]] and placed["learner"] == [ip["c"]]
    assert placed["rollout"][0] in (ip["a"], ip["d"])
    assert set(res["nodes"]) == set(ip.values())


def test_object_store_run_across_nodes(cluster, runs):
    res = runs[0]["object_store"]
    _on_own_nodes(cluster, res, res["placed"])
    _check_ledger(res, steps=2)
    assert res["counts"].get("actor_restarts", 0) == 0


def test_collective_run_survives_the_rollout_node_dying(cluster, runs):
    res, killed = runs[0]["collective"], runs[1]
    assert killed, "the rollout node was never killed"
    spare = {"a": "d", "d": "a"}[killed["node"]]
    _on_own_nodes(cluster, res, res["placed"])
    assert res["placed_after"]["rollout"] == [cluster.nodes[spare].ip]  # restarted on the spare node
    assert res["placed_after"]["reward"] == [cluster.nodes["b"].ip]
    assert res["counts"]["actor_restarts"] >= 1
    assert res["generation"] >= 2                                        # the weight group was formed again
    _check_ledger(res, steps=3)
