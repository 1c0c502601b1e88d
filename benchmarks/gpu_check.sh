#!/usr/bin/env bash
# The one GPU check (benchmarks/gpu_check.py): in-process, no Ray, no Redis, no network.
#   bash benchmarks/gpu_check.sh                  # run it; appends figures to benchmarks/results.md
#   bash benchmarks/gpu_check.sh --check-imports  # one line: what is missing on this box
# Without a CUDA GPU it prints one line and exits 0. PYTHON picks the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 570 "${PYTHON:-python3}" -m benchmarks.gpu_check "$@"
