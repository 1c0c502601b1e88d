"""The package's import structure, read statically with `ast` (nothing is imported or run).

- No import circle between modules of the installed packages (a lazy import inside a function
  counts too: it is still a dependency).
- `common/` and the roles (`learner/`, `rollout_worker/`, `reward_worker/`, `memory_bank/`) never
  import `cluster/`: the orchestration layer wires the roles, never the other way.
- Nothing outside `cluster/cli/` imports `cluster.cli`: commands are argparse and printing only.
- No circle between sub-packages either (`cluster.evaluation`, `cluster.runs`, `learner.methods`,
  ...), counting imports inside functions: a lazy import hides a circle from a file-level reading.
- The roles import each other only along the edges docs/architecture.md names, exactly.
- A function-local import never re-imports what the file imports at its top, and the count of
  function-local imports of project modules per package does not grow (each hides an edge).
- Every function-local import says why it is not at the top: `# heavy: torch`, `# optional: wandb`,
  `# lazy: ray (kept out of vgrpo --help)`.
- Each package and each `cluster` sub-package says in its docstring what it owns.
"""

from __future__ import annotations

import ast
import re
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


def test_the_length_check_can_fail():
    assert long_functions(limit=5)  # the packages hold functions longer than 5 lines


# --- sub-packages, role edges, function-local imports, ownership ------------------------------

WORKERS = ("learner", "rollout_worker", "reward_worker", "memory_bank")
DOC = ROOT / "docs" / "architecture.md"


def unit(module: str, root: Path | None = None) -> str:
    """The sub-package a module belongs to: cluster.driver.fleet -> cluster.driver,
    learner.methods.grpo -> learner.methods, learner.trainer -> learner."""
    parts = module.split(".")
    if len(parts) >= 2 and ((root or ROOT) / parts[0] / parts[1]).is_dir():
        return ".".join(parts[:2])
    return parts[0]


def unit_graph(edges: dict[str, set[str]], root: Path | None = None) -> dict[str, set[str]]:
    """Module edges folded onto sub-packages. A package and its own sub-packages are one family
    (learner <-> learner.methods is a parent using its child), so only edges between packages
    that are not parent and child count."""
    out: dict[str, set[str]] = {}
    for m, ts in edges.items():
        a = unit(m, root)
        for t in ts:
            b = unit(t, root)
            if a != b and not a.startswith(b + ".") and not b.startswith(a + "."):
                out.setdefault(a, set()).add(b)
    return out


def role_edges(edges: dict[str, set[str]], root: Path | None = None) -> set[str]:
    """'src -> dst' for every import of one role by another: the importing role, and the imported
    module's sub-package."""
    return {f"{m.split('.')[0]} -> {unit(t, root)}" for m, ts in edges.items() if m.split(".")[0] in WORKERS
            for t in ts if t.split(".")[0] in WORKERS and t.split(".")[0] != m.split(".")[0]}


def documented_role_edges() -> set[str]:
    """The edges docs/architecture.md lists under 'Role -> role imports' (lines '- `a -> b`: why')."""
    text = DOC.read_text(encoding="utf-8")
    section = text.split("### Role → role imports", 1)[1].split("\n#", 1)[0]
    return {line.split("`")[1].replace("→", "->") for line in section.splitlines() if line.startswith("- `")}


def test_no_circle_between_sub_packages():
    assert cycles(unit_graph(graph())) == []


def test_roles_import_each_other_only_along_the_documented_edges():
    documented = documented_role_edges()
    assert documented == {"learner -> rollout_worker.models", "rollout_worker -> reward_worker",
                          "rollout_worker -> memory_bank"}
    assert role_edges(graph()) == documented


def test_a_function_local_import_makes_a_sub_package_circle_that_the_check_sees(tmp_path):
    """Two cluster sub-packages, one importing the other at the top and the other importing back
    inside a function: the file-level reading sees no circle between modules a.x and b.y..., the
    sub-package reading does."""
    for sub, body in {"a": "from cluster.b.y import f\n", "b": "def f():\n    from cluster.a.z import g\n"}.items():
        d = tmp_path / "cluster" / sub
        d.mkdir(parents=True)
        (d / "__init__.py").write_text("")
        (d / ("x.py" if sub == "a" else "y.py")).write_text(body)
    (tmp_path / "cluster" / "a" / "z.py").write_text("def g():\n    pass\n")
    known = {"cluster.a", "cluster.a.x", "cluster.a.z", "cluster.b", "cluster.b.y"}
    files = {"cluster.a.x": tmp_path / "cluster/a/x.py", "cluster.b.y": tmp_path / "cluster/b/y.py"}
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        edges = {m: imported(f, m, known) for m, f in files.items()}
    finally:
        ROOT = saved
    assert cycles(edges) == []  # module level: a.x -> b.y -> a.z, no circle
    assert cycles(unit_graph(edges, tmp_path)) == [["cluster.a", "cluster.b"]]
    assert role_edges({"learner.x": {"memory_bank.keys"}}, tmp_path) == {"learner -> memory_bank"}


