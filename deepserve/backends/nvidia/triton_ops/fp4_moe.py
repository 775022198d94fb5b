"""Routed experts stored as FP4 (e2m1, one UE8M0 scale per 32 inputs: DeepSeek's and MXFP4's layout), dequantized
inside the experts' GEMMs (W4A16): `moe.moe_experts`'s two kernels over expert-sorted (token, slot) blocks, or, at
a decode step's few pairs, over one block per pair (no sorting), with each weight tile read as packed codes and
scales and turned into x's dtype in registers (`_fp4_tile`).

The dequantized tile is exact (an e2m1 value times a power of two is a bf16 value), so the products are those of
the bf16 experts the loader would have made, a quarter of the bytes read: the decode step's MoE is bound by
those bytes if the decode keeps up with them. An H100 streams about 15 bytes a clock per multiprocessor; a
multiprocessor's integer units do 64 operations a clock. Decoding a code at a time from its byte (a select per
exponent case, then exp2 or bit building) took about 25 instructions a byte: instruction-bound at a sixth of the
memory's rate (`bench/investigations/sass_mix.py`, which counts a kernel's SASS on the CPU; on an H100 the
experts ran at about a tenth of their bytes, bench/investigations/stored_profile.py). The codes are now read as
32-bit words of eight and set into floats by shifts and masks, two codes a 32-bit operation for bf16
(`_codes_as_bf16_pairs`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import dot_precision, ue8m0, ue8m0_bf16
from .moe import SMALL_ALIGN_PAIRS, _align, _align_small, _block_m, _block_slots, sum_pairs, swiglu



@triton.jit
def _e2m1(code):
    """e2m1 codes (0-15, bit 3 the sign) -> fp32: 0, .5, 1, 1.5, 2, 3, 4, 6, built as the float's bits (exponent
    126 + code's exponent field, its mantissa bit as the float's first; 0.5 for the one subnormal code), a few
    integer operations where exp2 costs a special-function instruction per value. A code at a time (the packed
    KV cache's FP4 indexer keys); the experts decode words of eight (`_fp4_tile`)."""
    code = code.to(tl.int32)
    mag = code & 7
    bits = tl.where(mag >= 2, (((mag >> 1) + 126) << 23) | ((mag & 1) << 22), tl.where(mag == 1, 126 << 23, 0))
    return (bits | ((code & 8) << 28)).to(tl.float32, bitcast=True)


#: 2^126: a code's bits set in a float's exponent and mantissa (`_codes_as_bf16_pairs`, `_code_as_fp32`) read its
#: value times 2^-126
_TWO_126 = 8.507059173023462e37


@triton.jit
def _codes_as_bf16_pairs(words, j: tl.constexpr):
    """Codes j and j + 4 of each uint32 word (eight codes, the first in the low nibble) as two bf16 bit patterns in
    one word, code j in the low half: a code's magnitude bits (two exponent bits, one mantissa bit) land on the
    bf16's two lowest exponent bits and its first mantissa bit, its sign on the sign bit, so each half reads the
    code's value times 2^-126 (code 1, 0.5, as a subnormal). Four integer operations for two values: both halves
    move by the same shift."""
    if j <= 1:
        mag = (words << (6 - 4 * j)) & 0x01C001C0
    else:
        mag = (words >> (4 * j - 6)) & 0x01C001C0
    if j < 3:
        sign = (words << (12 - 4 * j)) & 0x80008000
    else:
        sign = words & 0x80008000
    return mag | sign


@triton.jit
def _bf16_halves(pair):
    """A word of two bf16 bit patterns as two bf16 values (low half, high half)."""
    return pair.to(tl.int16).to(tl.bfloat16, bitcast=True), (pair >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _code_as_fp32(words, j: tl.constexpr):
    """Code j of each uint32 word as an fp32 reading its value times 2^-126 (the same placement in a float's
    exponent and mantissa, a code to a word)."""
    if j <= 5:
        mag = (words << (22 - 4 * j)) & 0x01C00000
    else:
        mag = (words >> (4 * j - 22)) & 0x01C00000
    return (mag | ((words << (28 - 4 * j)) & 0x80000000)).to(tl.float32, bitcast=True)


@triton.jit
def _interleave8(v0, v1, v2, v3, v4, v5, v6, v7):
    """Eight [..., W] tensors as one [..., W, 8]: element i of v_j at [..., i, j]."""
    return tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)), tl.join(tl.join(v1, v5), tl.join(v3, v7)))


