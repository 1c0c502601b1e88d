"""`vgrpo bench`: the benchmark suite (benchmarks/), the same as `make bench`."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("bench", help="run the benchmarks and write benchmarks/results.md",
                       description="Run the benchmarks in benchmarks/ (sampler vs a plain ODE loop, "
                       "learner step vs a bare forward+backward, bank vs raw Redis, async vs sync "
                       "end to end), each a ratio measured side by side in one run, and write "
                       "benchmarks/results.md. Run from the repository root.")
    p.add_argument("names", nargs="*", help="which benchmarks (default: all)")
    p.add_argument("--quick", action="store_true", help="fewer repeats: a smoke run")
    p.add_argument("--gpu", action="store_true",
                   help="size the benchmarks for a CUDA GPU (small Wan 2.2 / HunyuanVideo 1.5 transformers)")
    p.set_defaults(func=run)


def run(args) -> int:
    from benchmarks.run_all import main

    return main([*args.names, *(["--quick"] if args.quick else []), *(["--gpu"] if args.gpu else [])])
