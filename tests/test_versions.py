"""cluster/driver/versions.py: one owner of which weights each rollout actor holds."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

from cluster.driver.versions import Versions

ROOT = Path(__file__).resolve().parent.parent


def test_an_actor_is_behind_until_it_takes_the_newest_version_and_a_failure_sends_it_back():
    v = Versions(2)
    assert not v.behind(0) and v.holds(0) == 0
    v.published(3)
    assert v.behind(0) and v.behind(1) and not v.has_newest_record()
    v.keep(SimpleNamespace(version=3))
    assert v.has_newest_record()
    v.took(0, 3)
    assert not v.behind(0) and v.behind(1)
    v.reported(1, 2)
    v.reported(1, 1)  # a group made before it took v2 reports its older version: no step back
    assert v.holds(1) == 2
    assert v.lost(0) and v.restarting(0) and v.holds(0) == 0 and v.behind(0)
    assert not v.lost(0)  # the second failure while it restarts is not a new restart
    v.ask_record()
    assert v.wants_record
    v.served()
    assert not v.wants_record


def test_nothing_but_versions_writes_the_versions_state():
    """No module assigns to a Versions' fields (or the fleet's old per-actor list) directly."""
    fields = {"current", "record", "wants_record", "_held", "actor_version"}
    bad = []
    for path in sorted((ROOT / "cluster").rglob("*.py")):
        if path.name == "versions.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                while isinstance(t, ast.Subscript):
                    t = t.value
                if isinstance(t, ast.Attribute) and t.attr in fields and not (
                        isinstance(t.value, ast.Name) and t.value.id == "self" and t.attr == "record"):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} {t.attr}")
    assert bad == []