@triton.jit
def _fp4_tile(w_ptr, s_ptr, n, k0, n_ok, K, stride_wn, stride_sn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              DTYPE: tl.constexpr, EVEN: tl.constexpr = False):
    """Columns [k0, k0 + BLOCK_K) of rows n of a packed weight read as uint32 words (w_ptr: int32 [N, K/8], eight
    codes a word, the first column's in the low nibble) with [N, K/32] e8m0 scales, as a DTYPE [BLOCK_N, BLOCK_K]
    tile of their exact values. Words and scales are loaded once each, as a [BLOCK_N, BLOCK_K/32, 4] tile of
    words and its [BLOCK_N, BLOCK_K/32, 1] scales (a scale broadcast over its four words in registers); EVEN:
    the tile lies inside the weight (no masks).

    The codes become floats by bit placement, then two multiplications put them in scale: by 2^126, then by the
    scale (a power of two; both exact). For bf16, two codes a 32-bit operation (`_codes_as_bf16_pairs`) and
    bf16x2 multiplications; else (fp16, fp32) one code an operation in fp32, rounded to DTYPE at the end. Per
    byte of weights this is a few instructions, where decoding a code at a time from its byte with selects was
    about 25: instruction-bound at a sixth of the H100's memory rate (bench/investigations/sass_mix.py)."""
    G: tl.constexpr = BLOCK_K // 32
    rows = n.to(tl.int64)[:, None, None]
    groups = k0 // 32 + tl.arange(0, G)[None, :, None]
    words_at = groups * 4 + tl.arange(0, 4)[None, None, :]
    if EVEN:  # every row and column of the tile exists: no masks (a masked load sets its registers first)
        words = tl.load(w_ptr + rows * stride_wn + words_at).to(tl.uint32, bitcast=True)
        scale_bits = tl.load(s_ptr + rows * stride_sn + groups)
    else:
        words = tl.load(w_ptr + rows * stride_wn + words_at, mask=n_ok[:, None, None] & (words_at * 8 < K),
                        other=0).to(tl.uint32, bitcast=True)
        scale_bits = tl.load(s_ptr + rows * stride_sn + groups, mask=n_ok[:, None, None] & (groups * 32 < K),
                             other=127)
    if DTYPE == tl.bfloat16:
        scale = ue8m0_bf16(scale_bits)
        big = tl.full((1, 1, 1), 0x7E80, tl.int16).to(tl.bfloat16, bitcast=True)  # 2^126
        v0, v4 = _bf16_halves(_codes_as_bf16_pairs(words, 0))
        v1, v5 = _bf16_halves(_codes_as_bf16_pairs(words, 1))
        v2, v6 = _bf16_halves(_codes_as_bf16_pairs(words, 2))
        v3, v7 = _bf16_halves(_codes_as_bf16_pairs(words, 3))
        tile = _interleave8(v0 * big * scale, v1 * big * scale, v2 * big * scale, v3 * big * scale,
                            v4 * big * scale, v5 * big * scale, v6 * big * scale, v7 * big * scale)
    else:
        scale = ue8m0(scale_bits)
        tile = _interleave8(_code_as_fp32(words, 0) * _TWO_126 * scale, _code_as_fp32(words, 1) * _TWO_126 * scale,
                            _code_as_fp32(words, 2) * _TWO_126 * scale, _code_as_fp32(words, 3) * _TWO_126 * scale,
                            _code_as_fp32(words, 4) * _TWO_126 * scale, _code_as_fp32(words, 5) * _TWO_126 * scale,
                            _code_as_fp32(words, 6) * _TWO_126 * scale, _code_as_fp32(words, 7) * _TWO_126 * scale
                            ).to(DTYPE)
    return tl.reshape(tile, (BLOCK_N, BLOCK_K))


