"""Routed experts stored as FP4 (e2m1, one UE8M0 scale per 32 inputs: DeepSeek's and MXFP4's layout), dequantized
inside the grouped GEMMs (W4A16): `moe.moe_experts`'s two kernels over the same expert-sorted (token, slot) pairs,
with each weight tile read as packed nibbles and scales and turned into x's dtype in registers.

The dequantized tile is exact (an e2m1 value times a power of two is a bf16 value), so the products are those of
the bf16 experts the loader would have made, a quarter of the bytes read: the decode step's MoE is bound by
those bytes. Each K step loads a tile's bytes once, contiguously, and its scales once per 32 columns; the low
nibbles (even columns) and the high ones (odd columns) make two half-width tiles, multiplied by the activations'
even and odd columns. (Loading a byte per element, indexed k // 2, and decoding with exp2 made the dequantization
the step's bottleneck: 1.5 ms a layer for the gate/up of one token at V4-Flash shapes on an H100, where the
bytes take microseconds: bench/investigations/stored_profile.py.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import dot_precision
from .moe import _CONFIGS, SMALL_ALIGN_PAIRS, _align, _align_small, _block_m



@triton.jit
def _e2m1(code):
    """e2m1 codes (0-15, bit 3 the sign) -> fp32: 0, .5, 1, 1.5, 2, 3, 4, 6, built as the float's bits (exponent
    126 + code's exponent field, its mantissa bit as the float's first; 0.5 for the one subnormal code), a few
    integer operations where exp2 costs a special-function instruction per value."""
    code = code.to(tl.int32)
    mag = code & 7
    bits = tl.where(mag >= 2, (((mag >> 1) + 126) << 23) | ((mag & 1) << 22), tl.where(mag == 1, 126 << 23, 0))
    return (bits | ((code & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _ue8m0(byte):
    """UE8M0 scale bytes as the fp32 powers of two they stand for: the byte is the float's exponent field."""
    return (byte.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _fp4_halves(w_ptr, s_ptr, n, k0, n_ok, K, stride_wn, stride_sn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                DTYPE: tl.constexpr):
    """Columns [k0, k0 + BLOCK_K) of rows n of a packed [N, K/2] weight with [N, K/32] e8m0 scales, as two DTYPE
    [BLOCK_N, BLOCK_K/2] tiles: the even columns (low nibbles) and the odd ones (high nibbles). Each byte and each
    scale is loaded once, contiguously; a scale is broadcast over its 16 bytes in registers."""
    j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    rows = n.to(tl.int64)[:, None]
    packed = tl.load(w_ptr + rows * stride_wn + j[None, :], mask=n_ok[:, None] & (2 * j < K)[None, :], other=0)
    g = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    scale = _ue8m0(tl.load(s_ptr + rows * stride_sn + g[None, :], mask=n_ok[:, None] & (32 * g < K)[None, :],
                           other=127))
    scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BLOCK_N, BLOCK_K // 32, 16)), (BLOCK_N, BLOCK_K // 2))
    packed = packed.to(tl.int32)
    return (_e2m1(packed & 15) * scale).to(DTYPE), (_e2m1(packed >> 4) * scale).to(DTYPE)


@triton.jit
def _halves_of_rows(ptr, rows, stride, rows_ok, k0, K, BLOCK_K: tl.constexpr):
    """Columns [k0, k0 + BLOCK_K) of activation rows `rows`, split as the weights are: even columns, odd columns."""
    k = k0 + 2 * tl.arange(0, BLOCK_K // 2)
    base = ptr + rows.to(tl.int64)[:, None] * stride + k[None, :]
    even = tl.load(base, mask=rows_ok[:, None] & (k < K)[None, :], other=0.0)
    odd = tl.load(base + 1, mask=rows_ok[:, None] & (k + 1 < K)[None, :], other=0.0)
    return even, odd


@triton.jit
def _block_slots(block_expert_ptr, slot_pair_ptr, BLOCK_M: tl.constexpr):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    slots = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(slot_pair_ptr + slots)
    return expert, slots, pair, pair >= 0


@triton.autotune(configs=_CONFIGS, key=["D", "I", "BLOCK_M"])  # (the bf16 kernels' tiles, picked by timing)
@triton.jit
def _fp4_gate_up_swiglu_kernel(
    x_ptr, w_ptr, s_ptr, slot_pair_ptr, block_expert_ptr, h_ptr,
    D, I, top_k, limit,
    stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_hm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    expert, slots, pair, ok = _block_slots(block_expert_ptr, slot_pair_ptr, BLOCK_M)
    if expert < 0:
        return
    token = tl.where(ok, pair // top_k, 0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < I
    dtype = x_ptr.dtype.element_ty
    w_e = w_ptr + expert.to(tl.int64) * stride_we
    s_e = s_ptr + expert.to(tl.int64) * stride_se
    gate = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, D, BLOCK_K):
        a_even, a_odd = _halves_of_rows(x_ptr, token, stride_xt, ok, k0, D, BLOCK_K)
        g_even, g_odd = _fp4_halves(w_e, s_e, n, k0, n_ok, D, stride_wn, stride_sn, BLOCK_N, BLOCK_K, dtype)
        gate = tl.dot(a_even, tl.trans(g_even), gate, input_precision=PRECISION)
        gate = tl.dot(a_odd, tl.trans(g_odd), gate, input_precision=PRECISION)
        u_even, u_odd = _fp4_halves(w_e, s_e, n + I, k0, n_ok, D, stride_wn, stride_sn, BLOCK_N, BLOCK_K, dtype)
        up = tl.dot(a_even, tl.trans(u_even), up, input_precision=PRECISION)
        up = tl.dot(a_odd, tl.trans(u_odd), up, input_precision=PRECISION)
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    h = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(h_ptr + slots[:, None] * stride_hm + n[None, :], h.to(h_ptr.dtype.element_ty), mask=ok[:, None] & n_ok[None, :])


@triton.autotune(configs=_CONFIGS, key=["D", "I", "BLOCK_M"])
@triton.jit
def _fp4_down_kernel(
    h_ptr, w_ptr, s_ptr, slot_pair_ptr, block_expert_ptr, pair_weight_ptr, y_ptr,
    D, I,
    stride_hm, stride_we, stride_wn, stride_se, stride_sn, stride_yp,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    expert, slots, pair, ok = _block_slots(block_expert_ptr, slot_pair_ptr, BLOCK_M)
    if expert < 0:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < D
    dtype = h_ptr.dtype.element_ty
    w_e = w_ptr + expert.to(tl.int64) * stride_we
    s_e = s_ptr + expert.to(tl.int64) * stride_se
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, I, BLOCK_K):
        a_even, a_odd = _halves_of_rows(h_ptr, slots, stride_hm, ok, k0, I, BLOCK_K)
        w_even, w_odd = _fp4_halves(w_e, s_e, n, k0, n_ok, I, stride_wn, stride_sn, BLOCK_N, BLOCK_K, dtype)
        acc = tl.dot(a_even, tl.trans(w_even), acc, input_precision=PRECISION)
        acc = tl.dot(a_odd, tl.trans(w_odd), acc, input_precision=PRECISION)
    scale = tl.load(pair_weight_ptr + tl.where(ok, pair, 0), mask=ok, other=0.0).to(tl.float32)
    acc = acc * scale[:, None]
    tl.store(y_ptr + tl.where(ok, pair, 0)[:, None] * stride_yp + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=ok[:, None] & n_ok[None, :])


@triton.jit
def _pair_columns(ids_ptr, w_ptr, s_ptr, stride_we, stride_se, N, BLOCK_N: tl.constexpr):
    """This program's (token, expert) pair, its BLOCK_N output columns (of N) and which exist, and its expert's
    packed weight and scale pointers."""
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return pair, n, n < N, w_ptr + expert * stride_we, s_ptr + expert * stride_se


@triton.jit
def _fp4_row_dot(row_ptr, w_e, s_e, n, n_ok, K, stride_wn, stride_sn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """sum_k W[n, k] * row[k] in fp32 for one activation row: each K step's weight tile decoded to fp32 (two
    half-width tiles, even and odd columns) and multiplied on the CUDA cores, summed along K."""
    row, row_ok = tl.zeros((1,), tl.int32), tl.full((1,), 1, tl.int1)  # (one row: `_halves_of_rows`' [1, K/2])
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        even, odd = _halves_of_rows(row_ptr, row, 0, row_ok, k0, K, BLOCK_K)
        w_even, w_odd = _fp4_halves(w_e, s_e, n, k0, n_ok, K, stride_wn, stride_sn, BLOCK_N, BLOCK_K, tl.float32)
        acc += tl.sum(w_even * even.to(tl.float32) + w_odd * odd.to(tl.float32), axis=1)
    return acc


@triton.jit
def _fp4_pair_gate_up_kernel(
    x_ptr, w_ptr, s_ptr, ids_ptr, h_ptr, D, I, top_k, limit,
    stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_hp,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One (token, expert) pair's gate/up columns [n, n + BLOCK_N) and their clamped SwiGLU, as two GEMVs."""
    pair, n, n_ok, w_e, s_e = _pair_columns(ids_ptr, w_ptr, s_ptr, stride_we, stride_se, I, BLOCK_N)
    x_row = x_ptr + (pair // top_k).to(tl.int64) * stride_xt
    gate = _fp4_row_dot(x_row, w_e, s_e, n, n_ok, D, stride_wn, stride_sn, BLOCK_N, BLOCK_K)
    up = _fp4_row_dot(x_row, w_e, s_e, n + I, n_ok, D, stride_wn, stride_sn, BLOCK_N, BLOCK_K)
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    h = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(h_ptr + pair * stride_hp + n, h.to(h_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _fp4_pair_down_kernel(
    h_ptr, w_ptr, s_ptr, ids_ptr, pair_weight_ptr, y_ptr, D, I,
    stride_hp, stride_we, stride_wn, stride_se, stride_sn, stride_yp,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One pair's down-projection columns [n, n + BLOCK_N), times its routing weight, as a GEMV."""
    pair, n, n_ok, w_e, s_e = _pair_columns(ids_ptr, w_ptr, s_ptr, stride_we, stride_se, D, BLOCK_N)
    acc = _fp4_row_dot(h_ptr + pair.to(tl.int64) * stride_hp, w_e, s_e, n, n_ok, I, stride_wn, stride_sn,
                       BLOCK_N, BLOCK_K)
    acc = acc * tl.load(pair_weight_ptr + pair).to(tl.float32)
    tl.store(y_ptr + pair * stride_yp + n, acc.to(y_ptr.dtype.element_ty), mask=n_ok)


#: (token, expert) pairs up to which each pair runs as its own GEMV (`_fp4_pair_*`: no sorting, no tensor-core
#: tiles of 16 rows for one) instead of the grouped kernels, which read each chosen expert once however many pairs
#: chose it. A decode step of one or two sequences at top-6.
PAIR_GEMV_PAIRS = 16
_PAIR_TILES = dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)


def _e8m0_bits(scale: torch.Tensor) -> torch.Tensor:
    if scale.dtype == torch.uint8 or scale.dtype == getattr(torch, "float8_e8m0fnu", None):
        return scale.view(torch.uint8)
    raise TypeError(f"FP4 experts need e8m0 scales (float8_e8m0fnu or uint8), got {scale.dtype}")


def fp4_moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                    s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, limit: float,
                    pair_out: torch.Tensor | None = None, tiles: dict | None = None,
                    per_pair: bool | None = None) -> torch.Tensor:
    """x [T, D], topk_ids/topk_weights [T, k]; packed w13 [E, 2I, D/2] with scales s13 [E, 2I, D/32], w2
    [E, D, I/2] with s2 [E, D, I/32] -> [T, D] in x.dtype. `tiles`: BLOCK_N, BLOCK_K, num_warps, num_stages.
    `per_pair`: each (token, expert) pair as a GEMV (default: up to PAIR_GEMV_PAIRS pairs), else the grouped
    kernels, whose tiles the autotuner picks per (D, I, block rows) at first use as for the bf16 experts (a long
    prefill wants wider tiles than a decode step's few rows); `tiles` fixes them (and block_m)."""
    T, D = x.shape
    E, I2, _ = w13.shape
    I, top_k = I2 // 2, topk_ids.shape[1]
    x = x.contiguous()
    w13, w2 = w13.view(torch.uint8).contiguous(), w2.view(torch.uint8).contiguous()
    s13, s2 = _e8m0_bits(s13).contiguous(), _e8m0_bits(s2).contiguous()
    pairs = T * top_k
    if pair_out is None:
        pair_out = torch.empty((pairs, D), dtype=x.dtype, device=x.device)
    if T == 0:
        return pair_out.view(T, top_k, D).sum(1)
    weights = topk_weights.reshape(-1).float().contiguous()
    if pairs <= PAIR_GEMV_PAIRS if per_pair is None else per_pair:
        cfg = {**_PAIR_TILES, **{k: v for k, v in (tiles or {}).items() if k != "block_m"}}
        ids = topk_ids.reshape(-1).contiguous()
        h = torch.empty((pairs, I), dtype=x.dtype, device=x.device)
        _fp4_pair_gate_up_kernel[(pairs, triton.cdiv(I, cfg["BLOCK_N"]))](
            x, w13, s13, ids, h, D, I, top_k, float(limit),
            x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1), h.stride(0), **cfg)
        _fp4_pair_down_kernel[(pairs, triton.cdiv(D, cfg["BLOCK_N"]))](
            h, w2, s2, ids, weights, pair_out, D, I,
            h.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), pair_out.stride(0), **cfg)
        return pair_out.view(T, top_k, D).sum(1)
    bm = tiles["block_m"] if tiles and "block_m" in tiles else _block_m(pairs)
    fixed = {k: v for k, v in (tiles or {}).items() if k != "block_m"}  # (else the autotuner's pick)
    gate_up, down = (_fp4_gate_up_swiglu_kernel.fn, _fp4_down_kernel.fn) if fixed else \
        (_fp4_gate_up_swiglu_kernel, _fp4_down_kernel)
    align = _align_small if pairs <= SMALL_ALIGN_PAIRS and E <= 1024 else _align
    slot_pair, block_expert, num_blocks = align(topk_ids, E, bm)
    h = torch.empty((num_blocks * bm, I), dtype=x.dtype, device=x.device)
    precision = dot_precision(x.dtype)
    gate_up[lambda meta: (num_blocks, triton.cdiv(I, meta["BLOCK_N"]))](
        x, w13, s13, slot_pair, block_expert, h, D, I, top_k, float(limit),
        x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1), h.stride(0),
        BLOCK_M=bm, PRECISION=precision, **fixed)
    down[lambda meta: (num_blocks, triton.cdiv(D, meta["BLOCK_N"]))](
        h, w2, s2, slot_pair, block_expert, weights, pair_out, D, I,
        h.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), pair_out.stride(0),
        BLOCK_M=bm, PRECISION=precision, **fixed)
    return pair_out.view(T, top_k, D).sum(1)  # accumulated in fp32 (torch's bf16 sum), rounded once
