#!/usr/bin/env bash
# Everything the NVIDIA backend needs checked and timed on one GPU machine, in one call (device time is scarce):
# the GPU tests (kernels against the reference, CUDA-graph replay against eager decode, the engine on CUDA), then
# bench/gpu.py with the options given (bench/gpu_call.sh's "all_tests bench", which says where the wheels go).
#
#   bash bench/gpu_all.sh [bench/gpu.py options...]     e.g. --reuse-hf bench/results/gpu_bench_h200_transformers.json --decode-only
#
# Writes gpu_tests.log, gpu_bench.log, gpu_bench.json and gpu_bench.png into $OUT (default: ./gpu_out).
exec bash "$(dirname "$0")/gpu_call.sh" "all_tests bench" "$@"