@triton.jit
def _block_rows(block_expert_ptr, slot_pair_ptr, BLOCK_M: tl.constexpr, PER_PAIR: tl.constexpr):
    """This program's expert (-1: an unused block), its rows of the SwiGLU buffer, their (token, k) pair indices
    and which rows hold one. PER_PAIR: a block is one pair (block_expert_ptr: the flat top-k ids), its one row
    padded to the BLOCK_M rows a tensor-core dot needs; else a block of expert-sorted slots (`moe._block_slots`).
    An if / else, not a return in a constexpr branch: Triton's compiler also builds what follows such a return,
    and its return types (the slots' int64 pair indices) then clash with the per-pair branch's."""
    if PER_PAIR:
        block = tl.program_id(0)
        i = tl.arange(0, BLOCK_M)
        expert, rows, pair, ok = tl.load(block_expert_ptr + block), block + 0 * i, block + 0 * i, i == 0
    else:
        expert, rows, pair, ok = _block_slots(block_expert_ptr, slot_pair_ptr, BLOCK_M)
    return expert, rows, pair, ok


@triton.jit
def _rows_tile(ptr, rows, stride, rows_ok, k0, K, BLOCK_K: tl.constexpr, EVEN: tl.constexpr):
    """Columns [k0, k0 + BLOCK_K) of activation rows `rows` (zero where not `rows_ok`)."""
    k = k0 + tl.arange(0, BLOCK_K)
    k_ok = (k < K) | EVEN
    return tl.load(ptr + rows.to(tl.int64)[:, None] * stride + k[None, :], mask=rows_ok[:, None] & k_ok[None, :],
                   other=0.0)


def _even(D: int, I: int, block_n: int, block_k: int) -> bool:
    """Whether every tile lies inside the weights (D and I in whole BLOCK_N and BLOCK_K tiles)."""
    return all(d % block_n == 0 and d % block_k == 0 for d in (D, I))


def _even_heuristic(args) -> bool:
    return _even(args["D"], args["I"], args["BLOCK_N"], args["BLOCK_K"])


