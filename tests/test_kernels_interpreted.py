"""Every `check_*` of tests/gpu/test_kernels.py (the NVIDIA backend's Triton kernels against the reference ops) on
the CPU under Triton's interpreter, at small shapes that still take each kernel's branches: attention split over
the keys and whole, with the inverse RoPE in the merge and in the kernel; the indexer over flat keys and through
block tables; the MoE's grouped GEMMs (one-program and sorted alignment) and `moe_small`; gemv with K split and
whole; the mHC kernels; the decode step's kernels; norms and RoPE; the batch-invariant GEMM. Skipped where triton
is not installed and where a GPU is (tests/gpu/test_kernels.py runs the same checks there at V4-Flash shapes).

The interpreter must be chosen before triton is first imported, so the checks run in one child process started
with TRITON_INTERPRET=1 (this file run as a script, `support_kernels()` first), and each test reads its case's
result. The bounds are the GPU tests' own (fp32 attention, which has none there: 1e-5, as the other fp32 kernels).
"""

from __future__ import annotations

import importlib.util
import sys
import traceback
from pathlib import Path

import pytest
import torch

from interpreted import child_main, run_child

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (scripts/bootstrap.sh installs it for its interpreter)",
                allow_module_level=True)

BF16_TOL = 1e-2
F32 = dict(dtype=torch.float32)


def below(*bounds):
    """Accepts a check's returned errors, each below its bound."""
    return lambda errs: all(e < b for e, b in zip(errs if isinstance(errs, tuple) else (errs,), bounds, strict=True))


def returns_none(result) -> bool:
    return result is None  # the check asserts everything itself


def indexer_ok(result) -> bool:
    err, overlap = result
    return err < 1e-3 and overlap > 0.98  # only near-ties at the cut may differ


