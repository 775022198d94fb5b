"""Routed experts as two grouped GEMMs over expert-sorted (token, slot) pairs, the clamped SwiGLU fused into the
first.

The pairs are sorted by expert on the device and each expert's run is padded to a multiple of BLOCK_M, so
every block of BLOCK_M sorted slots belongs to one expert; the number of blocks is bounded by
`cdiv(pairs, BLOCK_M) + experts` whatever the routing, so nothing waits for the host to learn the counts.
Blocks past the last expert's run exit at once. Each expert's weights are read once per block of its tokens:
in decode that is once per step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import dot_precision


# tiles picked per (D, I, BLOCK_M) at first use: decode blocks are short and want many N tiles in flight,
# prefill blocks want wider ones
_CONFIGS = [
    triton.Config({"BLOCK_N": 64, "BLOCK_K": 128}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_N": 128, "BLOCK_K": 64}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_N": 64, "BLOCK_K": 64}, num_warps=4, num_stages=5),
    triton.Config({"BLOCK_N": 128, "BLOCK_K": 64}, num_warps=8, num_stages=3),
]


@triton.autotune(configs=_CONFIGS, key=["D", "I", "BLOCK_M"])
@triton.jit
def _gate_up_swiglu_kernel(
    x_ptr, w_ptr, slot_pair_ptr, block_expert_ptr, h_ptr,
    D, I, top_k, limit,
    stride_xt, stride_we, stride_wn, stride_hm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    slots = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(slot_pair_ptr + slots)
    ok = pair >= 0
    token = tl.where(ok, pair // top_k, 0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < I
    kk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + token[:, None] * stride_xt
    w_gate = w_ptr + expert.to(tl.int64) * stride_we + n[None, :] * stride_wn
    w_up = w_gate + I * stride_wn
    gate = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, D, BLOCK_K):
        k = k0 + kk
        a = tl.load(x_rows + k[None, :], mask=ok[:, None] & (k[None, :] < D), other=0.0)
        wg = tl.load(w_gate + k[:, None], mask=n_ok[None, :] & (k[:, None] < D), other=0.0)
        wu = tl.load(w_up + k[:, None], mask=n_ok[None, :] & (k[:, None] < D), other=0.0)
        gate = tl.dot(a, wg, gate, input_precision=PRECISION)
        up = tl.dot(a, wu, up, input_precision=PRECISION)
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    h = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(h_ptr + slots[:, None] * stride_hm + n[None, :], h.to(h_ptr.dtype.element_ty), mask=ok[:, None] & n_ok[None, :])


@triton.autotune(configs=_CONFIGS, key=["D", "I", "BLOCK_M"])
@triton.jit
def _down_kernel(
    h_ptr, w_ptr, slot_pair_ptr, block_expert_ptr, pair_weight_ptr, y_ptr,
    D, I,
    stride_hm, stride_we, stride_wn, stride_yp,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    slots = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(slot_pair_ptr + slots)
    ok = pair >= 0
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < D
    kk = tl.arange(0, BLOCK_K)
    h_rows = h_ptr + slots[:, None] * stride_hm
    w_cols = w_ptr + expert.to(tl.int64) * stride_we + n[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k = k0 + kk
        a = tl.load(h_rows + k[None, :], mask=ok[:, None] & (k[None, :] < I), other=0.0)
        w = tl.load(w_cols + k[:, None], mask=n_ok[None, :] & (k[:, None] < I), other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    scale = tl.load(pair_weight_ptr + tl.where(ok, pair, 0), mask=ok, other=0.0).to(tl.float32)
    acc = acc * scale[:, None]
    tl.store(y_ptr + tl.where(ok, pair, 0)[:, None] * stride_yp + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=ok[:, None] & n_ok[None, :])


def _align(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Sorted layout without a host sync: slot -> pair index (-1 = padding), block -> expert (-1 = unused)."""
    flat = topk_ids.reshape(-1)
    pairs = flat.numel()
    # not torch.bincount: on CUDA it reads the largest id back to the host to size its output (a sync)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).index_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    rank = torch.arange(pairs, device=flat.device) - (torch.cumsum(counts, 0) - counts)[expert_of]
    num_blocks = triton.cdiv(pairs, block_m) + num_experts
    slot_pair = torch.full((num_blocks * block_m,), -1, dtype=torch.int64, device=flat.device)
    slot_pair[(padded_end - padded)[expert_of] + rank] = order
    block_start = torch.arange(num_blocks, device=flat.device) * block_m
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return slot_pair, block_expert, num_blocks


def _block_m(num_pairs: int) -> int:
    """Rows per block by pairs per step: a decode step has about pairs / experts rows per expert."""
    return 16 if num_pairs <= 512 else 32 if num_pairs <= 4096 else 64


def moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                w2: torch.Tensor, limit: float, pair_out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, D], topk_ids/topk_weights [T, k], w13 [E, 2I, D], w2 [E, D, I] -> [T, D] in x.dtype."""
    T, D = x.shape
    E, I2, _ = w13.shape
    I, top_k = I2 // 2, topk_ids.shape[1]
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    pairs = T * top_k
    if pair_out is None:
        pair_out = torch.empty((pairs, D), dtype=x.dtype, device=x.device)
    if T == 0:
        return pair_out.view(T, top_k, D).sum(1)
    bm = _block_m(pairs)
    slot_pair, block_expert, num_blocks = _align(topk_ids, E, bm)
    h = torch.empty((num_blocks * bm, I), dtype=x.dtype, device=x.device)
    _gate_up_swiglu_kernel[lambda meta: (num_blocks, triton.cdiv(I, meta["BLOCK_N"]))](
        x, w13, slot_pair, block_expert, h, D, I, top_k, float(limit),
        x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        BLOCK_M=bm, PRECISION=dot_precision(x.dtype),
    )
    weights = topk_weights.reshape(-1).float().contiguous()
    _down_kernel[lambda meta: (num_blocks, triton.cdiv(D, meta["BLOCK_N"]))](
        h, w2, slot_pair, block_expert, weights, pair_out, D, I,
        h.stride(0), w2.stride(0), w2.stride(1), pair_out.stride(0),
        BLOCK_M=bm, PRECISION=dot_precision(x.dtype),
    )
    return pair_out.view(T, top_k, D).sum(1, dtype=torch.float32).to(x.dtype)
