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
from triton.language.extra import libdevice

from .common import dot_precision


# tiles picked per (D, I, BLOCK_M) at first use: decode blocks are short and want many N tiles in flight,
# prefill blocks want wider ones
_CONFIGS = [
    triton.Config({"BLOCK_N": 64, "BLOCK_K": 128}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_N": 128, "BLOCK_K": 64}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_N": 64, "BLOCK_K": 64}, num_warps=4, num_stages=5),
    triton.Config({"BLOCK_N": 128, "BLOCK_K": 64}, num_warps=8, num_stages=3),
]


@triton.jit
def _block_slots(block_expert_ptr, slot_pair_ptr, BLOCK_M: tl.constexpr):
    """This program's block of sorted slots: its expert (-1: an unused block), the slots, their (token, k) pair
    indices and which slots hold one (padding holds -1)."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    slots = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(slot_pair_ptr + slots)
    return expert, slots, pair, pair >= 0


@triton.autotune(configs=_CONFIGS, key=["D", "I", "BLOCK_M"])
@triton.jit
def _gate_up_swiglu_kernel(
    x_ptr, w_ptr, slot_pair_ptr, block_expert_ptr, h_ptr,
    D, I, top_k, limit,
    stride_xt, stride_we, stride_wn, stride_hm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    expert, slots, pair, ok = _block_slots(block_expert_ptr, slot_pair_ptr, BLOCK_M)
    if expert < 0:
        return
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
    expert, slots, pair, ok = _block_slots(block_expert_ptr, slot_pair_ptr, BLOCK_M)
    if expert < 0:
        return
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


@triton.jit
def _align_small_kernel(ids_ptr, slot_pair_ptr, block_expert_ptr, pairs, num_slots, num_blocks,
                        E: tl.constexpr, BLOCK_E: tl.constexpr, BM: tl.constexpr, BLOCK_P: tl.constexpr):
    """`_align` in one program, for the few pairs of a decode step: counts by comparison, each pair's slot from
    its expert's padded start plus its stable rank among the pairs of that expert (the order torch's stable
    argsort gives), every other slot -1, each block's expert from the padded ends."""
    e = tl.arange(0, BLOCK_E)
    e_ok = e < E
    counts = tl.zeros((BLOCK_E,), tl.int32)
    for p0 in range(0, pairs, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        ids = tl.load(ids_ptr + p, mask=p < pairs, other=-1)
        counts += tl.sum((ids[:, None] == e[None, :]).to(tl.int32), axis=0)
    padded = (counts + BM - 1) // BM * BM
    end = tl.cumsum(padded, 0)
    start = end - padded
    end = tl.where(e_ok, end, 2**30)
    for s0 in range(0, num_slots, 1024):
        s = s0 + tl.arange(0, 1024)
        tl.store(slot_pair_ptr + s, tl.full((1024,), -1, tl.int64), mask=s < num_slots)
    for b0 in range(0, num_blocks, 64):
        b = b0 + tl.arange(0, 64)
        expert = tl.sum((end[None, :] <= (b * BM)[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, tl.where(expert < E, expert, -1).to(tl.int64), mask=b < num_blocks)
    tl.debug_barrier()  # the -1 fill lands before the pairs' slots
    seen = tl.zeros((BLOCK_E,), tl.int32)  # pairs of each expert in earlier tiles
    q = tl.arange(0, BLOCK_P)
    for p0 in range(0, pairs, BLOCK_P):
        p = p0 + q
        ids = tl.load(ids_ptr + p, mask=p < pairs, other=-1)
        onehot = (ids[:, None] == e[None, :]).to(tl.int32)  # [P, E]
        same = (ids[:, None] == ids[None, :]) & (q[None, :] < q[:, None])  # an earlier pair of this tile, same expert
        rank = tl.sum(same.to(tl.int32), axis=1) + tl.sum(onehot * seen[None, :], axis=1)
        dest = tl.sum(onehot * start[None, :], axis=1) + rank
        tl.store(slot_pair_ptr + dest, p.to(tl.int64), mask=p < pairs)
        seen += tl.sum(onehot, axis=0)


def _align_small(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    flat = topk_ids.reshape(-1).contiguous()
    pairs = flat.numel()
    num_blocks = triton.cdiv(pairs, block_m) + num_experts
    slot_pair = torch.empty((num_blocks * block_m,), dtype=torch.int64, device=flat.device)
    block_expert = torch.empty((num_blocks,), dtype=torch.int64, device=flat.device)
    _align_small_kernel[(1,)](flat, slot_pair, block_expert, pairs, num_blocks * block_m, num_blocks,
                              E=num_experts, BLOCK_E=triton.next_power_of_2(num_experts), BM=block_m, BLOCK_P=32,
                              num_warps=4)
    return slot_pair, block_expert, num_blocks


# one program aligns up to this many (token, expert) pairs faster than the ~20 launches of `_align`
SMALL_ALIGN_PAIRS = 2048


def _block_m(num_pairs: int) -> int:
    """Rows per block by pairs per step: a decode step has about pairs / experts rows per expert. Long prefills
    take 128-row blocks (an 8K prefill's expert GEMMs 6.8 -> 5.7 ms a layer: bench/kernel_sweep.py, run 15)."""
    return 16 if num_pairs <= 512 else 32 if num_pairs <= 4096 else 64 if num_pairs <= 16384 else 128


def moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                w2: torch.Tensor, limit: float, pair_out: torch.Tensor | None = None,
                tiles: dict | None = None) -> torch.Tensor:
    """x [T, D], topk_ids/topk_weights [T, k], w13 [E, 2I, D], w2 [E, D, I] -> [T, D] in x.dtype.
    `tiles` fixes the tiles instead of the autotuner's pick (block_m, and BLOCK_N, BLOCK_K, num_warps,
    num_stages for both GEMMs): bench/kernel_sweep.py."""
    T, D = x.shape
    E, I2, _ = w13.shape
    I, top_k = I2 // 2, topk_ids.shape[1]
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    pairs = T * top_k
    if pair_out is None:
        pair_out = torch.empty((pairs, D), dtype=x.dtype, device=x.device)
    if T == 0:
        return pair_out.view(T, top_k, D).sum(1)
    bm = tiles["block_m"] if tiles and "block_m" in tiles else _block_m(pairs)
    fixed = {k: v for k, v in (tiles or {}).items() if k != "block_m"}
    gate_up, down = (_gate_up_swiglu_kernel.fn, _down_kernel.fn) if fixed else (_gate_up_swiglu_kernel, _down_kernel)
    align = _align_small if pairs <= SMALL_ALIGN_PAIRS and E <= 1024 else _align
    slot_pair, block_expert, num_blocks = align(topk_ids, E, bm)
    h = torch.empty((num_blocks * bm, I), dtype=x.dtype, device=x.device)
    gate_up[lambda meta: (num_blocks, triton.cdiv(I, meta["BLOCK_N"]))](
        x, w13, slot_pair, block_expert, h, D, I, top_k, float(limit),
        x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        BLOCK_M=bm, PRECISION=dot_precision(x.dtype), **fixed,
    )
    weights = topk_weights.reshape(-1).float().contiguous()
    down[lambda meta: (num_blocks, triton.cdiv(D, meta["BLOCK_N"]))](
        h, w2, slot_pair, block_expert, weights, pair_out, D, I,
        h.stride(0), w2.stride(0), w2.stride(1), pair_out.stride(0),
        BLOCK_M=bm, PRECISION=dot_precision(x.dtype), **fixed,
    )
    return pair_out.view(T, top_k, D).sum(1)  # accumulated in fp32 (torch's bf16 sum), rounded once


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, hash_ptr, ids_ptr, weights_ptr, scale, stride_l, stride_h,
                  E: tl.constexpr, BLOCK_E: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr, HASH: tl.constexpr):
    t = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    ok = e < E
    x = tl.load(logits_ptr + t * stride_l + e, mask=ok, other=0.0)
    scores = tl.sqrt(tl.where(x > 20.0, x, libdevice.log1p(tl.exp(x))))  # softplus with torch's threshold
    k = tl.arange(0, BLOCK_K)
    ids = tl.zeros((BLOCK_K,), tl.int32)
    if HASH:
        ids = tl.load(hash_ptr + t * stride_h + k, mask=k < K, other=0).to(tl.int32)
    else:
        sel = tl.where(ok, scores + tl.load(bias_ptr + e, mask=ok, other=0.0), float("-inf"))
        for j in tl.static_range(K):  # the K best, best first, the lowest id among equals
            best = tl.argmax(sel, axis=0, tie_break_left=True)
            ids = tl.where(k == j, best, ids)
            sel = tl.where(e == best, float("-inf"), sel)
    picked = (ids[:, None] == e[None, :]) & (k < K)[:, None]
    w = tl.sum(tl.where(picked, scores[None, :], 0.0), axis=1)
    w = w / (tl.sum(w, axis=0) + 1e-20) * scale
    tl.store(ids_ptr + t * K + k, ids.to(tl.int64), mask=k < K)
    tl.store(weights_ptr + t * K + k, w, mask=k < K)


def route(logits, bias, hash_ids, top_k: int, scale: float):
    """The backend op `route` (see `Backend.route`): one program per token."""
    T, E = logits.shape
    logits = logits.float().contiguous()
    ids = torch.empty((T, top_k), dtype=torch.long, device=logits.device)
    weights = torch.empty((T, top_k), dtype=torch.float32, device=logits.device)
    if T:
        hashed = hash_ids is not None
        _route_kernel[(T,)](
            logits, bias.float().contiguous() if bias is not None else logits, hash_ids if hashed else logits,
            ids, weights, float(scale), logits.stride(0), hash_ids.stride(0) if hashed else 0,
            E=E, BLOCK_E=triton.next_power_of_2(E), K=top_k, BLOCK_K=triton.next_power_of_2(top_k), HASH=hashed,
            num_warps=4 if E >= 512 else 1,
        )
    return ids, weights
