#!/usr/bin/env bash
# Build FlashMLA and DeepEP wheels from DeepSeek's public sources against the GPU machine's torch
# (2.11.0+cu130, Python 3.12), on a CPU-only machine: compiling CUDA needs nvcc, not a GPU.
#
# Why: PyPI's working builds (`sgl-flash-mla`, `sgl-deep-ep`) pin torch 2.14.1 and do not load on
# torch 2.11 (issue 20, item 5). These wheels are built for sm_90a only (H100 / H200).
#
# What it downloads (PyPI only), into $VB (default /tmp/vendor_build, never inside the repository):
#   * a Python 3.12 venv (from pyenv's 3.12 here, or PY312=/path/to/python3.12),
#   * torch==2.11.0 (PyPI's cp312 manylinux_2_28 wheel is +cu130) with its dependencies, which bring
#     the CUDA 13.0 libraries and headers it was built against: cuda-toolkit 13.0.2 (cublas, cudart,
#     cusparse, ...), nvidia-nccl-cu13 2.28.9 and nvidia-nvshmem-cu13 3.4.5 (what DeepEP links),
#   * cuda-toolkit[nvcc,cccl,crt,nvvm,cudart,culibos,profiler]==13.0.2: nvcc 13.0.88 (the GPU machine's
#     nvcc is 13.0 too), CCCL 13.0.85. They land in site-packages/nvidia/cu13, which is CUDA_HOME.
#     (triton 3.6.0, a torch dependency, carries cuobjdump, used for the check at the end.)
#   about 3.5 GB on disk.
# From Debian (apt-get download, unpacked with dpkg -x, not installed): libibverbs-dev (bookworm: 44.0-2),
#   for the rdma-core headers (<infiniband/mlx5dv.h>) that NVSHMEM's headers include in DeepEP's build.
# Sources (git; GitHub, or bare mirrors named by the *_GIT variables below):
#   deepseek-ai/FlashMLA  9241ae3ef9bac614dd25e45e507e089f888280e0 (main, 2026-04-29)
#     + its submodule NVIDIA/cutlass at 147f5673d0c1c3dcf66f78d677fd647e4a020219 (the pinned commit;
#     only include/ and tools/util/include/ are exported)
#   deepseek-ai/DeepEP    567632dd59810d77b3cc05553df953cc0f779799 (2026-02-03, 1.2.1: the last commit
#     before V2; needs NVSHMEM only, which torch 2.11 already brings: nvidia-nvshmem-cu13 3.4.5)
#   optional, stage `deepep_v2`: DeepEP main dd758caf451848bd150e1046af3d0a73e5fff38d (2026-07-14, V2)
#     + its submodule fmtlib/fmt at a4c7e17133ee9cb6a2f45545f6e974dd3c393efa. V2 needs NCCL >= 2.30.4
#     (its NCCL "GIN" device API; torch 2.11 ships 2.28.9, whose headers lack it), so that stage builds
#     against nvidia-nccl-cu13==2.32.6 (a 207 MB wheel) and the result loads only where that NCCL is the
#     one loaded: next to torch 2.11's own 2.28.9 its import stops at
#     "undefined symbol: ncclCommQueryProperties".
#   FLASHMLA_REV / DEEPEP_REV / DEEPEP_V2_REV override the commits (submodule commits are read from them).
#
# Build settings: sm_90a only (FlashMLA: FLASH_MLA_DISABLE_SM100=1, which leaves
# `-gencode arch=compute_90a,code=sm_90a`; DeepEP: TORCH_CUDA_ARCH_LIST=9.0a), MAX_JOBS=1, NVCC_THREADS=1,
# `nice -n 19`, each build capped by BUILD_TIMEOUT (default 60m). Patches, applied with sed to the
# exported sources (nothing of these projects is kept in this repository):
#   FlashMLA: drop `-lineinfo` and `--source-in-ptx` (line tables and PTX source only grow the binary),
#             version `1.0.0+<short commit>` instead of a build timestamp (the tree is no git checkout).
#   DeepEP:   version `1.2.1+<short commit>` likewise (V2: `2.1.0+<short commit>` instead of `+local`).
#   No source file needed a change to build against torch 2.11 / CUDA 13.0.
# Both: host debug info (Python's CFLAGS carry -g) is stripped from the extension (`strip --strip-debug`)
# and the wheel re-packed. DeepEP's extension gets extra run paths so that it finds NVSHMEM (V2: and NCCL)
# next to torch: `$ORIGIN/nvidia/nvshmem/lib` (installed in torch's site-packages) and the GPU machine's
# `/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nvshmem/lib` (installed with --target elsewhere);
# the build machine's own path, which setup.py adds, is harmless there. V2's kernels are JIT-compiled at
# run time by the machine's own nvcc.
#
# Output: the wheels in $OUT_DIR (default <repo>/.whl/, ignored through .git/info/exclude), logs in
# $VB/logs. Usage: scripts/build_vendor_kernels.sh [env|sources|flashmla|deepep|deepep_v2|verify|all]
# (default all = env sources flashmla deepep verify; deepep_v2 only when named)
#
# Timing here (2 CPU cores shared with other work, one compile job at a time, PyPI on a fast mirror):
# env about 1 min, FlashMLA about 11 min (24 objects), DeepEP 2 min, DeepEP V2 3 min. Wheels:
# flash_mla 0.7 MiB, deep_ep 5.8 MiB (V2 6.2 MiB). See docs/quantization.md, "Vendor kernels".
# Example (this machine reaches GitHub only through local bare mirrors):
#   FLASHMLA_GIT=/work/.mirror/deepseek-ai+FlashMLA/repo CUTLASS_GIT=/work/.mirror/NVIDIA+cutlass/repo \
#   DEEPEP_GIT=/work/.mirror/deepseek-ai+DeepEP/repo FMT_GIT=/work/.mirror/fmtlib+fmt/repo \
#   scripts/build_vendor_kernels.sh all
set -euo pipefail

