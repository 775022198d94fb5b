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
def swiglu(gate, up, limit):
    """V4's clamped SwiGLU of fp32 gate and up columns: silu(min(gate, limit)) * clamp(up, -limit, limit)."""
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    return gate / (1.0 + tl.exp(-gate)) * up


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
    h = swiglu(gate, up, limit)
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
    take 128-row blocks (an 8K prefill's expert GEMMs 6.8 -> 5.7 ms a layer: bench/investigations/kernel_sweep.py, run
    15)."""
    return 16 if num_pairs <= 512 else 32 if num_pairs <= 4096 else 64 if num_pairs <= 16384 else 128


#: the batch-invariant mode's tiles (`NvidiaBackend(invariant=True)`): one block of slots and one K step whatever
#: the step routes (the autotuner picks BLOCK_K 64 or 128 by timing, per process: the bits of a sum over K follow)
INVARIANT_TILES = {"block_m": 16, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}


def moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                w2: torch.Tensor, limit: float, pair_out: torch.Tensor | None = None,
                tiles: dict | None = None, ordered_sum: bool = False) -> torch.Tensor:
    """x [T, D], topk_ids/topk_weights [T, k], w13 [E, 2I, D], w2 [E, D, I] -> [T, D] in x.dtype.
    `tiles` fixes the tiles instead of the autotuner's pick (block_m, and BLOCK_N, BLOCK_K, num_warps,
    num_stages for both GEMMs): bench/investigations/kernel_sweep.py. `ordered_sum`: each token's k expert rows
    added in fp32 in routing order, one elementwise add each (torch's sum over k picks its reduction by shape)."""
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
    return sum_pairs(pair_out.view(T, top_k, D), ordered_sum)


def sum_pairs(rows: torch.Tensor, ordered: bool = False) -> torch.Tensor:
    """Each token's expert rows [T, k, D] added, in fp32 and rounded once to their dtype: by torch's sum over k,
    or (`ordered`, the batch-invariant mode) in routing order, one elementwise add each (torch's sum over k picks
    its reduction by shape)."""
    if not ordered:
        return rows.sum(1)
    acc = rows[:, 0].float()
    for k in range(1, rows.shape[1]):
        acc = acc + rows[:, k].float()
    return acc.to(rows.dtype)


@triton.jit
def _combine_kernel(y_ptr, pair_slot_ptr, weights_ptr, out_ptr, D, stride_y, stride_o,
                    K: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[t] = sum_k weights[t, k] * y[pair_slot[t * K + k]] over BLOCK_D columns, in fp32, rounded once."""
    t = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for k in range(K):
        slot = tl.load(pair_slot_ptr + t * K + k).to(tl.int64)
        w = tl.load(weights_ptr + t * K + k)
        acc += w * tl.load(y_ptr + slot * stride_y + d, mask=d < D, other=0.0).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * stride_o + d, acc.to(out_ptr.dtype.element_ty), mask=d < D)


def sorted_rows(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """The expert-sorted layout a grouped GEMM over contiguous rows wants (`_align`, each expert's run padded to
    a multiple of `block_m`): per slot its token (0 on padding) and its expert (-1 on padding, int32), and per
    (token, k) pair its slot. No host sync."""
    K = topk_ids.shape[1]
    pairs = topk_ids.numel()
    slot_pair, block_expert, num_blocks = _align(topk_ids, num_experts, block_m)
    slots = num_blocks * block_m
    real = slot_pair >= 0
    token = torch.where(real, slot_pair // K, 0)
    expert = torch.where(real, block_expert.repeat_interleave(block_m, output_size=slots), -1).to(torch.int32)
    pair_slot = torch.empty(pairs + 1, dtype=torch.int64, device=topk_ids.device)  # padding lands past the end
    pair_slot.scatter_(0, torch.where(real, slot_pair, pairs), torch.arange(slots, device=topk_ids.device))
    return token, expert, pair_slot[:pairs]


def combine(y: torch.Tensor, pair_slot: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [T, D] = each token's expert rows of y [slots, D] (at `pair_slot`), weighted by `topk_weights`."""
    T, K = topk_weights.shape
    if T:
        D = out.shape[1]
        _combine_kernel[(T, triton.cdiv(D, 1024))](y, pair_slot, topk_weights.float().contiguous(), out, D,
                                                  y.stride(0), out.stride(0), K=K, BLOCK_D=1024, num_warps=4)
    return out


# -- a few tokens: the routed experts and the shared one in two launches -----------------------------------------
#: the most tokens the backend gives `moe_small`: from two tokens on, pairs sharing an expert make it read more
#: bytes than the grouped kernels (bench/decode_trace.py, run 28: batch 4 took 3.25 ms a step against 3.02)
SMALL_TOKENS = 1


@triton.jit
def _pair_weights(ids_ptr, w_ptr, shared_ptr, p, stride_we, stride_wn, stride_sn, K: tl.constexpr):
    """Pair p = token * (K + 1) + j: its token, and the base and row stride of its expert's weight (j < K:
    routed expert ids[token, j]; j == K: the shared expert)."""
    t = p // (K + 1)
    j = p % (K + 1)
    routed = j < K
    e = tl.load(ids_ptr + t * K + tl.minimum(j, K - 1)).to(tl.int64)
    base = tl.where(routed, w_ptr + e * stride_we, shared_ptr)
    stride = tl.where(routed, stride_wn, stride_sn).to(tl.int64)
    return t, j, routed, base, stride


@triton.jit
def _small_gate_up_kernel(x_ptr, ids_ptr, weights_ptr, w_ptr, shared_ptr, h_ptr, D, I, limit,
                          stride_xt, stride_we, stride_wn, stride_sn, stride_hp,
                          K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """h[p] = weight_p * SwiGLU(W13_p x_t) for BLOCK_N of the I columns of pair p (program axis 1). The token's
    row is padded to the 16 rows a tensor-core dot needs, as in `gemv`."""
    p = tl.program_id(1)
    t, j, routed, base, stride = _pair_weights(ids_ptr, w_ptr, shared_ptr, p, stride_we, stride_wn, stride_sn, K)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, 16)
    first = (m == 0)[:, None]
    gate_rows = base + n.to(tl.int64)[:, None] * stride
    up_rows = gate_rows + I * stride
    gate = tl.zeros((16, BLOCK_N), tl.float32)
    up = tl.zeros((16, BLOCK_N), tl.float32)
    for k0 in range(0, D, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + t * stride_xt + m[:, None] * 0 + k[None, :], mask=first & (k < D)[None, :], other=0.0)
        w_ok = (n < I)[:, None] & (k < D)[None, :]
        gate = tl.dot(a, tl.trans(tl.load(gate_rows + k[None, :], mask=w_ok, other=0.0)), gate,
                      input_precision=PRECISION)
        up = tl.dot(a, tl.trans(tl.load(up_rows + k[None, :], mask=w_ok, other=0.0)), up, input_precision=PRECISION)
    weight = tl.where(routed, tl.load(weights_ptr + t * K + tl.minimum(j, K - 1)).to(tl.float32), 1.0)
    h = swiglu(gate, up, limit) * weight
    tl.store(h_ptr + p * stride_hp + m[:, None] * 0 + n[None, :], h.to(h_ptr.dtype.element_ty),
             mask=first & (n < I)[None, :])


@triton.jit
def _small_down_kernel(h_ptr, ids_ptr, w_ptr, shared_ptr, part_ptr, count_ptr, y_ptr, D, I,
                       stride_hp, stride_we, stride_wn, stride_sn, stride_yt,
                       K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """W2_p h[p] for BLOCK_N of the D columns of pair p (program axis 1) into its fp32 part; the last of the
    token's K + 1 pairs to finish that column block (a counter per block, which it resets) sums the parts in
    pair order and rounds once: y[t] = sum_p W2_p h[p] (the pairs' weights are already in h)."""
    p = tl.program_id(1)
    t, _, _, base, stride = _pair_weights(ids_ptr, w_ptr, shared_ptr, p, stride_we, stride_wn, stride_sn, K)
    block = tl.program_id(0)
    n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, 16)
    first = (m == 0)[:, None]
    w_rows = base + n.to(tl.int64)[:, None] * stride
    acc = tl.zeros((16, BLOCK_N), tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(h_ptr + p * stride_hp + m[:, None] * 0 + k[None, :], mask=first & (k < I)[None, :], other=0.0)
        w = tl.load(w_rows + k[None, :], mask=(n < D)[:, None] & (k < I)[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
    part = tl.sum(acc, axis=0)  # rows past the first are zero
    tl.store(part_ptr + p * D + n, part, mask=n < D)
    tl.debug_barrier()  # every thread's part is stored before the counter says so
    counter = count_ptr + t * tl.num_programs(0) + block
    if tl.atomic_add(counter, 1, sem="acq_rel") == K:
        y = tl.zeros((BLOCK_N,), tl.float32)
        for j in range(K + 1):
            y += tl.load(part_ptr + (t * (K + 1) + j) * D + n, mask=n < D, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(counter, 0)  # ready for the next call
        tl.store(y_ptr + t * stride_yt + n, y.to(y_ptr.dtype.element_ty), mask=n < D)


def moe_small(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
              w2: torch.Tensor, limit: float, shared_w13: torch.Tensor, shared_w2: torch.Tensor,
              counters: torch.Tensor, tiles: dict | None = None) -> torch.Tensor:
    """The routed experts plus the shared expert for a few tokens (`Backend.moe_with_shared`; the backend gives
    it SMALL_TOKENS), in two launches with no sorting: one program per (pair, column block) for gate/up, then one
    per (pair, column block) for down, the last of a token's pairs at each column block summing them.

    A decode step at batch 1 otherwise spends 9 launches here (alignment, the two grouped GEMMs, the sum over
    pairs, the shared expert's gate/up, SwiGLU and down, the add), most of them a few microseconds for no bytes.
    Each pair's routing weight scales its SwiGLU output before the down projection (rounded to x's dtype there),
    and the token's sum is accumulated in fp32 and rounded once. Every pair reads its expert's weights, so two
    tokens that share an expert read it twice: past one token the grouped kernels, which read each chosen expert
    once, move fewer bytes. `counters`: at least T * cdiv(D, down_n) int32 on x's device, zero, owned by
    the caller (a call leaves them zero; calls sharing them must not overlap in time, as on one stream).
    `tiles`: gate_up_n, gate_up_k, down_n, down_k, num_warps, num_stages (bench/investigations/kernel_sweep.py)."""
    T, D = x.shape
    K = topk_ids.shape[1]
    I = w2.shape[2]
    # bench/investigations/kernel_sweep.py --only moe_small (run 30, H200, in CUDA graphs): 88 us, 3.99 TB/s of weights
    t = {"gate_up_n": 32, "gate_up_k": 256, "down_n": 32, "down_k": 128, "num_warps": 2, "num_stages": 3}
    t.update(tiles or {})
    x, ids = x.contiguous(), topk_ids.contiguous()
    weights = topk_weights.float().contiguous()
    pairs = T * (K + 1)
    h = torch.empty((pairs, I), dtype=x.dtype, device=x.device)
    part = torch.empty((pairs, D), dtype=torch.float32, device=x.device)
    y = torch.empty((T, D), dtype=x.dtype, device=x.device)
    if T == 0:
        return y
    blocks = triton.cdiv(D, t["down_n"])
    if counters.numel() < T * blocks:
        raise ValueError(f"moe_small needs {T * blocks} arrival counters, got {counters.numel()}")
    precision = dot_precision(x.dtype)
    _small_gate_up_kernel[(triton.cdiv(I, t["gate_up_n"]), pairs)](
        x, ids, weights, w13, shared_w13, h, D, I, float(limit),
        x.stride(0), w13.stride(0), w13.stride(1), shared_w13.stride(0), h.stride(0),
        K=K, BLOCK_N=t["gate_up_n"], BLOCK_K=t["gate_up_k"], PRECISION=precision,
        num_warps=t["num_warps"], num_stages=t["num_stages"],
    )
    _small_down_kernel[(blocks, pairs)](
        h, ids, w2, shared_w2, part, counters, y, D, I, h.stride(0), w2.stride(0), w2.stride(1), shared_w2.stride(0),
        y.stride(0), K=K, BLOCK_N=t["down_n"], BLOCK_K=t["down_k"], PRECISION=precision,
        num_warps=t["num_warps"], num_stages=t["num_stages"],
    )
    return y


@triton.jit
def _route_rows(logits, bias_ptr, hash_ids, scale, E: tl.constexpr, BLOCK_E: tl.constexpr, K: tl.constexpr,
                BLOCK_K: tl.constexpr, HASH: tl.constexpr):
    """`Backend.route` for a tile of rows: logits [R, BLOCK_E] fp32, hash_ids [R, BLOCK_K] (hash layers) ->
    ids [R, BLOCK_K] int32, weights [R, BLOCK_K] fp32 (columns past K unused)."""
    e = tl.arange(0, BLOCK_E)
    ok = (e < E)[None, :]
    scores = tl.sqrt(tl.where(logits > 20.0, logits, libdevice.log1p(tl.exp(logits))))  # torch's softplus threshold
    k = tl.arange(0, BLOCK_K)[None, :]
    if HASH:
        ids = hash_ids
    else:
        ids = tl.zeros(hash_ids.shape, tl.int32)
        sel = tl.where(ok, scores + tl.load(bias_ptr + e, mask=e < E, other=0.0)[None, :], float("-inf"))
        for j in tl.static_range(K):  # the K best, best first, the lowest id among equals
            best = tl.argmax(sel, axis=1, tie_break_left=True)
            ids = tl.where(k == j, best[:, None], ids)
            sel = tl.where(e[None, :] == best[:, None], float("-inf"), sel)
    picked = (ids[:, :, None] == e[None, None, :]) & (k < K)[:, :, None]
    w = tl.sum(tl.where(picked, scores[:, None, :], 0.0), axis=2)
    return ids, w / (tl.sum(w, axis=1)[:, None] + 1e-20) * scale


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, hash_ptr, ids_ptr, weights_ptr, scale, stride_l, stride_h,
                  E: tl.constexpr, BLOCK_E: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr, HASH: tl.constexpr):
    t = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)[None, :]
    k = tl.arange(0, BLOCK_K)[None, :]
    logits = tl.load(logits_ptr + t * stride_l + e, mask=e < E, other=0.0)
    hash_ids = tl.zeros((1, BLOCK_K), tl.int32)
    if HASH:
        hash_ids = tl.load(hash_ptr + t * stride_h + k, mask=k < K, other=0).to(tl.int32)
    ids, w = _route_rows(logits, bias_ptr, hash_ids, scale, E, BLOCK_E, K, BLOCK_K, HASH)
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


@triton.jit
def _route_hidden_kernel(x_ptr, w_ptr, bias_ptr, table_ptr, token_ptr, part_ptr, count_ptr, ids_ptr, weights_ptr,
                         T, D, chunk, scale, stride_xt, stride_w, stride_table,
                         E: tl.constexpr, BLOCK_E: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCK_D: tl.constexpr, PARTS: tl.constexpr, HASH: tl.constexpr):
    """Program p: the logits of every token over its `chunk` of the D columns, into part p; the last program to
    finish (a counter, which it resets) sums the parts in order and routes (`_route_rows`)."""
    p = tl.program_id(0)
    t = tl.arange(0, 16)
    e = tl.arange(0, BLOCK_E)
    acc = tl.zeros((16, BLOCK_E), tl.float32)
    for d0 in range(p * chunk, tl.minimum((p + 1) * chunk, D), BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        a = tl.load(x_ptr + t[:, None] * stride_xt + d[None, :], mask=(t < T)[:, None] & (d < D)[None, :], other=0.0)
        w = tl.load(w_ptr + e[:, None] * stride_w + d[None, :], mask=(e < E)[:, None] & (d < D)[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(w), acc)
    cell = t[:, None] * BLOCK_E + e[None, :]
    tl.store(part_ptr + p * 16 * BLOCK_E + cell, acc)
    tl.debug_barrier()  # every thread's part is stored before the counter says so
    if tl.atomic_add(count_ptr, 1, sem="acq_rel") == PARTS - 1:
        logits = tl.zeros((16, BLOCK_E), tl.float32)
        for q in range(PARTS):
            logits += tl.load(part_ptr + q * 16 * BLOCK_E + cell, cache_modifier=".cg")
        tl.atomic_xchg(count_ptr, 0)  # ready for the next call
        k = tl.arange(0, BLOCK_K)[None, :]
        rows = (t < T)[:, None]
        hash_ids = tl.zeros((16, BLOCK_K), tl.int32)
        if HASH:
            token = tl.load(token_ptr + t, mask=t < T, other=0)
            hash_ids = tl.load(table_ptr + token[:, None] * stride_table + k, mask=rows & (k < K), other=0).to(tl.int32)
        ids, w = _route_rows(logits, bias_ptr, hash_ids, scale, E, BLOCK_E, K, BLOCK_K, HASH)
        tl.store(ids_ptr + t[:, None] * K + k, ids.to(tl.int64), mask=rows & (k < K))
        tl.store(weights_ptr + t[:, None] * K + k, w, mask=rows & (k < K))


#: the most tokens `route_hidden` takes (one 16-row tile)
ROUTE_HIDDEN_TOKENS = 16


def route_hidden(x, weight, bias, tid2eid, token_ids, top_k: int, scale: float, counter: torch.Tensor,
                 parts: int | None = None):
    """`Backend.route_hidden` for up to ROUTE_HIDDEN_TOKENS tokens in one launch: the router's logits (fp32
    products of x's and the weight's 16-bit values) split over `parts` programs by columns, then routing in the
    last one to finish. `counter`: one int32 on x's device, zero, owned by the caller (a launch leaves it zero;
    launches sharing it must not overlap in time, as on one stream)."""
    T, D = x.shape
    E = weight.shape[0]
    if parts is None:
        parts = max(1, min(32, D // 128))
    block_e = max(16, triton.next_power_of_2(E))
    ids = torch.empty((T, top_k), dtype=torch.long, device=x.device)
    weights = torch.empty((T, top_k), dtype=torch.float32, device=x.device)
    if T == 0:
        return ids, weights
    part = torch.empty((parts, 16, block_e), dtype=torch.float32, device=x.device)
    chunk = triton.cdiv(triton.cdiv(D, parts), 64) * 64
    hashed = tid2eid is not None
    _route_hidden_kernel[(parts,)](
        x, weight, bias.float().contiguous() if bias is not None else part, tid2eid if hashed else part,
        token_ids if hashed else part, part, counter, ids, weights, T, D, chunk, float(scale),
        x.stride(0), weight.stride(0), tid2eid.stride(0) if hashed else 0,
        E=E, BLOCK_E=block_e, K=top_k, BLOCK_K=triton.next_power_of_2(top_k), BLOCK_D=64, PARTS=parts, HASH=hashed,
        num_warps=4,
    )
    return ids, weights
