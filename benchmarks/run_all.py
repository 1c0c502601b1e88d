"""`make bench` / `vgrpo bench`: run every benchmark, print it, and write benchmarks/results.md.

Each benchmark measures its ratio side by side in one run and states its configuration;
this runner adds the machine it ran on. Benchmarks are never tests: these machines are noisy.
`--gpu` runs the same benchmarks sized for one CUDA GPU (small Wan 2.2 / HunyuanVideo 1.5
transformers, see benchmarks/gpu.py) and writes benchmarks/results_gpu.md; without CUDA it
stops with one line saying so.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

BENCHES = ["bench_sampler", "bench_learner", "bench_bank", "bench_async", "bench_dataplane", "bench_learner_memory"]
# Each benchmark's quickest form (`--smoke`; tests/test_bench_smoke.py runs every one, results not
# judged, so that a benchmark cannot break unnoticed). The driver's cluster probe (one task per role,
# each its own worker: seconds) is skipped where a smoke starts runs: tests of the driver cover it.
SMOKE = {"bench_sampler": ["--smoke"], "bench_learner": ["--smoke"], "bench_bank": ["--quick"],
         "bench_async": ["--steps", "1", "train.groups_per_step=1", "sampler.group_size=2",
                         "preflight.skip_cluster_checks=true"],
         "bench_dataplane": ["--smoke"], "bench_learner_memory": ["--check"]}
OUT = Path(__file__).with_name("results.md")
OUT_GPU = Path(__file__).with_name("results_gpu.md")


def machine() -> str:
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    load = ", load average {:.1f}/{:.1f}/{:.1f} at start".format(*os.getloadavg()) if hasattr(os, "getloadavg") else ""
    return (f"{platform.node()}: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
            f"Python {platform.python_version()}, torch {torch.__version__}, GPU {gpu}{load}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help=f"which benchmarks (default: all of {', '.join(BENCHES)})")
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    ap.add_argument("--smoke", action="store_true", help="each benchmark's quickest form (SMOKE): "
                    "checks that they run; writes no report unless --out")
    ap.add_argument("--gpu", action="store_true", help="size the benchmarks for one CUDA GPU")
    ap.add_argument("--out", default=None, help=f"markdown report to write (default {OUT.name}, "
                    f"or {OUT_GPU.name} with --gpu)")
    args = ap.parse_args(argv)
    if args.gpu:
        from benchmarks.gpu import require_cuda

        require_cuda()
    if not args.smoke:
        args.out = args.out or str(OUT_GPU if args.gpu else OUT)
    names = args.names or BENCHES
    unknown = sorted(set(names) - set(BENCHES))
    if unknown:
        ap.error(f"unknown benchmark(s) {unknown}; choose from {BENCHES}")
    flags = [*(["--quick"] if args.quick else []), *(["--gpu"] if args.gpu else [])]
    sections = [f"# Benchmarks{' (GPU sizes)' if args.gpu else ''}\n\nMachine: {machine()}\n\n"
                f"Run: {time.strftime('%Y-%m-%d %H:%M')} ({'quick' if args.quick else 'full'}); "
                f"`python -m benchmarks.run_all{''.join(' ' + f for f in flags)}`\n"]
    failed = 0
    for name in names:
        cmd = [sys.executable, "-m", f"benchmarks.{name}", *(SMOKE[name] if args.smoke else flags)]
        print(f"== {name}", flush=True)
        t0 = time.monotonic()
        res = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).parents[1])
        print(res.stdout, end="", flush=True)
        if res.returncode:
            failed += 1
            print(res.stderr[-3000:], file=sys.stderr)
        status = "ok" if res.returncode == 0 else f"failed (exit {res.returncode})"
        sections.append(f"## {name} — {status}, {time.monotonic() - t0:.0f} s\n\n```\n{res.stdout.strip()}\n```\n")
    if args.out:
        Path(args.out).write_text("\n".join(sections), encoding="utf-8")
        print(f"wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
