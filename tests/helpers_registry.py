"""Read the packages with `ast` for code that tests a variant's name (a method, a family, a
scorer) outside the places allowed to: the variant's declaration and its own modules."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("cluster", "common", "learner", "rollout_worker", "reward_worker", "memory_bank")


def _names_in(node: ast.AST, names: set[str]) -> set[str]:
    """String constants of `names` in an expression (alone, or in a tuple/list/set)."""
    elts = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return {e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str) and e.value in names}


def name_tests(names: set[str], allowed: set[str], root: Path = ROOT) -> list[str]:
    """'path:line: source' for every comparison (==, !=, in, not in), match case or dict-literal
    key that uses one of `names`, in the packages, outside the `allowed` paths (relative, posix)."""
    out = []
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel in allowed:
                continue
            text = path.read_text(encoding="utf-8")
            for node in ast.walk(ast.parse(text)):
                hit = False
                if isinstance(node, ast.Compare):
                    hit = any(_names_in(x, names) for x in [node.left, *node.comparators])
                elif isinstance(node, ast.Dict):
                    hit = any(k is not None and _names_in(k, names) for k in node.keys)
                elif isinstance(node, ast.match_case):
                    hit = any(isinstance(p, ast.MatchValue) and _names_in(p.value, names)
                              for p in ast.walk(node.pattern))
                if hit:
                    out.append(f"{rel}:{node.lineno if hasattr(node, 'lineno') else node.pattern.lineno}: "
                               f"{ast.get_source_segment(text, node if hasattr(node, 'lineno') else node.pattern)}")
    return out
