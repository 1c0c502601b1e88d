"""`vgrpo config show`: print the resolved config as YAML."""

from __future__ import annotations

import argparse

from common.config import load_config, reconstruction_notes, to_yaml
from common.scorers import SCORERS


def add_config_args(p: argparse.ArgumentParser) -> None:
    """The `-c CONFIG [key.path=value …]` pair shared by every command that takes a config."""
    p.add_argument("-c", "--config", default=None, help="YAML config file (default: built-in defaults)")
    p.add_argument("overrides", nargs="*", metavar="key.path=value",
                   help="dotted overrides applied after the file, e.g. sde.scheme=flow kl.strategy=dual")


def register(sub) -> None:
    p = sub.add_parser("config", help="inspect configs", description="Inspect vgrpo configs.")
    csub = p.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    show = csub.add_parser("show", help="print the resolved config as YAML",
                           description="Load CONFIG, apply the overrides, validate, and print the "
                           "resolved config as YAML (secrets masked).")
    add_config_args(show)
    show.set_defaults(func=show_config)


def show_config(args) -> int:
    cfg = load_config(args.config, args.overrides)
    for note in reconstruction_notes(cfg):
        print(f"# NOTE {note}")
    for caveat in dict.fromkeys(SCORERS[m.name].caveat for m in cfg.rewards.models):
        if caveat:
            print(f"# NOTE {caveat}.")
    print(to_yaml(cfg), end="")
    return 0
