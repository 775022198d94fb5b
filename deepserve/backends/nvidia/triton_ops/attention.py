"""Sparse MQA over an index list (V4 attention): one K=V head shared by all query heads, per-head sink.

One program owns one query and a block of heads. It walks the query's index list in blocks of keys, gathers
those rows of the pool straight from memory (no [T, K, d] gather in between), and keeps an online softmax whose
running maximum and denominator start at the head's sink logit, so the sink joins the denominator without a
separate pass and the maximum is finite from the first block on.

A decode step has few queries (a batch-1 step: one query, two programs for 132 multiprocessors), so there the
index list is split into parts, one program each (the sink in part 0's softmax only), and a second kernel
merges the parts' running maxima, denominators and sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import SMS, dot_precision
from .elementwise import rotate_pairs

LOG2E = 1.4426950408889634


@triton.jit
def _sparse_mqa_kernel(
    q_ptr, kv_ptr, idx_ptr, sink_ptr, out_ptr, part_ptr, stat_ptr, pos_ptr, freq_ptr,
    K, H, scale_log2, per_split, half,
    stride_qt, stride_qh, stride_kvn, stride_it, stride_ot, stride_oh, stride_pos,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, SPLITS: tl.constexpr,
    ROPE: tl.constexpr,
):
    """ROPE: the output's last 2 * half dims turned back by the query's position (`rotate_pairs`) before the
    store (here with one part, else in `_merge_kernel`)."""
    t, split, heads, head_ok, dims, q, m, denom, acc, lo, hi = start_part(q_ptr, sink_ptr, H, K, per_split, stride_qt,
                                                                           stride_qh, D, BLOCK_H)
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        rows = tl.load(idx_ptr + t * stride_it + cols, mask=cols < hi, other=-1)
        ok = rows >= 0
        keys = tl.load(kv_ptr + tl.where(ok, rows, 0)[:, None] * stride_kvn + dims[None, :], mask=ok[:, None], other=0.0)
        m, denom, acc = online_block(q, keys, ok, m, denom, acc, scale_log2, PRECISION)
    finish_part(acc, m, denom, out_ptr, part_ptr, stat_ptr, pos_ptr, freq_ptr, t, split, heads, head_ok, dims, H,
                half, stride_ot, stride_oh, stride_pos, D, SPLITS, ROPE)


@triton.jit
def start_part(q_ptr, sink_ptr, H, K, per_split, stride_qt, stride_qh, D: tl.constexpr, BLOCK_H: tl.constexpr):
    """This program's query t, part `split` and block of heads; the query's rows of them, and the part's softmax
    started (logits in log2 units: exp2 is the fast path; the sink joins the first part's softmax only) over its
    range [lo, hi) of the index list."""
    t = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    dims = tl.arange(0, D)
    head_ok = heads < H
    q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + dims[None, :], mask=head_ok[:, None], other=0.0)
    sink = tl.load(sink_ptr + heads, mask=head_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    m = tl.where(split == 0, sink, float("-inf"))
    denom = tl.where(split == 0, 1.0, 0.0) + tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, D), tl.float32)
    lo = split * per_split
    return t, split, heads, head_ok, dims, q, m, denom, acc, lo, tl.minimum(lo + per_split, K)


@triton.jit
def online_block(q, keys, ok, m, denom, acc, scale_log2, PRECISION: tl.constexpr):
    """One block of keys [BLOCK_N, D] (`ok`: the real ones) folded into the heads' running maximum `m`,
    denominator and sum `acc` (logits in log2 units); returns the three."""
    s = tl.dot(q, tl.trans(keys), input_precision=PRECISION) * scale_log2
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a part with no key yet: nothing to scale
    p = tl.exp2(s - safe[:, None])
    alpha = tl.exp2(m - safe)
    denom = denom * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(keys.dtype), keys, input_precision=PRECISION)
    return m_new, denom, acc


@triton.jit
def finish_part(acc, m, denom, out_ptr, part_ptr, stat_ptr, pos_ptr, freq_ptr, t, split, heads, head_ok, dims, H,
                half, stride_ot, stride_oh, stride_pos, D: tl.constexpr, SPLITS: tl.constexpr, ROPE: tl.constexpr):
    """One part: the output (its rotary dims turned back with ROPE) where it is the only one, else its running
    sum, maximum and denominator for `_merge_kernel`."""
    if SPLITS == 1:
        out = acc / denom[:, None]
        if ROPE:
            out = rotate_pairs(out, half - D // 2, tl.load(pos_ptr + t * stride_pos).to(tl.float32), freq_ptr, half,
                               True)
        tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
    else:
        at = (t * SPLITS + split) * H + heads
        tl.store(part_ptr + at[:, None] * D + dims[None, :], acc, mask=head_ok[:, None])
        tl.store(stat_ptr + 2 * at, m, mask=head_ok)
        tl.store(stat_ptr + 2 * at + 1, denom, mask=head_ok)


@triton.jit
def _merge_kernel(part_ptr, stat_ptr, out_ptr, pos_ptr, freq_ptr, H, half, stride_ot, stride_oh, stride_pos,
                  D: tl.constexpr, SPLITS: tl.constexpr, BLOCK_D: tl.constexpr, ROPE: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    parts = tl.arange(0, SPLITS)
    at = (t * SPLITS + parts) * H + h
    m = tl.load(stat_ptr + 2 * at)
    denom = tl.load(stat_ptr + 2 * at + 1)
    top = tl.max(m, axis=0)  # finite: part 0 holds the sink
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - top))
    total = tl.sum(w * denom, axis=0)
    for d0 in tl.static_range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        acc = tl.load(part_ptr + at[:, None] * D + d[None, :])
        out = tl.sum(acc * w[:, None], axis=0) / total
        if ROPE and d0 + BLOCK_D > D - 2 * half:  # (a chunk holding rotary pairs)
            position = tl.load(pos_ptr + t * stride_pos).to(tl.float32)
            out = tl.reshape(rotate_pairs(out[None, :], (d0 - D) // 2 + half, position, freq_ptr, half, True),
                             (BLOCK_D,))
        tl.store(out_ptr + t * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def tile_choice(T: int, H: int, d: int, K: int, itemsize: int, tiles: dict | None = None) -> dict:
    """The tiles for T queries of H heads of width d over index lists of K entries (block_h, block_n, num_warps,
    num_stages, splits); `tiles` overrides any of them (the others still chosen around it)."""
    block_h = max(16, min(32 if d >= 256 else 64, triton.next_power_of_2(H)))
    block_n = 32 if d >= 256 else 64
    warps, stages = (8 if d >= 256 else 4), 2
    few_queries = False
    if d >= 256 and itemsize == 2:
        # bench/investigations/kernel_sweep.py on the H200 (run 15), d = 512 bf16: 64 keys per block; all 64 heads in
        # one program
        # once there are queries enough to fill the machine (each key row is read once per program, so a second
        # head block read every key twice: an 8K CSA prefill 8.3 -> 3.0 ms), 32 heads for decode-sized steps
        block_n = 64
        if T * triton.cdiv(H, 64) >= 2 * SMS:
            block_h = max(16, min(64, triton.next_power_of_2(H)))
        elif T * triton.cdiv(H, 32) <= 8:  # a step of 1-4 queries: 16 heads a program, keys split 16 ways (run 20:
            block_h, few_queries = 16, True  # a batch-1 step's 640 keys 16.8 -> 8.7 us; each program reads its keys)
    tiles = tiles or {}
    block_h, block_n = tiles.get("block_h", block_h), tiles.get("block_n", block_n)
    warps, stages = tiles.get("num_warps", warps), tiles.get("num_stages", stages)
    programs = T * triton.cdiv(H, block_h)
    splits = 1
    if "splits" in tiles:
        splits = tiles["splits"]
    elif few_queries:  # one key block a part (parts past the list's end stop at once)
        while splits < min(16, triton.cdiv(K, block_n)):
            splits *= 2
    elif programs <= 32:  # few queries: parts of at least 2 key blocks, up to about one program per multiprocessor
        most = min(-(-SMS // programs), K // (2 * block_n), 16)
        while splits * 2 <= most:
            splits *= 2
    return dict(block_h=block_h, block_n=block_n, num_warps=warps, num_stages=stages, splits=splits)


def invariant_tiles(H: int, d: int) -> dict:
    """The batch-invariant mode's tiles (`NvidiaBackend(invariant=True)`): from the head count and width only, one
    part per query (each query's keys in one online softmax, in list order, whatever the step's size)."""
    return {"block_h": max(16, min(32 if d >= 256 else 64, triton.next_power_of_2(H))),
            "block_n": 64 if d <= 512 else 32, "num_warps": 8 if d >= 256 else 4, "num_stages": 2, "splits": 1}


def launch_buffers(q, indices, sinks, out, rope, splits: int):
    """(positions, inv_freq, rotary pairs, part sums, part stats) for a sparse MQA launch: `rope`'s tensors (the
    index list and sinks stand in, unread, without it) and the parts' fp32 buffers where the list is split (`out`
    stands in for one part)."""
    T, H, d = q.shape
    positions, freq = rope if rope is not None else (indices, sinks)
    if rope is not None:
        freq = freq.float().contiguous()
        if 2 * freq.shape[0] > d:
            raise ValueError(f"{freq.shape[0]} rotary pairs do not fit head_dim {d}")
    half = freq.shape[0] if rope is not None else 0
    part = stat = out
    if splits > 1:
        part = torch.empty((T, splits, H, d), dtype=torch.float32, device=q.device)
        stat = torch.empty((T, splits, H, 2), dtype=torch.float32, device=q.device)
    return positions, freq, half, part, stat


def sparse_mqa(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sinks: torch.Tensor, scale: float,
               out: torch.Tensor | None = None, tiles: dict | None = None, rope: tuple | None = None) -> torch.Tensor:
    """q [T, H, d], kv [N, d] (same dtype), indices [T, K] (entries < 0 ignored), sinks [H] -> [T, H, d].
    `tiles` overrides the tile choice (block_h, block_n, num_warps, num_stages, splits):
    bench/investigations/kernel_sweep.py.
    `rope` (positions [T], inv_freq [half]): the output's last 2 * half dims turned back by each query's position
    (`Backend.sparse_attention_rope`) in fp32 before the one rounding, where a separate inverse RoPE read the
    rounded output back (a launch a layer)."""
    T, H, d = q.shape
    if d & (d - 1):
        raise ValueError(f"head_dim must be a power of two, got {d}")
    q, kv = q.contiguous(), kv.contiguous()
    indices = indices.contiguous()
    out = torch.empty_like(q) if out is None else out
    if T == 0:
        return out
    K = indices.shape[1]
    t = tile_choice(T, H, d, K, q.element_size(), tiles)
    block_h, block_n, warps, stages, splits = t["block_h"], t["block_n"], t["num_warps"], t["num_stages"], t["splits"]
    per_split = triton.cdiv(triton.cdiv(K, splits), block_n) * block_n
    positions, freq, half, part, stat = launch_buffers(q, indices, sinks, out, rope, splits)
    _sparse_mqa_kernel[(T, triton.cdiv(H, block_h), splits)](
        q, kv, indices, sinks.float().contiguous(), out, part, stat, positions, freq, K, H, scale * LOG2E, per_split,
        half, q.stride(0), q.stride(1), kv.stride(0), indices.stride(0), out.stride(0), out.stride(1),
        positions.stride(0), D=d, BLOCK_H=block_h, BLOCK_N=block_n, PRECISION=dot_precision(q.dtype), SPLITS=splits,
        ROPE=rope is not None, num_warps=warps, num_stages=stages,
    )
    if splits > 1:
        _merge_kernel[(T, H)](part, stat, out, positions, freq, H, half, out.stride(0), out.stride(1),
                              positions.stride(0), D=d, SPLITS=splits, BLOCK_D=min(d, 256), ROPE=rope is not None,
                              num_warps=4)
    return out
