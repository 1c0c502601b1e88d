"""Memory-bank throughput: push+pull of realistic entries against raw SET/GET of the same
bytes on the same server, in the same run (goal: ratio >= 0.8).

`ratio` is the median over rounds of (SET+GET) / (push+pull), each round timing both side by
side (the order alternates): robust to a loaded machine's stalls. `ratio_sums` is the same from
summed times (throughput), which one stall on either side moves.

    python -m benchmarks.bench_bank [--quick] [--gpu] [--listen unix|tcp] [--json OUT.json]

`--gpu` sizes entries as a GPU run stores them (16 and 64 MB per member: Wan-scale latents at the
trained steps); the bank itself is Redis on the CPU either way.

It ends with how much slower the codec runs after a few milliseconds asleep than back to back
on this machine (`codec_after_idle`): the bank's CPU work follows a wait each time, raw SET/GET's
does not, so that factor moves the 1 MB ratio from one machine to another.

Uses $REDIS_URL when set, else an embedded redis-server (`--listen`: its unix socket, the
default, or TCP on 127.0.0.1; bank and raw use the same connection either way). Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import uuid

import torch

from common.config import BankConfig
from common.sde import Sage, Schedule
from common.types import Cond, Condition, Group, Scores, Trajectory
from memory_bank.bank import MemoryBank
from memory_bank.codec import encode, encode_cond
from memory_bank.embedded import EmbeddedRedis

K, C, F, H = 2, 16, 4, 32
SPEC = Sage(0.5).spec(Schedule.explicit(torch.linspace(1, 0, 21).tolist()))
# Until the bank holds its capacity, each push makes Redis (and this process) take fresh
# memory from the OS; the raw baseline rewrites the same keys. Time the steady state.
WARMUP = 3


def make_group(entry_mb: float, g: int, version: int, gen: torch.Generator,
               enc: Cond | None = None) -> Group:
    """G members whose stored tensors (x, x_next, final_latents) total about entry_mb each, of
    the one condition "bench" encoded as `enc` (drawn when None). A run's rollouts encode one
    prompt to the same tensors each time, so its groups share one condition record."""
    w = max(1, round(entry_mb * 2**20 / (4 * (2 * K + 1) * C * F * H)))
    cond = Condition(id="bench", prompt="a benchmark prompt")
    if enc is None:
        enc = Cond({"text": torch.randn(1, 16, 64, generator=gen)}, None, "bench")
    gid = uuid.uuid4().hex
    members = [Trajectory(
        condition=cond, group_id=gid, member=i, seed=i, spec=SPEC,
        guidance_scale=1.0, policy_version=version, step_indices=[0, 1],
        x=torch.randn(K, C, F, H, w, generator=gen),        # [K, C, F, H, W]
        x_next=torch.randn(K, C, F, H, w, generator=gen),   # [K, C, F, H, W]
        logp_old=torch.randn(K, generator=gen),             # [K]
        final_latents=torch.randn(C, F, H, w, generator=gen), cond=enc,
    ) for i in range(g)]
    values = torch.rand(g, 3, generator=gen)                 # [G, H]
    return Group(cond, gid, version, members, Scores(["vq", "mq", "ta"], values), values.sum(1))


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def bench_size(client, entry_mb: float, iters: int, g: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    ns = f"bench{uuid.uuid4().hex[:8]}"
    # one condition, capacity G, staleness 0: each pull reads exactly the fresh group
    bank = MemoryBank(client, BankConfig(namespace=ns, capacity=g, max_staleness=0,
                                         max_bytes=1 << 40))
    enc = Cond({"text": torch.randn(1, 16, 64, generator=gen)}, None, "bench")  # the prompt, encoded once
    groups = [make_group(entry_mb, g, v, gen, enc) for v in range(min(iters, 3))]
    blobs = [[bytes(encode(uuid.uuid4().hex, m, grp.scores.heads, grp.scores.values[i], 0.0,
                           cond_key=encode_cond(grp.condition.id, grp.cond)[0])[1])
              for i, m in enumerate(grp.members)] for grp in groups]
    nbytes = sum(len(b) for b in blobs[0])       # bytes per group, as stored
    t = {"push": [], "pull": [], "commit": [], "set": [], "get": []}

    def bank_round(it: int) -> dict[str, float]:
        grp = groups[it % len(groups)]
        grp.group_id = grp.members[0].group_id = uuid.uuid4().hex
        grp.policy_version = it
        for m in grp.members:
            m.policy_version = it
        t0 = time.perf_counter()
        bank.push_group(grp)
        t1 = time.perf_counter()
        batch = bank.pull(1, version=it)
        t2 = time.perf_counter()
        bank.commit(batch, step=it)
        t3 = time.perf_counter()
        assert len(batch.fresh) == 1 and batch.bank == [[]]
        return {"push": t1 - t0, "pull": t2 - t1, "commit": t3 - t2}

    def raw_round(it: int) -> dict[str, float]:
        # the same bytes under new keys, pipelined per group like the bank does; like the bank's
        # commit evicting the group before last, the previous round's keys are deleted, untimed
        keys = [f"{ns}:raw:{it}:{i}" for i in range(g)]
        pipe = client.pipeline(transaction=False)
        for k, b in zip(keys, blobs[it % len(groups)], strict=True):
            pipe.set(k, b)
        t4 = time.perf_counter()
        pipe.execute()
        t5 = time.perf_counter()
        pipe = client.pipeline(transaction=False)
        for k in keys:
            pipe.get(k)
        got = pipe.execute()
        t6 = time.perf_counter()
        assert sum(len(b) for b in got) == nbytes
        client.delete(*[f"{ns}:raw:{it - 1}:{i}" for i in range(g)])
        return {"set": t5 - t4, "get": t6 - t5}

    try:
        for it in range(WARMUP + iters):
            # alternate which goes first, so neither always runs after the other's allocations
            rounds = (bank_round, raw_round) if it % 2 == 0 else (raw_round, bank_round)
            times = {k: v for fn in rounds for k, v in fn(it).items()}
            if it >= WARMUP:
                for name, dt in times.items():
                    t[name].append(dt)
    finally:
        bank.clear()
        for k in client.scan_iter(f"{ns}:raw:*"):
            client.delete(k)
    mb = nbytes / 2**20
    bank_mbs = 2 * mb * iters / (sum(t["push"]) + sum(t["pull"]))
    raw_mbs = 2 * mb * iters / (sum(t["set"]) + sum(t["get"]))
    rounds = [(s + g_) / (p + q) for s, g_, p, q in zip(t["set"], t["get"], t["push"], t["pull"],
                                                         strict=True)]
    return {
        "entry_mb": round(mb / g, 3), "group_mb": round(mb, 3), "members": g, "iters": iters,
        "bank_push_pull_mb_s": round(bank_mbs, 1), "raw_set_get_mb_s": round(raw_mbs, 1),
        "ratio": round(_pct(rounds, 0.5), 3), "ratio_sums": round(bank_mbs / raw_mbs, 3),
        **{f"{k}_ms_p{int(q * 100)}": round(1e3 * _pct(v, q), 2)
           for k, v in t.items() for q in (0.5, 0.99)},
    }


def codec_after_idle(reps: int = 100, idle_s: float = 0.003) -> dict:
    """Median µs of encoding one 1 MB member back to back, and after `idle_s` asleep (as after
    each Redis round trip of a round). On a shared VM the second can be several times the
    first: the caches are others' by then. It is what makes the bank's per-entry CPU cost in
    the loop larger than a `timeit` of the codec says, and the 1 MB ratio vary by machine."""
    gen = torch.Generator().manual_seed(1)
    grp = make_group(1.0, 1, 0, gen)
    ck = encode_cond(grp.condition.id, grp.cond)[0]
    m, heads, row = grp.members[0], grp.scores.heads, grp.scores.values[0]

    def timed(wait: float) -> float:
        xs = []
        for _ in range(reps):
            if wait:
                time.sleep(wait)
            t0 = time.perf_counter()
            encode(uuid.uuid4().hex, m, heads, row, 0.0, cond_key=ck)
            xs.append(time.perf_counter() - t0)
        return round(1e6 * _pct(xs, 0.5), 1)

    timed(0.0)  # warm-up
    return {"encode_us_back_to_back": timed(0.0), "encode_us_after_idle": timed(idle_s),
            "idle_ms": idle_s * 1e3}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few iterations (about 10 s)")
    ap.add_argument("--members", type=int, default=4, help="trajectories per group")
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--gpu", action="store_true", help="GPU-run entry sizes (16 and 64 MB per member)")
    ap.add_argument("--listen", choices=["unix", "tcp"], default="unix",
                    help="how the embedded redis-server is reached (bank.embedded_listen)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.gpu:
        from benchmarks.gpu import require_cuda

        require_cuda()
        plan = [(16.0, 4 if args.quick else 12), (64.0, 2 if args.quick else 6)]
    else:
        plan = [(1.0, 8 if args.quick else 80), (16.0, 3 if args.quick else 15)]
    server = None
    url = os.environ.get("REDIS_URL")
    if url:
        import redis
        client = redis.Redis.from_url(url)
    else:
        server = EmbeddedRedis(listen=args.listen).start()
        client = server.client()
    try:
        rows = [bench_size(client, mb, iters, args.members) for mb, iters in plan]
        idle = codec_after_idle(20 if args.quick else 100)
    finally:
        if server is not None:
            server.stop()
    where = "$REDIS_URL" if url else (f"an embedded redis-server over "
                                      f"{'its unix socket' if args.listen == 'unix' else 'TCP loopback'}")
    print(f"config: groups of {args.members} members, entry sizes {[mb for mb, _ in plan]} MB, "
          f"iterations {[n for _, n in plan]} after {WARMUP} warm-up, bank and raw alternating which goes first, against {where}; raw = SET+GET of the same encoded bytes under new keys")
    print(f"{'entry':>8} {'bank MB/s':>10} {'raw MB/s':>10} {'ratio':>6} {'(sums)':>6} "
          f"{'push p50/p99 ms':>16} {'pull p50/p99 ms':>16} {'set p50/p99':>12} "
          f"{'get p50/p99':>12} {'commit p50':>10}")
    for r in rows:
        print(f"{r['entry_mb']:>6.2f}MB {r['bank_push_pull_mb_s']:>10.1f} "
              f"{r['raw_set_get_mb_s']:>10.1f} {r['ratio']:>6.2f} {r['ratio_sums']:>6.2f} "
              f"{r['push_ms_p50']:>7.1f}/{r['push_ms_p99']:<8.1f} "
              f"{r['pull_ms_p50']:>7.1f}/{r['pull_ms_p99']:<8.1f} "
              f"{r['set_ms_p50']:>5.1f}/{r['set_ms_p99']:<6.1f} "
              f"{r['get_ms_p50']:>5.1f}/{r['get_ms_p99']:<6.1f} {r['commit_ms_p50']:>10.1f}")
    a, b = idle["encode_us_back_to_back"], idle["encode_us_after_idle"]
    print(f"this machine: encoding one 1 MB member takes {a:.0f} µs back to back, {b:.0f} µs after "
          f"{idle['idle_ms']:g} ms asleep ({b / a:.1f}×), as after each of a round's round trips")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{**r, **idle} for r in rows], f, indent=2)  # the machine's context of each ratio
    return rows


if __name__ == "__main__":
    main()
