"""Routed experts stored as FP4 (e2m1, one UE8M0 scale per 32 inputs: DeepSeek's and MXFP4's layout), dequantized
inside the grouped GEMMs (W4A16): `moe.moe_experts`'s two kernels over the same expert-sorted (token, slot) pairs,
with each weight tile read as packed nibbles and scales and turned into x's dtype in registers.

The dequantized tile is exact (an e2m1 value times a power of two is a bf16 value), so the products are those of
the bf16 experts the loader would have made, a quarter of the bytes read: the decode step's MoE is bound by
those bytes. A tile's bytes are loaded once per element pair (the byte for columns 2j and 2j + 1; the cache
serves the second read), its scales once per 32 columns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import dot_precision
from .moe import SMALL_ALIGN_PAIRS, _align, _align_small, _block_m

_TILES = dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)


@triton.jit
def _e2m1(code):
    """e2m1 codes (0-15, bit 3 the sign) -> fp32: 0, .5, 1, 1.5, 2, 3, 4, 6."""
    mag = code & 7
    e = mag >> 1
    half = (mag & 1).to(tl.float32) * 0.5
    value = tl.where(e == 0, half, tl.exp2((e - 1).to(tl.float32)) * (1.0 + half))
    return tl.where(code >= 8, -value, value)


@triton.jit
def _fp4_tile(w_ptr, s_ptr, n, k, n_ok, K, stride_wn, stride_sn, DTYPE: tl.constexpr):
    """Rows n, columns k of a packed [N, K/2] weight with [N, K/32] e8m0 scales, as DTYPE [BLOCK_N, BLOCK_K]."""
    ok = n_ok[:, None] & (k < K)[None, :]
    packed = tl.load(w_ptr + n.to(tl.int64)[:, None] * stride_wn + (k // 2)[None, :], mask=ok, other=0)
    code = tl.where((k % 2 == 0)[None, :], packed & 15, packed >> 4)
    exponent = tl.load(s_ptr + n.to(tl.int64)[:, None] * stride_sn + (k // 32)[None, :], mask=ok, other=127)
    return (_e2m1(code) * tl.exp2(exponent.to(tl.float32) - 127.0)).to(DTYPE)


@triton.jit
def _block_slots(block_expert_ptr, slot_pair_ptr, BLOCK_M: tl.constexpr):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    slots = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(slot_pair_ptr + slots)
    return expert, slots, pair, pair >= 0


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
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + token[:, None] * stride_xt + k[None, :], mask=ok[:, None] & (k[None, :] < D), other=0.0)
        wg = _fp4_tile(w_e, s_e, n, k, n_ok, D, stride_wn, stride_sn, dtype)
        wu = _fp4_tile(w_e, s_e, n + I, k, n_ok, D, stride_wn, stride_sn, dtype)
        gate = tl.dot(a, tl.trans(wg), gate, input_precision=PRECISION)
        up = tl.dot(a, tl.trans(wu), up, input_precision=PRECISION)
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    h = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(h_ptr + slots[:, None] * stride_hm + n[None, :], h.to(h_ptr.dtype.element_ty), mask=ok[:, None] & n_ok[None, :])


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
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(h_ptr + slots[:, None] * stride_hm + k[None, :], mask=ok[:, None] & (k[None, :] < I), other=0.0)
        w = _fp4_tile(w_e, s_e, n, k, n_ok, I, stride_wn, stride_sn, dtype)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
    scale = tl.load(pair_weight_ptr + tl.where(ok, pair, 0), mask=ok, other=0.0).to(tl.float32)
    acc = acc * scale[:, None]
    tl.store(y_ptr + tl.where(ok, pair, 0)[:, None] * stride_yp + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=ok[:, None] & n_ok[None, :])


def _e8m0_bits(scale: torch.Tensor) -> torch.Tensor:
    if scale.dtype == torch.uint8 or scale.dtype == getattr(torch, "float8_e8m0fnu", None):
        return scale.view(torch.uint8)
    raise TypeError(f"FP4 experts need e8m0 scales (float8_e8m0fnu or uint8), got {scale.dtype}")


def fp4_moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                    s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, limit: float,
                    pair_out: torch.Tensor | None = None, tiles: dict | None = None) -> torch.Tensor:
    """x [T, D], topk_ids/topk_weights [T, k]; packed w13 [E, 2I, D/2] with scales s13 [E, 2I, D/32], w2
    [E, D, I/2] with s2 [E, D, I/32] -> [T, D] in x.dtype. `tiles`: BLOCK_N, BLOCK_K, num_warps, num_stages."""
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
    cfg = {**_TILES, **(tiles or {})}
    bm = cfg.pop("block_m", None) or _block_m(pairs)
    align = _align_small if pairs <= SMALL_ALIGN_PAIRS and E <= 1024 else _align
    slot_pair, block_expert, num_blocks = align(topk_ids, E, bm)
    h = torch.empty((num_blocks * bm, I), dtype=x.dtype, device=x.device)
    precision = dot_precision(x.dtype)
    _fp4_gate_up_swiglu_kernel[(num_blocks, triton.cdiv(I, cfg["BLOCK_N"]))](
        x, w13, s13, slot_pair, block_expert, h, D, I, top_k, float(limit),
        x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1), h.stride(0),
        BLOCK_M=bm, PRECISION=precision, **cfg)
    weights = topk_weights.reshape(-1).float().contiguous()
    _fp4_down_kernel[(num_blocks, triton.cdiv(D, cfg["BLOCK_N"]))](
        h, w2, s2, slot_pair, block_expert, weights, pair_out, D, I,
        h.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), pair_out.stride(0),
        BLOCK_M=bm, PRECISION=precision, **cfg)
    return pair_out.view(T, top_k, D).sum(1)  # accumulated in fp32 (torch's bf16 sum), rounded once
