"""Run ownership on a real redis-server: one live driver per namespace (a lease with a TTL),
a dead run's data reported and cleared only on request, each consumer requeues only its own
pending groups, and eviction never races a fetch into a corrupt read."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import uuid

import pytest
import redis
import torch
from bank_helpers import make_group

from common.config import BankConfig
from memory_bank.bank import MemoryBank
from memory_bank.errors import NamespaceBusy, StaleBank
from memory_bank.ownership import claim_namespace

SMALL = (1, 2, 4, 4)   # [C, F, H, W]: the races need many groups, not big ones
CTX = mp.get_context("fork")


def _ns() -> str:
    return f"own{uuid.uuid4().hex[:10]}"


def _bank(url: str, ns: str, **cfg) -> MemoryBank:
    return MemoryBank(redis.Redis.from_url(url), BankConfig(namespace=ns, **cfg))


def _wait_until(cond, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


# ---- the lease ---------------------------------------------------------------------------

def _driver(url, ns, run_id, barrier, results, release) -> None:
    torch.set_num_threads(1)
    b = _bank(url, ns)
    barrier.wait(timeout=30)
    try:
        lease = claim_namespace(b, run_id)
    except NamespaceBusy as e:
        results.put(("refused", run_id, str(e)))
        return
    results.put(("won", run_id, ""))
    release.wait(timeout=60)
    lease.release()


def test_second_driver_on_a_live_namespace_is_refused(redis_server):
    url, ns = redis_server.url.get_secret_value(), _ns()
    barrier, results, release = CTX.Barrier(2), CTX.Queue(), CTX.Event()
    procs = [CTX.Process(target=_driver, args=(url, ns, f"run-{i}", barrier, results, release))
             for i in range(2)]
    for p in procs:
        p.start()
    got = sorted([results.get(timeout=60), results.get(timeout=60)])
    release.set()
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    (refused, loser, msg), (won, winner, _) = got
    assert (refused, won) == ("refused", "won") and loser != winner
    assert "\n" not in msg and f"bank.namespace {ns!r} is in use by a live run" in msg
    assert f"run {winner}" in msg and "set another bank.namespace" in msg
    # the winner released it: the namespace is free again
    b = _bank(url, ns)
    claim_namespace(b, "run-next").release()
    b.clear()


def test_lease_is_renewed_past_its_ttl_and_released(redis_server):
    b = _bank(redis_server.url.get_secret_value(), _ns(), lease_ttl_s=0.3)
    lease = claim_namespace(b, "run-a")
    t0 = time.monotonic()
    _wait_until(lambda: lease.renewals >= 4)
    assert time.monotonic() - t0 > 0.3                   # it outlived one TTL only by renewal
    assert b.r.exists(b.keys.lease) and 0 < b.r.pttl(b.keys.lease) <= 300
    with pytest.raises(NamespaceBusy):
        claim_namespace(_bank(redis_server.url.get_secret_value(), b.keys.namespace), "run-b")
    lease.release()
    assert not b.r.exists(b.keys.lease)
    claim_namespace(b, "run-b").release()
    b.clear()


def _dead_run(url, ns) -> None:
    """A driver that claims, pushes 3 groups, pulls 1 and dies without releasing anything."""
    torch.set_num_threads(1)
    b = _bank(url, ns, lease_ttl_s=0.5)
    claim_namespace(b, "run-dead")
    for i in range(3):
        b.push_group(make_group("c", f"g{i}", g=2, seed=i, shape=SMALL))
    assert len(b.pull(1, 0).fresh) == 1
    os._exit(0)


def _in_a_process_that_ends(target, url, ns) -> int:
    """Run `target(url, ns)` in a forked process to its exit (0); its pid, now gone."""
    p = CTX.Process(target=target, args=(url, ns))
    p.start()
    p.join(timeout=60)
    assert p.exitcode == 0
    return p.pid


def test_dead_runs_data_is_reported_and_cleared_only_on_request(redis_server):
    url, ns = redis_server.url.get_secret_value(), _ns()
    _in_a_process_that_ends(_dead_run, url, ns)
    b = _bank(url, ns)
    _wait_until(lambda: not b.r.exists(b.keys.lease))    # its lease expires: nobody renews it
    before = {k: v for k, v in b.stats().items() if k != "redis_latency_ms"}
    # 1. another run is refused, in one line that says what is left and how to clear it
    with pytest.raises(StaleBank) as err:
        claim_namespace(b, "run-new")
    msg = str(err.value)
    assert "\n" not in msg and "run-dead" in msg and "2 queued groups, 1 pending, 6 stored entries" in msg
    assert "bank.clear_stale=true" in msg
    assert {k: v for k, v in b.stats().items() if k != "redis_latency_ms"} == before  # untouched
    assert not b.r.exists(b.keys.lease)                  # the refused claim left no lease
    # 2. a resume of the same run adopts its data and requeues the dead consumer's pending group
    lease = claim_namespace(b, "run-dead", resume=True)
    assert [g.group_id for g in b.pull(5, 0).fresh] == ["g0", "g1", "g2"]
    b.requeue_pending()
    lease.release()
    # 3. clear_stale deletes it, keeping the new run's lease
    cleared = _bank(url, ns, clear_stale=True)
    lease = claim_namespace(cleared, "run-new")
    st = cleared.stats()
    assert (st["fresh"], st["pending"], st["entries"], st["bytes"]) == (0, 0, 0, 0)
    assert cleared.r.exists(cleared.keys.lease)
    lease.release()
    cleared.clear()


def _claim_and_die(url, ns) -> None:
    """A session of run-kept that claims the namespace (a long TTL) and exits without releasing it,
    as one does when its server dies under it."""
    claim_namespace(_bank(url, ns, lease_ttl_s=600), "run-kept")
    os._exit(0)


def test_a_resume_takes_over_only_the_lease_its_own_dead_session_left_on_this_host(redis_server):
    """A lease is dropped early only for `resume` of the run named in it, held by a process of this
    host that is gone; anything else is refused while the TTL runs."""
    import json
    import subprocess
    import sys

    url, ns = redis_server.url.get_secret_value(), _ns()
    pid = _in_a_process_that_ends(_claim_and_die, url, ns)
    b = _bank(url, ns)
    dead = b.r.get(b.keys.lease)
    assert json.loads(dead)["pid"] == pid and b.r.pttl(b.keys.lease) > 500_000
    with pytest.raises(NamespaceBusy):                    # another run: refused, the lease stands
        claim_namespace(b, "run-other", resume=True)
    with pytest.raises(NamespaceBusy):                    # the same run, not a resume: refused
        claim_namespace(b, "run-kept")
    assert b.r.get(b.keys.lease) == dead
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:                                                  # a live holder (its pid runs): refused
        b.r.set(b.keys.lease, dead.replace(f'"pid": {pid}'.encode(), f'"pid": {alive.pid}'.encode()), px=600_000)
        with pytest.raises(NamespaceBusy):
            claim_namespace(b, "run-kept", resume=True)
    finally:
        alive.kill()
        alive.wait()
    b.r.set(b.keys.lease, dead.replace(b'"host": "', b'"host": "elsewhere-'), px=600_000)
    with pytest.raises(NamespaceBusy):                    # another host's holder: cannot be checked
        claim_namespace(b, "run-kept", resume=True)
    b.r.set(b.keys.lease, dead, px=600_000)
    lease = claim_namespace(b, "run-kept", resume=True)   # its own dead session: taken over
    now = json.loads(b.r.get(b.keys.lease))
    assert now["pid"] == os.getpid() and now["epoch"] == json.loads(dead)["epoch"] + 1
    lease.release()
    b.clear()


# ---- consumers ---------------------------------------------------------------------------

def test_requeue_pending_takes_only_the_callers_own_groups(bank, redis_server):
    other = MemoryBank(redis_server.client(), bank.cfg)
    for i in range(3):
        bank.push_group(make_group("c", f"g{i}", g=2, seed=i, shape=SMALL))
    mine = bank.pull(2, 0)
    assert other.requeue_pending() == 0                  # bank's pulls are not other's to requeue
    theirs = other.pull(5, 0)
    assert [g.group_id for g in theirs.fresh] == ["g2"]
    bank.commit(mine, 1)
    other.commit(theirs, 1)
    assert bank.stats()["committed"] == 3
    assert sorted(g.decode() for g in bank.r.lrange(bank.keys.done, 0, -1)) == ["g0", "g1", "g2"]


def test_eviction_between_index_read_and_fetch_is_not_corruption(redis_server):
    """Consumer A reads the condition's index in its pull; consumer B's commit evicts those
    entries before A fetches them (capacity 2). A skips them; nothing counts as corrupt."""
    ns = _ns()
    a = _bank(redis_server.url.get_secret_value(), ns, capacity=2)
    b = _bank(redis_server.url.get_secret_value(), ns, capacity=2)
    a.push_group(make_group("c", "g0", g=2, seed=0, shape=SMALL))
    a.commit(a.pull(1, 0), 1)                            # two banked entries
    a.push_group(make_group("c", "gA", g=2, seed=1, shape=SMALL))
    b.push_group(make_group("c", "gB", g=2, seed=2, shape=SMALL))
    fetch = a._fetch

    def fetch_after_b_commits(*args, **kw):
        b.commit(b.pull(1, 0), 2)                        # gB's members evict both banked entries
        return fetch(*args, **kw)

    a._fetch = fetch_after_b_commits
    got = a.pull(1, 0)
    assert [g.group_id for g in got.fresh] == ["gA"]
    assert got.bank == [[]] and a.stats()["corrupt"] == 0
    a.clear()


def _consumer(url, ns, seen_key, stop_at) -> None:
    torch.set_num_threads(1)
    b = _bank(url, ns, capacity=2, max_staleness=1000)
    step = 0
    while True:
        b.requeue_pending()                              # as the driver does before every pull
        batch = b.pull(2, step)
        if not batch.fresh:
            if int(b.r.get(f"{seen_key}:n") or 0) >= stop_at:
                return
            continue
        b.r.rpush(seen_key, *[g.group_id for g in batch.fresh])
        step += 1
        b.commit(batch, step)
        b.r.incrby(f"{seen_key}:n", len(batch.fresh))


def test_two_consumers_racing_train_each_group_once_with_no_corrupt_read(redis_server):
    url, ns = redis_server.url.get_secret_value(), _ns()
    n = 60
    producer = _bank(url, ns, capacity=2, max_staleness=1000)
    for i in range(n):                                   # two conditions: constant evictions
        producer.push_group(make_group(f"c{i % 2}", f"g{i:03d}", g=2, seed=i, shape=SMALL))
    seen = f"test:{ns}:seen"
    procs = [CTX.Process(target=_consumer, args=(url, ns, seen, n)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    trained = [g.decode() for g in producer.r.lrange(seen, 0, -1)]
    assert sorted(trained) == [f"g{i:03d}" for i in range(n)]   # each exactly once
    st = producer.stats()
    assert (st["corrupt"], st["committed"], st["fresh"], st["pending"]) == (0, n, 0, 0)
    producer.r.delete(seen, f"{seen}:n")
    producer.clear()


def test_clear_stale_bank_flag_sets_the_config_field(monkeypatch, tmp_path):
    import cluster.cli.train_cmd as train_cmd
    from cluster.cli import build_parser

    seen = {}
    monkeypatch.setattr(train_cmd, "_run", lambda cfg, run_dir, resume, evaluate: seen.update(cfg=cfg) or 0)
    for flag, want in (([], False), (["--clear-stale-bank"], True)):
        args = build_parser().parse_args(["train", *flag, f"run.root={tmp_path}", "run.name=flag"])
        assert args.func(args) == 0 and seen["cfg"].bank.clear_stale is want


def test_a_second_vgrpo_train_on_a_live_namespace_is_refused_in_one_line(redis_server, ray_address, tmp_path):
    """The split brain through the real CLI: while one run holds a namespace of a shared server
    (its lease renewed), `vgrpo train` on the same namespace exits 2 with one error line naming it
    and that run, and leaves the holder's lease and entries as they were."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    url, ns = redis_server.url.get_secret_value(), _ns()
    b = _bank(url, ns)
    held = claim_namespace(b, "the-first-run")
    held.start()
    try:
        b.push_group(make_group("c", "g0", seed=0))
        keep = ("pushed", "fresh", "banked", "bytes")
        before = {k: b.stats()[k] for k in keep}
        env = {**os.environ, "VGRPO_REDIS_URL": url, "RAY_ADDRESS": ray_address, "OMP_NUM_THREADS": "1"}
        out = subprocess.run([sys.executable, "-m", "cluster.cli", "train", "-c", "configs/quickstart.yaml",
                              "--no-eval", f"run.root={tmp_path}", "run.name=second", f"bank.namespace={ns}",
                              "train.steps=1"], cwd=root, env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
        errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error: ")]
        assert len(errors) == 1, out.stderr[-3000:]
        assert f"bank.namespace {ns!r} is in use by a live run" in errors[0] and "the-first-run" in errors[0], errors
        assert url.split("@")[0].split(":")[-1] not in out.stderr + out.stdout  # the password is not shown
        assert not held.lost and held.renew() and {k: b.stats()[k] for k in keep} == before
    finally:
        held.release()
        b.clear()