REPO=${REPO:-$(cd "$(dirname "$0")/.." && pwd)}
VB=${VB:-/tmp/vendor_build}
OUT_DIR=${OUT_DIR:-$REPO/.whl}
PY312=${PY312:-}
BUILD_TIMEOUT=${BUILD_TIMEOUT:-60m}
FLASHMLA_GIT=${FLASHMLA_GIT:-https://github.com/deepseek-ai/FlashMLA.git}
DEEPEP_GIT=${DEEPEP_GIT:-https://github.com/deepseek-ai/DeepEP.git}
CUTLASS_GIT=${CUTLASS_GIT:-https://github.com/NVIDIA/cutlass.git}
FMT_GIT=${FMT_GIT:-https://github.com/fmtlib/fmt.git}
FLASHMLA_REV=${FLASHMLA_REV:-9241ae3ef9bac614dd25e45e507e089f888280e0}
DEEPEP_REV=${DEEPEP_REV:-567632dd59810d77b3cc05553df953cc0f779799}
DEEPEP_V2_REV=${DEEPEP_V2_REV:-dd758caf451848bd150e1046af3d0a73e5fff38d}
NCCL_V2_VERSION=2.32.6
TORCH_VERSION=2.11.0
CUDA_TOOLKIT_VERSION=13.0.2

mkdir -p "$VB/logs" "$OUT_DIR"
PY="$VB/venv/bin/python"
SITE="$VB/venv/lib/python3.12/site-packages"
export CUDA_HOME="$SITE/nvidia/cu13"
log() { echo "[$(date +%H:%M:%S)] $*"; }

stage_env() {
    if [ ! -x "$PY" ]; then
        if [ -z "$PY312" ]; then
            PY312=$(ls -d /root/.pyenv/versions/3.12.*/bin/python3.12 2>/dev/null | tail -1 || true)
            [ -n "$PY312" ] || PY312=$(command -v python3.12)
        fi
        log "venv from $PY312"
        "$PY312" -m venv "$VB/venv"
    fi
    "$PY" -m pip install -q -U pip wheel "setuptools<82" ninja
    log "torch $TORCH_VERSION (cp312, +cu130) and its CUDA 13 libraries"
    "$PY" -m pip install -q "torch==$TORCH_VERSION" numpy
    "$PY" -c "import torch; assert torch.version.cuda == '13.0', torch.version.cuda; print('torch', torch.__version__)"
    log "nvcc and headers: cuda-toolkit $CUDA_TOOLKIT_VERSION"
    "$PY" -m pip install -q "cuda-toolkit[nvcc,cccl,crt,nvvm,cudart,culibos,profiler]==$CUDA_TOOLKIT_VERSION"
    # The wheels ship only versioned SONAME files and no lib64; torch's cpp_extension links
    # -L$CUDA_HOME/lib64 -lcudart.
    ln -sfn lib "$CUDA_HOME/lib64"
    ln -sf libcudart.so.13 "$CUDA_HOME/lib/libcudart.so"
    # No driver is needed to build, but DeepEP links `-lcuda` (it calls cuMem* directly), and the PyPI
    # toolkit has no lib/stubs/libcuda.so. So make the stub the full toolkit has: every function that
    # cuda.h declares (names as the header's macros spell them, e.g. cuMemAlloc_v2), empty, in a
    # library whose SONAME is the driver's, libcuda.so.1. The extension then names libcuda.so.1 in
    # DT_NEEDED and the real driver's library resolves those symbols at load, as with a normal build.
    mkdir -p "$VB/stubs"
    echo '#include <cuda.h>' | gcc -E -P -I"$CUDA_HOME/include" -x c - \
        | grep -oE '\bCUresult +cu[A-Za-z0-9_]+ *\(' | sed -E 's/CUresult +//; s/ *\(//' | sort -u \
        | awk '{print "void " $1 "(void) {}"}' > "$VB/stubs/libcuda_stub.c"
    gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$VB/stubs/libcuda.so" "$VB/stubs/libcuda_stub.c"
    echo "libcuda stub: $(wc -l < "$VB/stubs/libcuda_stub.c") driver functions"
    # DeepEP includes NVSHMEM's IBGDA headers, which include <infiniband/mlx5dv.h> (rdma-core). Only the
    # headers are needed (nothing links libibverbs): Debian's libibverbs-dev, unpacked, not installed.
    mkdir -p "$VB/debs"
    if [ ! -f "$VB/rdma/usr/include/infiniband/mlx5dv.h" ]; then
        (cd "$VB/debs" && apt-get download libibverbs-dev)
        dpkg -x "$VB"/debs/libibverbs-dev_*.deb "$VB/rdma"
    fi
    "$CUDA_HOME/bin/nvcc" --version | tail -2
}

# git_export URL_OR_GITDIR REV DEST [PATHS...]: the tree of REV, without a work tree of our own.
# (A partial mirror may lack blobs outside PATHS: the CUTLASS mirror here makes `git archive` print
# "error: invalid object ... media/images/..." and still export include/ and tools/util/include/ whole.)
git_export() {
    local src=$1 rev=$2 dest=$3; shift 3
    local gd=$src
    if [ ! -d "$src" ]; then
        gd="$VB/git/$(basename "$src" .git).git"
        [ -d "$gd" ] || git clone -q --bare "$src" "$gd"
    fi
    rm -rf "$dest"; mkdir -p "$dest"
    git --git-dir="$gd" archive --format=tar "$rev" "$@" | tar -x -C "$dest"
}

submodule_rev() {  # submodule_rev GITDIR_OR_URL REV PATH
    local src=$1 gd=$1
    [ -d "$src" ] || gd="$VB/git/$(basename "$src" .git).git"
    git --git-dir="$gd" ls-tree "$2" "$3" | awk '{print $3}'
}

stage_sources() {
    log "FlashMLA $FLASHMLA_REV"
    git_export "$FLASHMLA_GIT" "$FLASHMLA_REV" "$VB/src/FlashMLA"
    local cut; cut=$(submodule_rev "$FLASHMLA_GIT" "$FLASHMLA_REV" csrc/cutlass)
    log "CUTLASS $cut (headers only)"
    git_export "$CUTLASS_GIT" "$cut" "$VB/src/FlashMLA/csrc/cutlass" include tools/util/include
    local short=${FLASHMLA_REV:0:7}
    sed -i -e 's/"-lineinfo",//' -e 's/"--source-in-ptx",//' \
        -e "s/version=\"1.0.0\" + rev,/version=\"1.0.0+$short\",/" "$VB/src/FlashMLA/setup.py"
    grep -q "1.0.0+$short" "$VB/src/FlashMLA/setup.py"
    ! grep -q -- '-lineinfo' "$VB/src/FlashMLA/setup.py"

    log "DeepEP $DEEPEP_REV"
    git_export "$DEEPEP_GIT" "$DEEPEP_REV" "$VB/src/DeepEP"
    short=${DEEPEP_REV:0:7}
    sed -i -e "s/revision = ''$/revision = '+$short'/" "$VB/src/DeepEP/setup.py"
    grep -q "'+$short'" "$VB/src/DeepEP/setup.py"
}

sources_deepep_v2() {
    log "DeepEP V2 $DEEPEP_V2_REV"
    git_export "$DEEPEP_GIT" "$DEEPEP_V2_REV" "$VB/src/DeepEP-v2"
    local fmt; fmt=$(submodule_rev "$DEEPEP_GIT" "$DEEPEP_V2_REV" third-party/fmt)
    log "fmt $fmt (headers only)"
    git_export "$FMT_GIT" "$fmt" "$VB/src/DeepEP-v2/third-party/fmt" include
    local short=${DEEPEP_V2_REV:0:7}
    sed -i -e "s/revision = '+local'/revision = '+$short'/" \
           -e "s/status_cmd = \['git', 'status', '--porcelain'\]/status_cmd = ['false']/" "$VB/src/DeepEP-v2/setup.py"
    grep -q "'+$short'" "$VB/src/DeepEP-v2/setup.py"
}

# strip_wheel WHEEL: strip host debug info from the extension modules, re-pack under the same name.
strip_wheel() {
    local whl=$1 tmp="$VB/repack"
    rm -rf "$tmp"; mkdir -p "$tmp"
    "$PY" -m wheel unpack -d "$tmp" "$whl" >/dev/null
    find "$tmp" -name '*.so' -exec strip --strip-debug {} \;
    rm -f "$whl"
    "$PY" -m wheel pack -d "$(dirname "$whl")" "$tmp"/* >/dev/null
}

build_common_env() {
    export PATH="$CUDA_HOME/bin:$PATH" MAX_JOBS=1 NVCC_THREADS=1
    export LIBRARY_PATH="$VB/stubs:$CUDA_HOME/lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
    # CUDA 13 keeps CCCL (cuda/std, cub, thrust) in include/cccl: nvcc adds it itself, the host compiler
    # (.cpp files that include CUTLASS) does not, and torch 2.11's cpp_extension passes only include/.
    export CPLUS_INCLUDE_PATH="$CUDA_HOME/include/cccl"
}

# `setup.py bdist_wheel` in the current folder (capped, niced, logged as $VB/logs/LOG.log), then the wheel's
# debug info stripped and the wheel copied to DEST: build_wheel NAME LOG DEST
build_wheel() {
    local name=$1 logf="$VB/logs/$2.log" dest=$3
    rm -rf build dist
    log "$name: building (log $logf)"
    local t0=$SECONDS
    timeout "$BUILD_TIMEOUT" nice -n 19 "$PY" setup.py bdist_wheel > "$logf" 2>&1 \
        || { log "$name build failed or timed out (rc $?): tail of the log:"; tail -30 "$logf"; return 1; }
    log "$name built in $(( (SECONDS - t0) / 60 )) min"
    local whl; whl=$(ls dist/*.whl)
    strip_wheel "$whl"
    mkdir -p "$dest"
    cp dist/*.whl "$dest/"
    ls -la "$dest"/"$(basename "$whl" | cut -d- -f1)"-*.whl
}

stage_flashmla() {
    build_common_env
    export FLASH_MLA_DISABLE_SM100=1 TORCH_CUDA_ARCH_LIST=9.0a
    cd "$VB/src/FlashMLA"
    build_wheel FlashMLA flashmla "$OUT_DIR"
}

stage_deepep() {
    build_common_env
    export TORCH_CUDA_ARCH_LIST=9.0a
    unset NVSHMEM_DIR  # setup.py then finds nvidia.nvshmem (torch's 3.4.5) and links libnvshmem_host.so.3
    export CPLUS_INCLUDE_PATH="$CPLUS_INCLUDE_PATH:$VB/rdma/usr/include"
    # Extra run paths (see the header). distutils appends LDFLAGS to the link command; no shell runs it,
    # so $ORIGIN stays literal.
    local rp='$ORIGIN/nvidia/nvshmem/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nvshmem/lib'
    export LDFLAGS="-Wl,-rpath,$rp"
    cd "$VB/src/DeepEP"
    build_wheel DeepEP deepep "$OUT_DIR"
}

stage_deepep_v2() {
    build_common_env
    sources_deepep_v2
    local nccl="$VB/nccl-$NCCL_V2_VERSION"
    [ -d "$nccl/nvidia/nccl" ] || "$PY" -m pip install -q --no-deps --target "$nccl" "nvidia-nccl-cu13==$NCCL_V2_VERSION"
    export TORCH_CUDA_ARCH_LIST=9.0a
    export EP_NVSHMEM_ROOT_DIR="$SITE/nvidia/nvshmem" EP_NCCL_ROOT_DIR="$nccl/nvidia/nccl"
    # setup.py links -l:libnccl.so.2 with no -L for it (it expects NCCL where the linker looks anyway)
    export LIBRARY_PATH="$LIBRARY_PATH:$nccl/nvidia/nccl/lib"
    export CPLUS_INCLUDE_PATH="$CPLUS_INCLUDE_PATH:$VB/rdma/usr/include"
    local rp='$ORIGIN/../nvidia/nccl/lib:$ORIGIN/../nvidia/nvshmem/lib'
    rp="$rp:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nvshmem/lib"
    export LDFLAGS="-Wl,-rpath,$rp"
    cd "$VB/src/DeepEP-v2"
    build_wheel "DeepEP V2" deepep_v2 "$OUT_DIR/v2"
}

stage_verify() {
    # What a CPU machine can check: the wheel installs into a Python 3.12 target folder, its extension
    # carries sm_90a machine code (cuobjdump) and no host debug info, its libraries resolve (ldd), and
    # it imports next to torch 2.11.0+cu130 with every symbol bound at load (LD_BIND_NOW=1). There is
    # no driver here: whatever needs libcuda.so.1 stops at that, which the output shows.
    local cuobjdump="$SITE/triton/backends/nvidia/bin/cuobjdump"  # triton 3.6.0 carries CUDA 12.8's
    for whl in "$OUT_DIR"/flash_mla-*.whl "$OUT_DIR"/deep_ep-*.whl "$OUT_DIR"/v2/deep_ep-*.whl; do
        [ -f "$whl" ] || continue
        log "verify $(basename "$whl") ($(du -h "$whl" | cut -f1))"
        local tgt; tgt="$VB/verify/$(basename "$(dirname "$whl")")-$(basename "$whl" .whl)"
        rm -rf "$tgt"
        "$PY" -m pip install -q --no-deps --no-index --target "$tgt" "$whl"
        for so in $(find "$tgt" -name '*.so'); do
            echo "  $so: $(du -h "$so" | cut -f1)"
            "$cuobjdump" --list-elf "$so" | awk '{print $NF}' | sort | uniq -c | sed 's/^/    elf: /'
            "$cuobjdump" --list-ptx "$so" 2>&1 | head -3 | sed 's/^/    ptx: /'
            local sass; sass="$VB/logs/$(basename "$so").sass"
            "$cuobjdump" --dump-sass "$so" > "$sass" 2>&1 || true
            echo "    sass: $(grep -c '^arch = sm_90a' "$sass") cubins with 'arch = sm_90a', $(grep -c '^arch = ' "$sass") in all;" \
                 "$(grep -c -E 'HGMMA|QGMMA' "$sass") wgmma instructions (HGMMA/QGMMA, sm_90a only)"
            readelf -d "$so" | grep -E 'NEEDED|RUNPATH|RPATH' | sed 's/^ */    /'
            echo "    debug sections: $(readelf -S -W "$so" | grep -c '\.debug' || true)"
            LD_LIBRARY_PATH="$SITE/torch/lib:$CUDA_HOME/lib" ldd "$so" | grep 'not found' | sed 's/^/    ldd: /' || true
        done
        local mod
        case "$(basename "$whl")" in
            flash_mla-*) mod="import torch, flash_mla, flash_mla.cuda as ext; print('ok:', flash_mla.__file__, sorted(n for n in dir(ext) if not n.startswith('_')))" ;;
            *) mod="import torch, deep_ep; print('ok:', deep_ep.__file__)" ;;
        esac
        echo "  import (LD_BIND_NOW=1, no driver):"
        (cd / && PYTHONPATH="$tgt" LD_BIND_NOW=1 "$PY" -c "$mod" 2>&1 | tail -2 | sed 's/^/    /') || true
        echo "  import with the libcuda.so.1 stub (empty functions) on the library path:"
        mkdir -p "$VB/stubs/so1"; ln -sf ../libcuda.so "$VB/stubs/so1/libcuda.so.1"
        (cd / && PYTHONPATH="$tgt" LD_LIBRARY_PATH="$VB/stubs/so1" "$PY" -c "$mod" 2>&1 | tail -2 | sed 's/^/    /') || true
        (cd / && PYTHONPATH="$tgt" LD_LIBRARY_PATH="$VB/stubs/so1" LD_BIND_NOW=1 "$PY" -c "$mod" 2>&1 | tail -1 | sed 's/^/    bound now: /') || true
    done
}

case "${1:-all}" in
    env) stage_env ;;
    sources) stage_sources ;;
    flashmla) stage_flashmla ;;
    deepep) stage_deepep ;;
    deepep_v2) stage_deepep_v2 ;;
    verify) stage_verify ;;
    all) stage_env; stage_sources; stage_flashmla; stage_deepep; stage_verify ;;
    *) echo "usage: $0 [env|sources|flashmla|deepep|deepep_v2|verify|all]"; exit 2 ;;
esac