# name -> (check in tests/gpu/test_kernels.py, its arguments after the device, what its result must satisfy)
CASES = {
    # K = 256 keys, 4 heads of 64: few programs, so the list split in 2 parts and merged (RoPE in the merge)
    "attention-split": ("check_sparse_attention", dict(T=2, H=4, d=64, N=300, window=64, topk=192), below(BF16_TOL)),
    "attention-split-fp32": ("check_sparse_attention", dict(T=2, H=4, d=64, N=300, window=64, topk=192, **F32),
                             below(1e-5)),
    "attention-split-rope": ("check_sparse_attention", dict(T=2, H=4, d=64, N=300, window=64, topk=192, rope_dim=32),
                             below(BF16_TOL)),
    # d = 256 bf16, a decode-sized step: 16 heads a program, one key block a part
    "attention-few-queries-d256": ("check_sparse_attention", dict(T=2, H=16, d=256, N=200, window=32, topk=96),
                                   below(BF16_TOL)),
    # 40 programs: one part each, the rotation in the attention kernel
    "attention-whole": ("check_sparse_attention", dict(T=40, H=4, d=64, N=200, window=32, topk=32), below(BF16_TOL)),
    "attention-whole-fp32": ("check_sparse_attention", dict(T=40, H=4, d=64, N=200, window=32, topk=32, **F32),
                             below(1e-5)),
    "attention-whole-d256": ("check_sparse_attention", dict(T=40, H=16, d=256, N=200, window=32, topk=32),
                             below(BF16_TOL)),
    "attention-whole-rope": ("check_sparse_attention", dict(T=40, H=4, d=64, N=200, window=32, topk=32, rope_dim=16),
                             below(BF16_TOL)),
    "indexer-flat": ("check_indexer", dict(T=4, Hi=4, Di=32, rows_per_seq=256, topk=64), indexer_ok),
    "indexer-paged": ("check_indexer", dict(T=4, Hi=4, Di=32, rows_per_seq=256, topk=64, rpp=32), indexer_ok),
    # at most top-k keys: every visible one chosen without a top-k
    "indexer-paged-all-visible": ("check_indexer", dict(T=4, Hi=4, Di=32, rows_per_seq=32, topk=64, rpp=16),
                                  indexer_ok),
    # 10 pairs: the one-program alignment, 16-row blocks; 2100 pairs: the sorted alignment, 32-row blocks
    "moe-experts-small": ("check_moe", dict(T=5, D=64, I=32, E=4, top_k=2), below(BF16_TOL)),
    "moe-experts-sorted": ("check_moe", dict(T=700, D=32, I=16, E=4, top_k=3), below(BF16_TOL)),
    "moe-align": ("check_align", dict(T=33, top_k=6, E=32, bm=16), returns_none),
    "moe-small-1": ("check_moe_small", dict(T=1, D=64, I=32, E=8, top_k=3), below(BF16_TOL)),
    "moe-small-4": ("check_moe_small", dict(T=4, D=64, I=32, E=8, top_k=3), below(BF16_TOL)),
    "moe-deep-gemm-layout": ("check_moe_deep_gemm", dict(T=40, D=64, I=32, E=4, top_k=2), below(BF16_TOL)),
    "route": ("check_route", dict(T=20, E=32, top_k=6, hashed=False), below(2e-6)),  # numpy's fp32 math: a few ulps
    "route-hashed": ("check_route", dict(T=20, E=32, top_k=6, hashed=True), below(2e-6)),
    "route-hidden": ("check_route_hidden", dict(T=4, D=256, E=32, top_k=6, hashed=False), below(1e-5)),
    "route-hidden-hashed": ("check_route_hidden", dict(T=3, D=256, E=32, top_k=6, hashed=True), below(1e-5)),
    # gemv: K = 1024 split 2 ways by default (and 3 given), K = 200 whole; grouped
    "gemv-split-k": ("check_gemv", dict(M=3, N=40, K=1024, groups=0), returns_none),
    "gemv-ragged": ("check_gemv", dict(M=1, N=40, K=200, groups=0), returns_none),
    "gemv-grouped": ("check_gemv", dict(M=2, N=48, K=1024, groups=2), returns_none),
    "gemv-norm": ("check_gemv_norm", dict(M=2, N=40, K=1024), returns_none),
    # mHC: 4 tokens, the mix in 32 column parts and 4 programs a token after it; 70 tokens, two 64-token tiles of
    # the mix in 8 parts, one program a token
    "hc-4": ("check_hc", dict(T=4, n=4, D=1024), below(BF16_TOL, 1e-5, 1e-5, BF16_TOL)),
    "hc-70": ("check_hc", dict(T=70, n=4, D=256), below(BF16_TOL, 1e-5, 1e-5, BF16_TOL)),
    "hc-head": ("check_hc_head", dict(T=3, n=4, D=512), below(BF16_TOL)),
    "hc-head-fp32": ("check_hc_head", dict(T=3, n=4, D=512, **F32), below(1e-5)),
    "hc-pre-norm": ("check_hc_pre_norm", dict(T=3, n=4, D=512), below(BF16_TOL)),
    "hc-pre-norm-fp32": ("check_hc_pre_norm", dict(T=3, n=4, D=512, **F32), below(1e-5)),
    "hc-pre-fp32": ("check_hc_pre_fp32", dict(T=3, n=4, D=256), below(1e-5)),
    "hc-pre-fp32-torch-mix": ("check_hc_pre_fp32", dict(T=70, n=4, D=256), below(1e-5)),
    "hc-post-mix": ("check_hc_post_mix", dict(T=4, n=4, D=256), below(BF16_TOL, 1e-3)),
    "hc-post-mix-20": ("check_hc_post_mix", dict(T=20, n=4, D=256), below(BF16_TOL, 1e-3)),  # 64-token tiles
    "hc-head-norm-from-post-mix": ("check_hc_head_norm_from_post_mix", dict(T=2, n=4, D=256), below(BF16_TOL)),
    "swiglu": ("check_swiglu", dict(T=30, I=64), below(BF16_TOL)),
    "rms-norm": ("check_rms_norm", dict(shape=(4, 8, 64), weighted=False), below(BF16_TOL)),
    "rms-norm-weighted": ("check_rms_norm", dict(shape=(7, 1024), weighted=True), below(BF16_TOL)),
    "rms-norm-fp32": ("check_rms_norm", dict(shape=(5, 512), weighted=True, **F32), below(1e-5)),
    "rope": ("check_rope", dict(T=20, H=4, d=128, rope_dim=64, max_pos=32768, inverse=False), below(BF16_TOL)),
    "rope-inverse-one-head": ("check_rope", dict(T=20, H=1, d=128, rope_dim=64, max_pos=32768, inverse=True),
                              below(BF16_TOL)),
    "rope-tiles": ("check_rope", dict(T=20, H=4, d=128, rope_dim=64, max_pos=32768, inverse=True,
                                      tiles=dict(block_t=2, block_m=64, num_warps=4)), below(BF16_TOL)),
    "rope-in-place": ("check_rope_in_place", dict(T=20, H=4, d=128, rope_dim=64, inverse=False), returns_none),
    "rope-in-place-inverse": ("check_rope_in_place", dict(T=20, H=4, d=128, rope_dim=64, inverse=True),
                              returns_none),
    # positions up to 64K (the reference's exact sin/cos table of every position up to the largest costs seconds
    # a 64K on one core)
    "rope-fp32-long-positions": ("check_rope_fp32_long", dict(T=33, H=2, d=128, rope_dim=64, inverse=False,
                                                              max_pos=2**16), below(1e-6)),
    "rope-fp32-long-positions-inverse": ("check_rope_fp32_long", dict(T=33, H=2, d=128, rope_dim=64, inverse=True,
                                                                      max_pos=2**16), below(1e-6)),
    "rms-norm-rope": ("check_norm_rope", dict(shape=(3, 4, 128), rope_dim=64, weighted=False), below(BF16_TOL)),
    "rms-norm-rope-weighted": ("check_norm_rope", dict(shape=(3, 128), rope_dim=64, weighted=True), below(BF16_TOL)),
    "qk-norm-rope": ("check_qk_norm_rope", dict(T=3, H=4, d=128, rope_dim=64), below(BF16_TOL)),
    "compress-decode-csa": ("check_compress_decode", dict(B=4, ratio=4, D=128, overlap=True), below(1e-5)),
    "compress-decode-csa-bf16": ("check_compress_decode", dict(B=4, ratio=4, D=128, overlap=True,
                                                               dtype=torch.bfloat16), below(BF16_TOL)),
    "compress-decode-hca": ("check_compress_decode", dict(B=4, ratio=128, D=128, overlap=False), below(1e-5)),
    # the fused compressor storing the FP8 KV cache's packed rows: its bytes are the codecs' of its own rows
    "compress-decode-fp8-csa": ("check_compress_decode_packed", dict(B=4, ratio=4, D=128, overlap=True, kind="fp8"),
                                below(1e-12)),
    "compress-decode-fp8-hca-tiny": ("check_compress_decode_packed", dict(B=3, ratio=16, D=32, overlap=False,
                                                                          kind="fp8", rope_dim=16), below(1e-12)),
    "compress-decode-fp4-exact": ("check_compress_decode_packed", dict(B=4, ratio=4, D=64, overlap=True, kind="fp4",
                                                                       rope_dim=32, turn="identity"), below(1e-12)),
    "compress-decode-fp4-tiny": ("check_compress_decode_packed", dict(B=3, ratio=4, D=16, overlap=True, kind="fp4",
                                                                      rope_dim=8, turn="identity"), below(1e-12)),
    "compress-decode-fp4-hadamard": ("check_compress_decode_packed", dict(B=4, ratio=4, D=128, overlap=True,
                                                                          kind="fp4"), below(0.01)),
    "paged-window-write": ("check_window_write", dict(T=5, W=16, D=64, slots=10), returns_none),
    "paged-key-rows": ("check_paged_key_rows", dict(T=20, W=16, K=0, rpp=8), returns_none),
    "paged-key-rows-compressed": ("check_paged_key_rows", dict(T=20, W=16, K=12, rpp=8), returns_none),
    "decode-key-rows": ("check_decode_key_rows", dict(T=6, W=16, K=0, rpp=8), returns_none),
    "decode-key-rows-listed": ("check_decode_key_rows", dict(T=6, W=16, K=12, rpp=8), returns_none),
    "decode-key-rows-csa-rule": ("check_decode_key_rows", dict(T=6, W=16, K=8, rpp=8, ratio=4), returns_none),
    "decode-key-rows-hca-rule": ("check_decode_key_rows", dict(T=6, W=16, K=8, rpp=2, ratio=128), returns_none),
    # 130 rows, 2 row tiles and a third; K and N ragged
    "invariant-matmul": ("check_invariant_matmul", dict(M=130, K=100, N=96, rows=(1, 5, 63, 64, 65, 129)),
                         below(BF16_TOL)),
}


def run_cases() -> dict[str, str]:
    """Every case under this process's triton (the child's entry point): name -> 'ok' or the failure."""
    sys.path.insert(0, str(Path(__file__).parent / "gpu"))
    import test_kernels as checks

    results = {}
    for name, (check, kwargs, accept) in CASES.items():
        try:
            result = getattr(checks, check)("cpu", **kwargs)
            results[name] = "ok" if accept(result) else f"out of bounds: {result}"
        except Exception:  # noqa: BLE001 - reported to the parent test by name
            results[name] = traceback.format_exc()
    return results


@pytest.fixture(scope="module")
def interpreted() -> dict[str, str]:
    return run_child(__file__, timeout=600, gpu_twin="tests/gpu/test_kernels.py")


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_against_reference(interpreted, case):
    assert interpreted[case] == "ok", interpreted[case]


if __name__ == "__main__":
    child_main(run_cases)
