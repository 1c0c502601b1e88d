"""docs/plan.md prints `vgrpo plan`'s output for the shipped configs; each block is what the
command prints today. After a change to the plan, rewrite the blocks with
`VGRPO_WRITE_DOCS=1 python -m pytest tests/test_docs_plan.py` and read the diff."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest

from cluster.cli import main

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "plan.md"
BLOCK = re.compile(r"`(vgrpo plan [^`]+)`\n\n```\n(.*?)\n```", re.S)


def _output(command: str, capsys) -> str:
    argv = shlex.split(command)[1:]
    assert main(argv) == 0, command
    return capsys.readouterr().out.rstrip("\n")


def test_every_plan_block_in_docs_plan_md_is_the_commands_output(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # the blocks name configs/ relative to the repository
    text = DOC.read_text()
    blocks = BLOCK.findall(text)
    assert len(blocks) >= 8, [c for c, _ in blocks]  # the three entry recipes and the real-model configs
    stale = []
    for command, shown in blocks:
        now = _output(command, capsys)
        if now != shown:
            stale.append(command)
            text = text.replace(f"`{command}`\n\n```\n{shown}\n```", f"`{command}`\n\n```\n{now}\n```")
    if stale and os.environ.get("VGRPO_WRITE_DOCS") == "1":
        DOC.write_text(text)
        pytest.skip(f"rewrote {len(stale)} block(s) of docs/plan.md: {stale}")
    assert not stale, f"docs/plan.md is behind `vgrpo plan` for {stale}; rewrite with VGRPO_WRITE_DOCS=1"
