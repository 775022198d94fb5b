#!/usr/bin/env bash
# The embedded model v2's whole training run (issue 24) on one GPU machine, in one device call: corpus and licence
# checks from that machine's own Python and packages, tokenizer, held-out split, training, the confidence head,
# held-out evaluation of v2 and v1 (deepserve/tools/train_v2.py). Only deepseek-recipe (the V4.1 chat rendering)
# travels, as a wheel in .whl/ (bench/device_env.sh installs what is there):
#
#   run: bash bench/train_gpu.sh [train_v2 run options...]     carry: .whl/deepseek_recipe-0.2.0-cp310-abi3-manylinux_2_28_x86_64.whl
#
# $OUT gets the weight shards, bundle.tar.gz (config, tokenizer, held-out ids, confidence head, metrics, logs,
# samples) and run.log.
set -uo pipefail
cd "$(dirname "$0")/.."
. bench/device_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import sys, torch, tokenizers, deepseek_recipe; print('python', sys.version.split()[0], 'torch', torch.__version__, 'tokenizers', tokenizers.__version__)" || exit 1
python3 -m deepserve.tools.train_v2 run "$OUT" --device cuda "$@" 2>&1 | tee "$OUT/run.log" | tr '\r' '\n' | grep --line-buffered -v 'it/s\]$\|s/it\]$'
echo "== exit ${PIPESTATUS[0]} ($(date +%T))"
ls -la "$OUT"
