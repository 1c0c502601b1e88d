"""Static checks of deploy/docker/Dockerfile (Docker cannot build here)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11+")

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def test_cuda_pytorch_base_and_non_root_user():
    ins = _instructions()
    base = next(rest for op, rest in ins if op == "ARG" and rest.startswith("BASE_IMAGE="))
    assert re.fullmatch(r"BASE_IMAGE=pytorch/pytorch:2\.\d+\.\d+-cuda12\.\d+-cudnn\d-runtime", base)
    users = [rest for op, rest in ins if op == "USER"]
    assert users and users[-1].split(":")[0] in ("${VGRPO_UID}", "1000")
    assert ("ARG", "VGRPO_UID=1000") in ins  # the chart's runAsUser
    assert ins[-1][0] in ("CMD", "ENTRYPOINT") and [op for op, _ in ins].index("USER") < len(ins) - 1


def test_every_package_is_copied_and_installed():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = [p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]]
    copied = {rest.split()[0] for op, rest in _instructions() if op == "COPY"}
    missing = [p for p in packages if p not in copied]
    assert not missing, f"Dockerfile does not COPY {missing}"
    runs = " ".join(rest for op, rest in _instructions() if op == "RUN")
    assert "pip install --no-deps ." in runs and "-c /tmp/constraints.txt" in runs


def test_image_creates_and_owns_the_default_run_root():
    import yaml

    values = yaml.safe_load((ROOT / "deploy" / "helm" / "vgrpo" / "values.yaml").read_text())
    root = values["config"]["run"]["root"]
    ins = _instructions()
    made = [i for i, (op, rest) in enumerate(ins) if op == "RUN" and f"mkdir -p {root}" in rest]
    assert made, f"no RUN creates {root}"
    assert re.search(r'chown -R "?\$\{VGRPO_UID\}:\$\{VGRPO_GID\}"? /var/lib/vgrpo\b', ins[made[0]][1])
    # done as root, before the image switches to the unprivileged user
    assert made[0] < [op for op, _ in ins].index("USER")
