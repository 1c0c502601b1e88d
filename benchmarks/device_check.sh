#!/usr/bin/env bash
# The device check (benchmarks/device_check.py): one call, at most 8 minutes, on a GPU host that
# has torch and numpy. What else it needs comes from the wheels benchmarks/device_wheels.sh put
# in .device_wheels/ (or $VGRPO_WHEELS) beforehand: unpacked offline into a throwaway folder.
#   bash benchmarks/device_check.sh OUT_DIR              # writes OUT_DIR/device_check.{json,md}
#   bash benchmarks/device_check.sh OUT_DIR --smoke-cpu  # the same code path at toy width on a CPU
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: bash benchmarks/device_check.sh OUT_DIR [--smoke-cpu] [--recipes a,b]" >&2; exit 2; }
PY="${PYTHON:-python3}"
wheels="${VGRPO_WHEELS:-.device_wheels}"
site="$(mktemp -d)/site"
trap 'rm -rf "$(dirname "$site")"' EXIT
if compgen -G "$wheels/*.whl" > /dev/null; then
  # a wheel is a zip of the installed files: unpacked, it is installed (no pip, no network)
  "$PY" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' \
      "$site" "$wheels"/*.whl
fi
export VGRPO_WHEEL_SITE="$site"
export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"
timeout 480 "$PY" -m benchmarks.device_check "$@"
