#!/usr/bin/env bash
# Set up (scripts/bootstrap.sh) and run the CPU test suite. GPU tests (marked `gpu`) skip without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=${MKL_NUM_THREADS:-1}
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
