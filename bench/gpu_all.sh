#!/usr/bin/env bash
# Everything the NVIDIA backend needs checked and timed on one GPU machine, in one call (device time is scarce):
# the GPU tests (kernels against the reference, CUDA-graph replay against eager decode, the engine on CUDA), then
# bench/gpu.py. Wheels the machine lacks travel in .whl/ (deepseek-recipe for the tokenizer tests; sgl-deep-gemm 0.1.5
# with apache-tvm-ffi 0.1.11 for the DeepGEMM path: `pip download --no-deps sgl-deep-gemm==0.1.5` and the cp312 wheel).
#
#   bash bench/gpu_all.sh [bench/gpu.py options...]     e.g. --reuse-hf bench/results/gpu_bench_run3.json --decode-only
#
# Writes gpu_tests.log, gpu_bench.log, gpu_bench.json and gpu_bench.png into $OUT (default: ./gpu_out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 -m pytest -q -p no:cacheprovider -m gpu ${GPU_TESTS:-tests/gpu} 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
python3 bench/gpu.py --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_bench.log" | tail -60