@triton.jit
def _fp8_tile(w_ptr, s_ptr, n, k0, n_ok, K, stride_wn, stride_sn, stride_sk, BR: tl.constexpr, BC: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr, EVEN: tl.constexpr):
    """Columns [k0, k0 + BLOCK_K) of rows n of an e4m3 weight with [rows / BR, K / BC] e8m0 block scales (BLOCK_K
    divides BC: one scale a row), as DTYPE values (exact: an e4m3 value times a power of two)."""
    k = k0 + tl.arange(0, BLOCK_K)
    rows = n.to(tl.int64)
    if EVEN:
        w = tl.load(w_ptr + rows[:, None] * stride_wn + k[None, :])
        bits = tl.load(s_ptr + (rows // BR) * stride_sn + (k0 // BC) * stride_sk)
    else:
        w = tl.load(w_ptr + rows[:, None] * stride_wn + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0)
        bits = tl.load(s_ptr + (rows // BR) * stride_sn + (k0 // BC) * stride_sk, mask=n_ok & (k0 < K), other=127)
    return (w.to(tl.float32) * ue8m0(bits)[:, None]).to(DTYPE)


@triton.jit
def _weight_tile(w_ptr, s_ptr, n, k0, n_ok, K, stride_wn, stride_sn, stride_sk, BR: tl.constexpr, BC: tl.constexpr,
                 FP8: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr,
                 EVEN: tl.constexpr):
    """A weight tile in DTYPE: FP8 (`_fp8_tile`: the shared expert as stored) or packed FP4 words (`_fp4_tile`)."""
    if FP8:  # (an if / else: Triton's compiler would also build what follows a constexpr branch's return)
        tile = _fp8_tile(w_ptr, s_ptr, n, k0, n_ok, K, stride_wn, stride_sn, stride_sk, BR, BC, BLOCK_N, BLOCK_K,
                         DTYPE, EVEN)
    else:
        tile = _fp4_tile(w_ptr, s_ptr, n, k0, n_ok, K, stride_wn, stride_sn, BLOCK_N, BLOCK_K, DTYPE, EVEN)
    return tile


@triton.jit
def _gate_up(x_ptr, token, stride_xt, ok, w_ptr, s_ptr, n, n_ok, D, I, stride_wn, stride_sn, stride_sk,
             BR: tl.constexpr, BC: tl.constexpr, FP8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, EVEN: tl.constexpr):
    """Gate and up columns n (rows n and I + n of the weight) of rows `token` of x: two fp32 [BLOCK_M, BLOCK_N]."""
    gate = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, D, BLOCK_K):
        a = _rows_tile(x_ptr, token, stride_xt, ok, k0, D, BLOCK_K, EVEN)
        w = _weight_tile(w_ptr, s_ptr, n, k0, n_ok, D, stride_wn, stride_sn, stride_sk, BR, BC, FP8, BLOCK_N, BLOCK_K,
                         a.dtype, EVEN)
        gate = tl.dot(a, tl.trans(w), gate, input_precision=PRECISION)
        w = _weight_tile(w_ptr, s_ptr, n + I, k0, n_ok, D, stride_wn, stride_sn, stride_sk, BR, BC, FP8, BLOCK_N,
                         BLOCK_K, a.dtype, EVEN)
        up = tl.dot(a, tl.trans(w), up, input_precision=PRECISION)
    return gate, up


@triton.jit
def _down(h_ptr, rows, stride_hm, ok, w_ptr, s_ptr, n, n_ok, I, stride_wn, stride_sn, stride_sk, BR: tl.constexpr,
          BC: tl.constexpr, FP8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          PRECISION: tl.constexpr, EVEN: tl.constexpr):
    """Columns n of W2 h[rows]: fp32 [BLOCK_M, BLOCK_N]."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, I, BLOCK_K):
        a = _rows_tile(h_ptr, rows, stride_hm, ok, k0, I, BLOCK_K, EVEN)
        w = _weight_tile(w_ptr, s_ptr, n, k0, n_ok, I, stride_wn, stride_sn, stride_sk, BR, BC, FP8, BLOCK_N, BLOCK_K,
                         a.dtype, EVEN)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
    return acc


_KEY = ["D", "I", "BLOCK_M", "PER_PAIR"]
#: the bf16 experts' tiles (`moe._CONFIGS`) but for 128 columns on 4 warps, which Triton 3.6 fails to compile
#: for the word decode's tiles at 64 rows and more (an illegal shared layout in TritonGPUOptimizeDotOperands,
#: raised as a RuntimeError the autotuner does not catch): 128 columns take 8 warps here.
#: tests/test_kernels_compile.py compiles every one for sm_90a on the CPU.
FP4_CONFIGS = [
    triton.Config({"BLOCK_N": 64, "BLOCK_K": 128}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_N": 64, "BLOCK_K": 64}, num_warps=4, num_stages=5),
    triton.Config({"BLOCK_N": 128, "BLOCK_K": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_N": 128, "BLOCK_K": 128}, num_warps=8, num_stages=3),
]


@triton.autotune(configs=FP4_CONFIGS, key=_KEY)  # (picked by timing at first use)
@triton.heuristics({"EVEN": _even_heuristic})
@triton.jit
def _fp4_gate_up_swiglu_kernel(
    x_ptr, w_ptr, s_ptr, slot_pair_ptr, block_expert_ptr, h_ptr,
    D, I, top_k, limit,
    stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_hm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    PER_PAIR: tl.constexpr, EVEN: tl.constexpr,
):
    """h[row] = SwiGLU(gate, up) of the row's token through its expert, for BLOCK_N of the I columns."""
    expert, rows, pair, ok = _block_rows(block_expert_ptr, slot_pair_ptr, BLOCK_M, PER_PAIR)
    if expert < 0:
        return
    token = tl.where(ok, pair // top_k, 0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < I
    gate, up = _gate_up(x_ptr, token, stride_xt, ok, w_ptr + expert.to(tl.int64) * stride_we,
                        s_ptr + expert.to(tl.int64) * stride_se, n, n_ok, D, I, stride_wn, stride_sn, 0, 1, 1, False,
                        BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, EVEN)
    h = swiglu(gate, up, limit)
    tl.store(h_ptr + rows.to(tl.int64)[:, None] * stride_hm + n[None, :], h.to(h_ptr.dtype.element_ty),
             mask=ok[:, None] & n_ok[None, :])


@triton.autotune(configs=FP4_CONFIGS, key=_KEY)
@triton.heuristics({"EVEN": _even_heuristic})
@triton.jit
def _fp4_down_kernel(
    h_ptr, w_ptr, s_ptr, slot_pair_ptr, block_expert_ptr, pair_weight_ptr, y_ptr,
    D, I,
    stride_hm, stride_we, stride_wn, stride_se, stride_sn, stride_yp,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    PER_PAIR: tl.constexpr, EVEN: tl.constexpr,
):
    """y[pair] = its routing weight x W2_e h[row], for BLOCK_N of the D columns."""
    expert, rows, pair, ok = _block_rows(block_expert_ptr, slot_pair_ptr, BLOCK_M, PER_PAIR)
    if expert < 0:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < D
    acc = _down(h_ptr, rows, stride_hm, ok, w_ptr + expert.to(tl.int64) * stride_we,
                s_ptr + expert.to(tl.int64) * stride_se, n, n_ok, I, stride_wn, stride_sn, 0, 1, 1, False, BLOCK_M,
                BLOCK_N, BLOCK_K, PRECISION, EVEN)
    at = tl.where(ok, pair, 0)
    acc = acc * tl.load(pair_weight_ptr + at, mask=ok, other=0.0).to(tl.float32)[:, None]
    tl.store(y_ptr + at.to(tl.int64)[:, None] * stride_yp + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=ok[:, None] & n_ok[None, :])


#: (token, expert) pairs up to which each pair is a block of its own (`PER_PAIR`: no sorting, its one row padded
#: to the 16 a tensor-core dot needs) instead of expert-sorted blocks, which read each chosen expert once however
#: many pairs chose it. A decode step of one or two sequences at top-6.
PAIR_GEMV_PAIRS = 16


# -- a decode step's few pairs and the shared expert (FP8, as stored) in two launches ----------------------------

@triton.jit
def _pair_or_shared(ids_ptr, pairs, top_k, N, BLOCK_N: tl.constexpr):
    """Block b < pairs: routed pair b = (token, j) of expert ids[b]; else token b - pairs's shared expert. Returns
    whether it is routed, the token and its row of the [T, top_k + 1] buffers (j for a pair, top_k for the shared
    expert) as 16 rows of which the first is real (`ok`: a tensor-core dot's least), the expert, and this
    program's BLOCK_N columns of N and which exist."""
    block = tl.program_id(0)
    routed = block < pairs
    token = tl.where(routed, block // top_k, block - pairs)
    i = tl.arange(0, 16)
    rows = token * (top_k + 1) + tl.where(routed, block % top_k, top_k) + 0 * i
    expert = tl.load(ids_ptr + tl.minimum(block, pairs - 1)).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return routed, token + 0 * i, rows, i == 0, expert, n, n < N


@triton.jit
def _pairs_shared_gate_up_kernel(
    x_ptr, w_ptr, s_ptr, ids_ptr, sw_ptr, ss_ptr, h_ptr, D, I, top_k, limit, pairs,
    stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_swn, stride_ssn, stride_ssk, stride_hm,
    BR: tl.constexpr, BC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    EVEN: tl.constexpr,
):
    """h[row] = SwiGLU of the block's token through its routed expert (FP4) or the shared one (FP8), BLOCK_N of I."""
    routed, tokens, rows, ok, expert, n, n_ok = _pair_or_shared(ids_ptr, pairs, top_k, I, BLOCK_N)
    if routed:
        gate, up = _gate_up(x_ptr, tokens, stride_xt, ok, w_ptr + expert * stride_we, s_ptr + expert * stride_se, n,
                            n_ok, D, I, stride_wn, stride_sn, 0, 1, 1, False, 16, BLOCK_N, BLOCK_K, PRECISION, EVEN)
    else:
        gate, up = _gate_up(x_ptr, tokens, stride_xt, ok, sw_ptr, ss_ptr, n, n_ok, D, I, stride_swn, stride_ssn,
                            stride_ssk, BR, BC, True, 16, BLOCK_N, BLOCK_K, PRECISION, EVEN)
    h = swiglu(gate, up, limit)
    tl.store(h_ptr + rows.to(tl.int64)[:, None] * stride_hm + n[None, :], h.to(h_ptr.dtype.element_ty),
             mask=ok[:, None] & n_ok[None, :])


@triton.jit
def _pairs_shared_down_kernel(
    h_ptr, w_ptr, s_ptr, ids_ptr, pair_weight_ptr, sw_ptr, ss_ptr, y_ptr, D, I, top_k, pairs,
    stride_hm, stride_we, stride_wn, stride_se, stride_sn, stride_swn, stride_ssn, stride_ssk, stride_yr,
    BR: tl.constexpr, BC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    EVEN: tl.constexpr,
):
    """y[row] = the routing weight x W2_e h[row] (routed), or W2_shared h[row], for BLOCK_N of the D columns."""
    routed, _, rows, ok, expert, n, n_ok = _pair_or_shared(ids_ptr, pairs, top_k, D, BLOCK_N)
    if routed:
        acc = _down(h_ptr, rows, stride_hm, ok, w_ptr + expert * stride_we, s_ptr + expert * stride_se, n, n_ok, I,
                    stride_wn, stride_sn, 0, 1, 1, False, 16, BLOCK_N, BLOCK_K, PRECISION, EVEN)
        acc = acc * tl.load(pair_weight_ptr + tl.program_id(0)).to(tl.float32)
    else:
        acc = _down(h_ptr, rows, stride_hm, ok, sw_ptr, ss_ptr, n, n_ok, I, stride_swn, stride_ssn, stride_ssk, BR,
                    BC, True, 16, BLOCK_N, BLOCK_K, PRECISION, EVEN)
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * stride_yr + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=ok[:, None] & n_ok[None, :])


_SHARED_TILES = dict(BLOCK_N=64, num_warps=4, num_stages=3)


def fp4_moe_with_shared(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                        s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, limit: float, shared_w13: torch.Tensor,
                        shared_s13: torch.Tensor, shared_w2: torch.Tensor, shared_s2: torch.Tensor,
                        shared_block: tuple[int, int], tiles: dict | None = None) -> torch.Tensor:
    """The routed FP4 experts (as `fp4_moe_experts`) plus the shared expert kept as FP8 (`shared_w13` [2I, D]
    e4m3, gate rows then up rows, `shared_w2` [D, I], with e8m0 scales in `shared_block` blocks; the same clamped
    SwiGLU, weight 1) -> [T, D] in x.dtype, for a decode step's few tokens (at most PAIR_GEMV_PAIRS pairs).

    Two launches where the parts take seven (the routed experts' two and their sum, the shared expert's gate/up,
    SwiGLU and down, the add): each program is a (pair or token's shared expert, column block), its row padded to
    16 for the tensor cores, the shared expert's blocks decoding FP8 tiles where the pairs' decode FP4; then a sum
    of each token's top_k + 1 rows (in fp32, rounded once). BLOCK_K is min(128, the scale block's columns)."""
    T, D = x.shape
    E, I2, _ = w13.shape
    I, top_k = I2 // 2, topk_ids.shape[1]
    BR, BC = shared_block
    t = {**_SHARED_TILES, "BLOCK_K": min(128, BC), **(tiles or {})}
    w13, s13, w2, s2 = _expert_words(w13, s13, w2, s2, D, I)
    if tuple(shared_w13.shape) != (2 * I, D) or tuple(shared_w2.shape) != (D, I):
        raise ValueError(f"the shared expert {tuple(shared_w13.shape)} / {tuple(shared_w2.shape)} is not the routed "
                         f"experts' [{2 * I}, {D}] / [{D}, {I}]")
    if BC % t["BLOCK_K"] or t["BLOCK_K"] < 32 or t["BLOCK_K"] & (t["BLOCK_K"] - 1):
        raise ValueError(f"the shared expert's {BR}x{BC} scale blocks do not fit {t['BLOCK_K']}-column K steps")
    pairs = T * top_k
    y = torch.empty((T * (top_k + 1), D), dtype=x.dtype, device=x.device)
    if T == 0:
        return sum_pairs(y.view(T, top_k + 1, D))
    x, ids = x.contiguous(), topk_ids.reshape(-1).contiguous()
    weights = topk_weights.reshape(-1).float().contiguous()
    sw13, sw2 = shared_w13.contiguous(), shared_w2.contiguous()
    ss13, ss2 = _e8m0_bits(shared_s13).contiguous(), _e8m0_bits(shared_s2).contiguous()
    h = torch.empty((T * (top_k + 1), I), dtype=x.dtype, device=x.device)
    bn, bk = t["BLOCK_N"], t["BLOCK_K"]
    common = dict(BR=BR, BC=BC, BLOCK_N=bn, BLOCK_K=bk, PRECISION=dot_precision(x.dtype), EVEN=_even(D, I, bn, bk),
                  num_warps=t["num_warps"], num_stages=t["num_stages"])
    _pairs_shared_gate_up_kernel[(pairs + T, triton.cdiv(I, bn))](
        x, w13, s13, ids, sw13, ss13, h, D, I, top_k, float(limit), pairs,
        x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1), sw13.stride(0), ss13.stride(0),
        ss13.stride(1), h.stride(0), **common)
    _pairs_shared_down_kernel[(pairs + T, triton.cdiv(D, bn))](
        h, w2, s2, ids, weights, sw2, ss2, y, D, I, top_k, pairs,
        h.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), sw2.stride(0), ss2.stride(0),
        ss2.stride(1), y.stride(0), **common)
    return sum_pairs(y.view(T, top_k + 1, D))


@triton.jit
def _dequantize_kernel(w_ptr, s_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_on,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    tile = _fp4_tile(w_ptr, s_ptr, n, k0, n < N, K, stride_wn, stride_sn, BLOCK_N, BLOCK_K, out_ptr.dtype.element_ty)
    k = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + n.to(tl.int64)[:, None] * stride_on + k[None, :], tile, mask=(n < N)[:, None] & (k < K)[None, :])


def dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Packed codes [..., N, K/2] with [..., N, K/32] e8m0 scales -> their values in `dtype` [..., N, K] (K a
    multiple of 8), by the kernels' own decode: bitwise `quant.dequantize_fp4` rounded to `dtype` (the values
    are exact in bf16 and fp32), in one launch (the experts' values for fp32 activations)."""
    *lead, N, half = packed.shape
    K = 2 * half
    if K % 8:
        raise ValueError(f"FP4 weights are read as words of eight codes: the input dim ({K}) must be a multiple of 8")
    rows = packed.numel() // max(half, 1)
    words, bits = _words(packed).reshape(rows, K // 8), _e8m0_bits(scale).contiguous().reshape(rows, -1)
    out = torch.empty((rows, K), dtype=dtype, device=packed.device)
    if rows and K:
        _dequantize_kernel[(triton.cdiv(rows, 32), triton.cdiv(K, 64))](
            words, bits, out, rows, K, words.stride(0), bits.stride(0), out.stride(0), BLOCK_N=32, BLOCK_K=64)
    return out.view(*lead, N, K)


def _fp4_block_m(pairs: int, experts: int) -> int:
    """Rows per block: the bf16 experts' choice by pairs (`moe._block_m`), or more, up to 128, so that an expert's
    average rows fit one block: each block decodes its expert's weight tiles again, so where the bf16 kernels
    take two 16-row blocks (a batch-64 step over 16 experts: 24 rows each) the FP4 ones decode once in 32."""
    per_expert = -(-pairs // max(experts, 1))
    return max(_block_m(pairs), min(128, max(16, triton.next_power_of_2(per_expert))))


def _expert_words(w13, s13, w2, s2, D: int, I: int) -> tuple[torch.Tensor, ...]:
    """The packed expert stacks as int32 words and their scales as e8m0 bytes, as the kernels read them."""
    if D % 8 or I % 8:
        raise ValueError(f"FP4 experts are read as words of eight codes: D ({D}) and I ({I}) must be multiples of 8")
    return _words(w13), _e8m0_bits(s13).contiguous(), _words(w2), _e8m0_bits(s2).contiguous()


def _words(packed: torch.Tensor) -> torch.Tensor:
    """Packed codes [..., K/2] (int8, uint8 or float4_e2m1fn_x2) as int32 words [..., K/8], eight codes a word."""
    return packed.view(torch.uint8).contiguous().view(torch.int32)


def _e8m0_bits(scale: torch.Tensor) -> torch.Tensor:
    if scale.dtype == torch.uint8 or scale.dtype == getattr(torch, "float8_e8m0fnu", None):
        return scale.view(torch.uint8)
    raise TypeError(f"FP4 experts need e8m0 scales (float8_e8m0fnu or uint8), got {scale.dtype}")


def fp4_moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                    s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, limit: float,
                    pair_out: torch.Tensor | None = None, tiles: dict | None = None,
                    per_pair: bool | None = None, ordered_sum: bool = False) -> torch.Tensor:
    """x [T, D], topk_ids/topk_weights [T, k]; packed w13 [E, 2I, D/2] with scales s13 [E, 2I, D/32], w2
    [E, D, I/2] with s2 [E, D, I/32] -> [T, D] in x.dtype. `tiles`: BLOCK_N, BLOCK_K, num_warps, num_stages.
    `per_pair`: each (token, expert) pair a block of its own (default: up to PAIR_GEMV_PAIRS pairs), else
    expert-sorted blocks, whose tiles the autotuner picks per (D, I, block rows) at first use as for the bf16
    experts (a long prefill wants wider tiles than a decode step's few rows); `tiles` fixes them (and block_m).
    `ordered_sum`: each token's rows added in routing order (`moe.sum_pairs`; the batch-invariant mode, with fixed
    tiles)."""
    T, D = x.shape
    E, I2, _ = w13.shape
    I, top_k = I2 // 2, topk_ids.shape[1]
    w13, s13, w2, s2 = _expert_words(w13, s13, w2, s2, D, I)
    x = x.contiguous()
    pairs = T * top_k
    if pair_out is None:
        pair_out = torch.empty((pairs, D), dtype=x.dtype, device=x.device)
    if T == 0:
        return pair_out.view(T, top_k, D).sum(1)
    weights = topk_weights.reshape(-1).float().contiguous()
    per_pair = pairs <= PAIR_GEMV_PAIRS if per_pair is None else per_pair
    fixed = {k: v for k, v in (tiles or {}).items() if k != "block_m"}  # (else the autotuner's pick)
    gate_up, down = (_fp4_gate_up_swiglu_kernel.fn, _fp4_down_kernel.fn) if fixed else \
        (_fp4_gate_up_swiglu_kernel, _fp4_down_kernel)
    if per_pair:
        bm, num_blocks = 16, pairs
        block_expert = topk_ids.reshape(-1).contiguous()
        slot_pair = block_expert  # (not read)
        h = torch.empty((pairs, I), dtype=x.dtype, device=x.device)
    else:
        bm = tiles["block_m"] if tiles and "block_m" in tiles else _fp4_block_m(pairs, E)
        align = _align_small if pairs <= SMALL_ALIGN_PAIRS and E <= 1024 else _align
        slot_pair, block_expert, num_blocks = align(topk_ids, E, bm)
        h = torch.empty((num_blocks * bm, I), dtype=x.dtype, device=x.device)
    precision = dot_precision(x.dtype)
    gate_up[lambda meta: (num_blocks, triton.cdiv(I, meta["BLOCK_N"]))](
        x, w13, s13, slot_pair, block_expert, h, D, I, top_k, float(limit),
        x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1), h.stride(0),
        BLOCK_M=bm, PRECISION=precision, PER_PAIR=per_pair, **fixed)
    down[lambda meta: (num_blocks, triton.cdiv(D, meta["BLOCK_N"]))](
        h, w2, s2, slot_pair, block_expert, weights, pair_out, D, I,
        h.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), pair_out.stride(0),
        BLOCK_M=bm, PRECISION=precision, PER_PAIR=per_pair, **fixed)
    return sum_pairs(pair_out.view(T, top_k, D), ordered_sum)
