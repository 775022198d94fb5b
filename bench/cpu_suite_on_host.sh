#!/usr/bin/env bash
# The CPU test suite on another machine's CPU (the GPU machine's host: an AVX-512 Xeon), with the GPU hidden, so
# that bit-exact claims are checked on more than one instruction set. One device call:
#
#   bash bench/cpu_suite_on_host.sh [pytest args...]
#
# Wheels the machine lacks travel in .whl/ (transformers 5.24.0, deepseek-recipe, llguidance, pytest-asyncio,
# pytest-aiohttp); test files whose imports are still missing there are reported as collection errors, not run.
# If .old/ holds an earlier tree (`git archive <commit> deepserve tests pyproject.toml | tar -x -C .old`), its
# bit-exact tests run first, as the baseline of the same machine. Logs land in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
. bench/device_env.sh
export CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
WORKERS=$(( $(nproc) > 2 ? $(nproc) - 2 : 1 ))
{ grep -m1 'model name' /proc/cpuinfo; grep -o 'avx512[a-z]*' /proc/cpuinfo | sort -u | tr '\n' ' '; echo;
  python3 -c "import torch; print('torch', torch.__version__, torch.backends.cpu.get_cpu_capability())"; } | tee "$OUT/cpu.txt"
BITWISE="tests/test_cuda_graphs.py tests/test_model_parity.py tests/test_speculative_rollback.py"
if [ -d .old/deepserve ]; then
    echo "== the earlier tree's bit-exact tests"
    (cd .old && PYTHONPATH=/tmp/site:$PWD python3 -m pytest -q -p no:cacheprovider -n "$WORKERS" -m "not gpu" \
        $BITWISE 2>&1 | tee "$OUT/old_bitwise.log" | tail -15)
fi
echo "== this tree's CPU suite ($WORKERS workers)"
python3 -m pytest -q -p no:cacheprovider -n "$WORKERS" -m "not gpu" \
    --continue-on-collection-errors "$@" 2>&1 | tee "$OUT/cpu_suite.log" | tail -40
