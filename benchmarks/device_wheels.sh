#!/usr/bin/env bash
# The wheels the device check (benchmarks/device_check.py) needs that a GPU host with only torch,
# numpy, transformers and peft lacks, pinned to the versions this checkout runs, downloaded here
# (the GPU host has no network) into a git-ignored folder that travels with the command.
#   bash benchmarks/device_wheels.sh [DIR] [PYTHON_VERSION]   # default: .device_wheels 3.12
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-.device_wheels}"
pyver="${2:-3.12}"
PY="${PYTHON:-.venv/bin/python}"
mapfile -t pins < <("$PY" - <<'PYEOF'
from importlib.metadata import version
for d in ("diffusers", "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions",
          "pillow"):
    print(f"{d}=={version(d)}")
PYEOF
)
rm -rf "$dir" && mkdir -p "$dir"
"$PY" -m pip download --quiet --disable-pip-version-check --only-binary=:all: --no-deps \
    --python-version "$pyver" --implementation cp --abi "cp${pyver/./}" --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d "$dir" "${pins[@]}"
echo "device_wheels: $(ls "$dir" | wc -l) wheels, $(du -sh "$dir" | cut -f1) in $dir for Python $pyver"
