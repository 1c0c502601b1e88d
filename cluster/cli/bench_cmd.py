"""`vgrpo bench`: the benchmark suite (benchmarks/ of the source checkout), the same as `make bench`.

The benchmarks are not part of the installed package; they run as their own process from the
checkout this package lives in, so the command works from any directory and `cluster/` never
imports them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from common.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]  # the checkout of an editable install


def register(sub) -> None:
    p = sub.add_parser("bench", help="run the benchmarks and write benchmarks/results.md",
                       description="Run the benchmarks in benchmarks/ (sampler vs a plain ODE loop, "
                       "learner step vs a bare forward+backward, bank vs raw Redis, async vs sync "
                       "end to end), each a ratio measured side by side in one run, and write "
                       "benchmarks/results.md of the source checkout vgrpo is installed from.")
    p.add_argument("names", nargs="*", help="which benchmarks (default: all)")
    p.add_argument("--quick", action="store_true", help="fewer repeats: a smoke run")
    p.add_argument("--gpu", action="store_true",
                   help="size the benchmarks for a CUDA GPU (small Wan 2.2 / HunyuanVideo 1.5 transformers)")
    p.set_defaults(func=run)


def run(args) -> int:

    if not (ROOT / "benchmarks" / "run_all.py").is_file():
        raise ConfigError(f"{ROOT / 'benchmarks'}: not found; the benchmarks ship with the source, so "
                          "clone the repository, `pip install -e .` and run `vgrpo bench` again")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "benchmarks.run_all", *args.names,
           *(["--quick"] if args.quick else []), *(["--gpu"] if args.gpu else [])]
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode
