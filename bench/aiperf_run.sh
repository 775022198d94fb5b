#!/usr/bin/env bash
# NVIDIA aiperf (the issue's client) against `deepserve serve` of the embedded model, with aiperf's default
# options (its default mode sends max_completion_tokens, which the server now honours), the model's own
# tokenizer, and nothing from a hub.
#
#   bash bench/aiperf_run.sh [AIPERF_BIN] [OUT_DIR] [AIPERF_OPTION ...]
#
# aiperf 0.13.0's defaults send no length field (10 requests of 550 prompt tokens, not streamed), so the server's
# default limit applies; `--output-tokens-mean 32` makes it send `max_completion_tokens` (and the extra options
# go to `aiperf profile` as they are).
#
# aiperf is not in the test extra (it pins pandas and orjson below what lm-eval and litellm bring): install it in a
# venv of its own, `python -m venv /tmp/aiperf-venv && /tmp/aiperf-venv/bin/pip install aiperf`.
set -euo pipefail
cd "$(dirname "$0")/.."
AIPERF=${1:-/tmp/aiperf-venv/bin/aiperf}
OUT=${2:-bench/results/aiperf}
shift $(( $# < 2 ? $# : 2 ))
MODEL_DIR=$(pwd)/deepserve/assets/deepserve-tiny-v4
PORT=$(.venv/bin/python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} .venv/bin/python -m deepserve serve "$MODEL_DIR" --host 127.0.0.1 \
    --port "$PORT" --served-model-name tiny --accelerator cpu --dtype float32 --max-model-len 2048 \
    --block-size 128 --max-num-seqs 8 --thinking off --log-level warning &
SERVER=$!
trap 'kill -INT $SERVER; wait $SERVER' EXIT
for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
    sleep 0.5
done
"$AIPERF" profile --model tiny --url "http://127.0.0.1:$PORT" --endpoint-type chat \
    --tokenizer "$MODEL_DIR" --artifact-dir "$OUT" --no-auto-plot "$@"
