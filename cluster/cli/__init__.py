"""The `vgrpo` command line. Each command lives in its own module, which registers its parser.

Modules register with `register(subparsers)` and set `func(args) -> int`; their heavy imports
(torch, ray) happen inside the handler, so `vgrpo --help` stays fast.

Owns: parsing arguments and printing; no state. A command calls the package that owns the work
(cluster.driver for a run's lifecycle), and nothing outside this package imports it.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from common.errors import UserError

# Command modules, in the order `vgrpo --help` lists them.
COMMANDS = [
    "cluster.cli.config_cmd",
    "cluster.cli.sde_report",
    "cluster.cli.train_cmd",
    "cluster.cli.eval_cmd",
    "cluster.cli.runs_cmd",
    "cluster.cli.export_cmd",
    "cluster.cli.compare_cmd",
    "cluster.cli.bench_cmd",
    "cluster.cli.plan_cmd",
    "cluster.cli.toy_cmd",
    "cluster.cli.datasets_cmd",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vgrpo",
        description="Post-train video diffusion models with GRPO on Ray "
        "(SAGE-GRPO, TAGRPO, DanceGRPO, FlowGRPO, CPS).",
        epilog="Run `vgrpo COMMAND --help` for a command's options.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the command as typed (model cards quote it)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except Exception as e:
        cause = getattr(e, "cause", None)  # a Ray actor's error wraps the user error it raised
        for err in (e, cause):
            if isinstance(err, UserError):  # the input or environment is wrong: one line, no traceback
                print(f"error: {err}", file=sys.stderr)
                return 2
        raise
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130

