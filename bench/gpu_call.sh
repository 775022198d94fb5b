#!/usr/bin/env bash
# The NVIDIA backend's checks and timings on one GPU machine, picked by name for one device call (device time is
# scarce; each part writes into $OUT as it goes, so a call cut short still returns what it finished). Wheels the
# machine lacks travel in .whl/ (deepseek-recipe for the tokenizer tests, the server parts and every test that
# builds the demo checkpoint, whose tokenizer holds the recipe's special tokens; sgl-deep-gemm 0.1.5 with apache-tvm-ffi
# 0.1.11 for the DeepGEMM path: `pip download --no-deps sgl-deep-gemm==0.1.5` and the cp312 wheel).
#
#   bash bench/gpu_call.sh "kernels graphs trace" [bench/gpu.py options for the bench part...]
#
# kernels: the kernel tests of tests/gpu/test_kernels.py; graphs: the CUDA-graph tests; all_tests: every GPU test
# (gpu_tests.log); sweep_gemv: bench/investigations/kernel_sweep.py --only gemv; trace: bench/decode_trace.py at
# batch 1 and 64; decode: bench/gpu.py --decode-only (transformers' rows reused from run 3); quant: the stored-precision
# kernel tests; stored: bench/stored_precision.py; kv_tiers: bench/kv_tiers.py on the GPU; determinism:
# bench/investigations/determinism.py; cpu_bg: the CPU suite on the host's CPU in the background (cpu_bg.log,
# cpu_suite.log; it must finish before the call ends); bench: the whole
# bench/gpu.py (gpu_bench.log/.json/.png) with the options given after the parts, e.g. --reuse-hf
# bench/results/gpu_bench_h200_transformers.json. bench/gpu_all.sh is "all_tests bench". train_profile:
# bench/investigations/train_profile.py; sync_points: bench/investigations/sync_points.py (where LLM.generate's
# decode steps wait for the GPU, at 256 sequences); step_timeline: bench/investigations/step_timeline.py (LLM.generate's
# steps at 256 sequences by kind: prefill, mixed, decode); fp4_moe_paths: bench/investigations/fp4_moe_paths.py (the
# FP4 experts' per-pair GEMVs against the grouped kernels at a decode step's few tokens); picked: the GPU tests named in $PICKED (files or node ids). e2e_startup,
# e2e_offline, e2e_server, e2e_speculative, e2e_invariance: that part of bench/e2e.py (one a call: each takes up to
# ~9 minutes; e2e_startup first on a fresh machine, for the cold start; the checkpoint is written once into
# /tmp/deepserve_e2e_ckpt, where a later call on the same machine finds it; $E2E_SPEC_ARGS: options for
# bench/spec_graphs.py in e2e_speculative, e.g. "--dtype float32"). flash_mla: tests/gpu/test_flash_mla_gpu.py and
# bench/flash_mla_decode.py (carry .whl/flash_mla-*.whl, built by scripts/build_vendor_kernels.sh); flash_mla_bench: the
# benchmark alone.
set -uo pipefail
cd "$(dirname "$0")/.."
. bench/device_env.sh
HF=bench/results/gpu_bench_h200_transformers.json
PARTS=$1
shift
BENCH_ARGS=("$@")
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
for part in $PARTS; do
    echo "== $part ($(date +%T))"
    case $part in
        kernels) python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_kernels.py 2>&1 | tee "$OUT/kernels.log" | tail -15 ;;
        graphs) python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_cuda_graphs_gpu.py 2>&1 | tee "$OUT/graphs.log" | tail -15 ;;
        all_tests) python3 -m pytest -q -p no:cacheprovider -m gpu ${GPU_TESTS:-tests/gpu} 2>&1 | tee "$OUT/gpu_tests.log" | tail -40 ;;
        sweep_gemv) python3 bench/investigations/kernel_sweep.py --only gemv --out "$OUT" 2>&1 | tee "$OUT/sweep_gemv.log" | grep -v "^  " ;;
        trace) python3 bench/decode_trace.py --batches 1,64 --out "$OUT" 2>&1 | tee "$OUT/trace.log" | tail -30 ;;
        decode) python3 bench/gpu.py --reuse-hf $HF --decode-only --out "$OUT" 2>&1 | tee "$OUT/gpu_bench.log" | tail -40 ;;
        bench) python3 bench/gpu.py --out "$OUT" "${BENCH_ARGS[@]}" 2>&1 | tee "$OUT/gpu_bench.log" | tail -60 ;;
        quant) timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_quant_kernels.py 2>&1 | tee "$OUT/quant_tests.log" | tail -25 ;;
        stored) timeout ${STORED_TIMEOUT:-420} python3 bench/stored_precision.py --out "$OUT" 2>&1 | tee "$OUT/stored_precision.log" | tail -40 ;;
        kv_tiers) timeout 150 python3 bench/kv_tiers.py --accelerator nvidia --out "$OUT/kv_tiers_h200.json" 2>&1 | tee "$OUT/kv_tiers.log" | tail -25 ;;
        determinism) timeout 200 python3 bench/investigations/determinism.py --out "$OUT" 2>&1 | tee "$OUT/determinism.log" | tail -40 ;;
        stale) timeout ${STALE_TIMEOUT:-120} python3 bench/investigations/stale_reads.py --out "$OUT" > "$OUT/stale_reads.log" 2>&1; tail -30 "$OUT/stale_reads.log" ;;
        stored_profile) timeout ${PROFILE_TIMEOUT:-90} python3 bench/investigations/stored_profile.py --out "$OUT" 2>&1 | tee "$OUT/stored_profile.log" | grep -v "^Loading\|^capturing" | tail -40 ;;
        sync_points) timeout ${SYNC_TIMEOUT:-300} python3 bench/investigations/sync_points.py --out "$OUT" 2>&1 | tee "$OUT/sync_points.log" | grep -v "^Loading\|^capturing\|^warming" | tail -50 ;;
        step_timeline) timeout ${TIMELINE_TIMEOUT:-240} python3 bench/investigations/step_timeline.py --out "$OUT" 2>&1 | tee "$OUT/step_timeline.log" | grep -v "^Loading\|^capturing\|^warming" | tail -30 ;;
        fp4_moe_paths) timeout 120 python3 bench/investigations/fp4_moe_paths.py --out "$OUT" 2>&1 | tee "$OUT/fp4_moe_paths.log" | tail -12 ;;
        train_profile) timeout ${TRAIN_PROFILE_TIMEOUT:-120} python3 bench/investigations/train_profile.py --out "$OUT" 2>&1 | grep -v "^  " | tail -45 ;;
        e2e_*) timeout ${E2E_TIMEOUT:-560} python3 bench/e2e.py --part "${part#e2e_}" --out "$OUT" \
            --checkpoint /tmp/deepserve_e2e_ckpt --spec-args "${E2E_SPEC_ARGS:-}" 2>&1 | tee "$OUT/$part.log" | grep -v "^Loading" | tail -40 ;;
        flash_mla) timeout ${FLASH_MLA_TIMEOUT:-300} python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_flash_mla_gpu.py 2>&1 | tee "$OUT/flash_mla_tests.log" | grep -v "^Loading" | tail -30
            timeout 120 python3 bench/flash_mla_decode.py --out "$OUT" 2>&1 | tee "$OUT/flash_mla.log" | tail -12 ;;
        flash_mla_bench) timeout 120 python3 bench/flash_mla_decode.py --out "$OUT" 2>&1 | tee "$OUT/flash_mla.log" | tail -12 ;;
        picked) timeout ${PICKED_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -m gpu ${PICKED} 2>&1 | tee "$OUT/picked_tests.log" | tail -30 ;;
        # a background job of this shell (not a subshell's), so that the `wait` below keeps the call open for it
        cpu_bg) CUDA_VISIBLE_DEVICES= nice -n 19 bash bench/cpu_suite_on_host.sh --timeout 300 > "$OUT/cpu_bg.log" 2>&1 &
            ;;
        *) echo "unknown part $part" ;;
    esac
done
wait  # for cpu_bg
echo "== done ($(date +%T))"
