#!/usr/bin/env bash
# Create .venv (once) and install deepserve with its test extra. Safe to run again: it only adds what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# The CPU build of torch; an unpinned torch would pull a multi-GB CUDA build. Skip if a torch is already there.
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test]"
# xgrammar's optional backend: its wheel declares triton and a CUDA torch as requirements, which it does not need
# for grammar masks on the CPU; install it without them so the xgrammar tests run here too.
python -c "import xgrammar" 2>/dev/null || python -m pip install -q --no-deps "xgrammar==0.2.9" "apache-tvm-ffi==0.1.15.post2"
# Triton's CPU interpreter runs the NVIDIA backend's kernels in the CPU suite (tests/test_quant_triton.py,
# tests/test_nvidia_interpreted.py): its wheel alone (the GPU machine's 3.6), torch being there already.
python -c "import triton" 2>/dev/null || python -m pip install -q --no-deps "triton==3.6.0"
# The Redis block store's tests start a redis-server of their own (tests/test_cache_redis.py): Debian's package where
# apt-get can install it (CI and developers' machines run as root); the tests skip, saying why, without one.
# The Mooncake store's tests (tests/test_cache_mooncake.py) start a mooncake_master of their own from Mooncake's
# CPU wheel, which links libibverbs1; the same rule: installed where it can be, else those tests skip saying why.
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    missing=()
    command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
    [ -e /usr/lib/x86_64-linux-gnu/libibverbs.so.1 ] || dpkg -s libibverbs1 >/dev/null 2>&1 || missing+=(libibverbs1)
    if [ ${#missing[@]} -gt 0 ]; then
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"; } \
            >/dev/null 2>&1 || echo "bootstrap: could not install ${missing[*]}; the Redis / Mooncake store tests will skip" >&2
    fi
fi
python -c "import mooncake.store" 2>/dev/null || python -m pip install -q "mooncake-transfer-engine-non-cuda==0.3.13.post1" \
    >/dev/null 2>&1 || echo "bootstrap: could not install Mooncake's wheel; the Mooncake store tests will skip" >&2
