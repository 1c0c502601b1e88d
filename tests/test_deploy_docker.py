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


def _arg(name: str) -> str:
    return next(rest.split("=", 1)[1] for op, rest in _instructions() if op == "ARG" and rest.startswith(f"{name}="))


def _makefile(pattern: str) -> str:
    (found,) = re.findall(pattern, (ROOT / "Makefile").read_text(), re.M)
    return found


def test_cuda_devel_base_and_non_root_user():
    ins = _instructions()
    # a devel image: torch.compile's Triton compiles with gcc against the CUDA and Python headers
    assert re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-cudnn-devel-ubuntu\d+\.\d+", _arg("BASE_IMAGE"))
    runs = " ".join(rest for op, rest in ins if op == "RUN")
    assert "build-essential" in runs and "python3-dev" in runs
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


def test_torch_is_the_tested_release_as_a_cuda_wheel():
    """The image's torch is the Makefile's TORCH_SPEC, the release every test ran on, and the build
    refuses a CPU-only wheel."""
    assert _arg("TORCH_SPEC") == _makefile(r"^TORCH_SPEC\s*\?=\s*(\S+)\s*$")
    runs = [rest for op, rest in _instructions() if op == "RUN"]
    install = next(r for r in runs if 'pip install "${TORCH_SPEC}"' in r)
    assert "assert torch.version.cuda" in install
    # it is installed before the dependencies and pinned for them, so nothing replaces it
    assert install.index('pip install "${TORCH_SPEC}"') < install.index("grep -i '^torch=='") \
        < install.index("-c /tmp/constraints.txt")
    assert "-c /tmp/constraints.txt" in runs[-1]


def test_hpsv3_wheel_is_pinned_as_in_the_makefile():
    make = _makefile(r'pip install -q --no-deps "(hpsv3==[^"]+)"')
    assert _arg("HPSV3_SPEC") == make == "hpsv3==1.0.0"
    runs = " ".join(rest for op, rest in _instructions() if op == "RUN")
    assert 'pip install --no-deps "${HPSV3_SPEC}"' in runs
    assert "hpsv3_template()" in runs  # the build reads the instruction text the reward needs
