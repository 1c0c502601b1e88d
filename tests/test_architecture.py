"""The package's import structure, read statically with `ast` (nothing is imported or run).

- No import circle between modules of the installed packages (a lazy import inside a function
  counts too: it is still a dependency).
- `common/` and the roles (`learner/`, `rollout_worker/`, `reward_worker/`, `memory_bank/`) never
  import `cluster/`: the orchestration layer wires the roles, never the other way.
- Nothing outside `cluster/cli/` imports `cluster.cli`: commands are argparse and printing only.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("cluster", "common", "learner", "rollout_worker", "reward_worker", "memory_bank")
ROLES = ("common", "learner", "rollout_worker", "reward_worker", "memory_bank")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def imported(path: Path, name: str, known: set[str]) -> set[str]:
    """The project modules one file imports (absolute and relative, at any depth)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `from pkg import name`: the module, else its package
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    edges = {name: imported(path, name, known) for name, path in mods.items()}
    # importing a package's __init__ is not an edge to its submodules, nor the reverse
    return {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in edges.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    assert cycles(graph()) == []


def test_roles_and_common_never_import_cluster():
    upward = sorted(f"{m} -> {t}" for m, ts in graph().items() if m.split(".")[0] in ROLES
                    for t in ts if t.split(".")[0] == "cluster")
    assert upward == []


def test_nothing_outside_the_cli_imports_it():
    inward = sorted(f"{m} -> {t}" for m, ts in graph().items() if not m.startswith("cluster.cli")
                    for t in ts if t == "cluster.cli" or t.startswith("cluster.cli."))
    assert inward == []


def test_the_walk_sees_circles_and_upward_imports(tmp_path):
    """The checks above can fail: a circle and an upward import written here are found."""
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c"]]
    pkg = tmp_path / "learner"
    pkg.mkdir()
    f = pkg / "x.py"
    f.write_text("def f():\n    from cluster.driver import driver\n    from . import y\n")
    (pkg / "y.py").write_text("")
    known = {"learner.x", "learner.y", "cluster.driver", "cluster.driver.driver"}
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert imported(f, module_name(f), known) == {"cluster.driver", "cluster.driver.driver", "learner.y"}
    finally:
        ROOT = saved


# Formulas may run long: each maps line by line to docs/algorithm.md, and splitting one would
# break that reading (none does today: compute_loss is split by meaning). Benchmarks are outside
# the packages measured here.
FORMULAS: set[str] = set()
MAX_FUNCTION_LINES = 60
MAX_DRIVER_LINES = 450


def long_functions(limit: int = MAX_FUNCTION_LINES) -> list[str]:
    out = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    where = f"{path.relative_to(ROOT).as_posix()}:{node.name}"
                    if node.end_lineno - node.lineno + 1 > limit and where not in FORMULAS:
                        out.append(f"{where} ({node.end_lineno - node.lineno + 1} lines)")
    return out


def test_no_function_is_over_60_lines():
    assert long_functions() == []


def test_the_driver_is_at_most_450_lines():
    tree = ast.parse((ROOT / "cluster" / "driver" / "driver.py").read_text(encoding="utf-8"))
    (driver,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Driver"]
    assert driver.end_lineno - driver.lineno + 1 <= MAX_DRIVER_LINES


def test_the_length_check_can_fail():
    assert long_functions(limit=5)  # the packages hold functions longer than 5 lines