def _targets(node: ast.Import | ast.ImportFrom) -> list[str]:
    """The modules an import statement names: `from pkg import mod` names pkg.mod when that is a
    module of the project, else pkg."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    out = []
    for a in node.names:
        sub = ROOT.joinpath(*base.split("."), a.name)
        out.append(f"{base}.{a.name}" if sub.with_suffix(".py").is_file() or sub.is_dir() else base)
    return out


def local_imports(path: Path) -> list[tuple[int, str, bool]]:
    """(line, module, also imported at the file's top) for each import inside a function."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top = {t for n in tree.body if isinstance(n, ast.Import) or (isinstance(n, ast.ImportFrom) and not n.level)
           for t in _targets(n)}
    out = {}
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for n in ast.walk(fn):
                if isinstance(n, ast.Import) or (isinstance(n, ast.ImportFrom) and not n.level):
                    for t in _targets(n):
                        out[(n.lineno, t)] = t in top
    return sorted((line, m, again) for (line, m), again in out.items())


# Function-local imports of the project's own modules, per package, as of the sub-package
# reading above: each is an edge that a file-level reading misses, so the count may only fall.
# A new one (an optional or heavy dependency) raises its package's figure in the same change.
LOCAL_PROJECT_IMPORTS = {"cluster": 71, "common": 1, "learner": 2, "rollout_worker": 3, "reward_worker": 0,
                         "memory_bank": 0}


def test_function_local_imports_do_not_repeat_the_top_and_do_not_grow():
    again, count = [], {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for line, m, dup in local_imports(path):
                if dup:
                    again.append(f"{path.relative_to(ROOT).as_posix()}:{line} {m}")
                if m.split(".")[0] in PACKAGES:
                    count[pkg] = count.get(pkg, 0) + 1
    assert again == []
    over = {p: (n, LOCAL_PROJECT_IMPORTS[p]) for p, n in count.items() if n > LOCAL_PROJECT_IMPORTS[p]}
    assert over == {}


# A function-local import stays only for a dependency that is heavy (torch, ray, diffusers...),
# optional (wandb, mlflow, tensorboard...) or kept out of `vgrpo --help`, and says which: a
# `# heavy: X`, `# optional: X` or `# lazy: X (why)` comment on its line, or on the comment line
# heading its block of adjacent imports.
WHY = re.compile(r"#\s*(heavy|optional|lazy):\s*\S")


def unexplained_local_imports(path: Path) -> list[int]:
    """The lines of the function-local imports in one file that say no reason (imports under
    `if TYPE_CHECKING:` are never run, so they need none)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    tree = ast.parse("\n".join(lines))
    checking = {id(n) for i in ast.walk(tree) if isinstance(i, ast.If) and "TYPE_CHECKING" in ast.unparse(i.test)
                for s in i.body for n in ast.walk(s)}
    found = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found |= {n.lineno for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))
                      and id(n) not in checking}
    ends = {n.lineno: n.end_lineno for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))}
    out = []
    for line in sorted(found):
        start = line
        while not WHY.search(lines[start - 1]):  # up the block of adjacent imports to its first
            above = next((a for a, e in ends.items() if e == start - 1), None)
            if above is None:
                break
            start = above
        if not WHY.search(lines[start - 1]) and not (start >= 2 and WHY.match(lines[start - 2].strip())):
            out.append(line)
    return out


def test_every_function_local_import_says_why():
    bare = [f"{path.relative_to(ROOT).as_posix()}:{line}" for pkg in PACKAGES
            for path in sorted((ROOT / pkg).rglob("*.py")) for line in unexplained_local_imports(path)]
    assert bare == []


def test_the_why_check_can_fail(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from typing import TYPE_CHECKING\n\n"
                 "def f():\n    import os\n\n"                                 # 4: no reason
                 "    # heavy: torch\n    import torch\n    import numpy\n\n"  # a block under one line
                 "    import ray  # lazy: ray (kept out of vgrpo --help)\n"       # its first line says
                 "    import redis\n"
                 "    from x import (  # optional: wandb\n        y,\n    )\n"
                 "\n    import json\n"                                           # 16: a block of its own
                 "    if TYPE_CHECKING:\n        import torch\n")
    assert unexplained_local_imports(f) == [4, 16]


def test_each_package_says_what_it_owns():
    inits = [ROOT / pkg / "__init__.py" for pkg in PACKAGES]
    inits += sorted(p / "__init__.py" for p in (ROOT / "cluster").iterdir() if (p / "__init__.py").is_file())
    silent = [p.relative_to(ROOT).as_posix() for p in inits
              if "Owns" not in (ast.get_docstring(ast.parse(p.read_text(encoding="utf-8"))) or "")]
    assert silent == []


def test_the_actors_modules_import_none_of_what_only_some_variants_need():
    """Every Ray actor process imports its class's module when it starts (again at each restart):
    the toy variant's actors need torch and ray, not peft, transformers, diffusers, or FSDP2 and
    DTensor (sympy: 1.1 s of CPU a learner start was spending), and the bank's URL server needs
    no torch at all. Fresh interpreters, so what another test imported does not count."""
    import subprocess
    import sys

    heavy = ["peft", "transformers", "diffusers", "sympy", "torch.distributed.fsdp", "torch.distributed.tensor"]
    code = ("import sys\n"
            "import memory_bank.url_server, cluster.driver.weight_registry\n"
            "assert 'torch' not in sys.modules, 'the URL server and the weight registry import torch'\n"
            "import learner.actor, rollout_worker.actor, reward_worker.actor\n"
            f"print([m for m in {heavy!r} if m in sys.modules])\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "[]", res.stdout
