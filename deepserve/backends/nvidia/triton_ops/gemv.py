"""Projections of a few rows (a batch-1 to batch-4 decode step): `x @ w.T` read at the memory's pace.

At one to four rows a projection is a matrix-vector product: its time is the weight's bytes over the memory
bandwidth, and nothing else. cuBLAS picks tiles made for wider products at these shapes and (for the long-K
ones) a split-K pass with a second reduction kernel: 2.0-3.7 TB/s on the H200 (bench/investigations/kernel_sweep.py,
run 22). Here a program owns BLOCK_N output columns and one chunk of the K dimension, its weight tiles streamed through
shared memory by Triton's pipelined loads (`num_stages`), the few rows padded to the 16 a tensor-core dot needs.
A grouped projection (`grouped_linear`: x [T, G, K], w [G, N, K]) is the same with a group per grid row.

Split K: the narrow projections (a window layer's 1536 input columns are 48 blocks of 32) have too few column
blocks to keep every multiprocessor streaming, so K is cut into `split` chunks, one program each. Each writes
its fp32 part; the last program of a column block to finish (an arrival counter per block, as in
`moe.moe_small`, reset by that program) adds the parts in chunk order and rounds once, so the result does not
depend on which program finished first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import SMS, dot_precision

#: the most rows this path takes; wider steps go to cuBLAS, whose tiles then pay off
MAX_ROWS = 4
ROW_BLOCK = 16  # the kernel's one row block: the most rows a call can compute (MAX_ROWS is where it pays)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, part_ptr, count_ptr, norm_ptr, M, N, K, chunk, eps,
                 stride_xg, stride_xm, stride_wg, stride_wn, stride_og, stride_om,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                 SPLIT: tl.constexpr, NORM: tl.constexpr):
    """NORM: each row of x RMS-normed with `norm` first (every program sums the row's squares itself: a few KB
    from the L2), rounded to x's dtype as a separate `rms_norm` would store it."""
    block = tl.program_id(0)
    g = tl.program_id(1)
    n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    x_rows = x_ptr + g * stride_xg + m[:, None] * stride_xm
    w_rows = w_ptr + g.to(tl.int64) * stride_wg + n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if NORM:
        squares = tl.zeros((BLOCK_M,), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_rows + k[None, :], mask=(m < M)[:, None] & (k < K)[None, :], other=0.0).to(tl.float32)
            squares += tl.sum(x * x, axis=1)
        r = tl.rsqrt(squares / K + eps)[:, None]
    k_first = tl.program_id(2) * chunk
    for k0 in range(k_first, k_first + chunk, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + k[None, :], mask=(m < M)[:, None] & (k < K)[None, :], other=0.0)
        if NORM:
            x = (x.to(tl.float32) * r * tl.load(norm_ptr + k, mask=k < K, other=0.0).to(tl.float32)[None, :]
                 ).to(x_ptr.dtype.element_ty)
        w = tl.load(w_rows + k[None, :], mask=(n < N)[:, None] & (k < K)[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    out_at = out_ptr + g * stride_og + m[:, None] * stride_om + n[None, :]
    ok = (m < M)[:, None] & (n < N)[None, :]
    if SPLIT == 1:
        tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        G = tl.num_programs(1)
        parts = part_ptr + (g * M + m[:, None]) * N + n[None, :]  # part s of (g, m, n) at s * G * M * N
        add_parts_on_arrival(acc, parts, tl.program_id(2), G * M * N, count_ptr + g * tl.num_programs(0) + block,
                             out_at, ok, SPLIT, BLOCK_M, BLOCK_N)


@triton.jit
def add_parts_on_arrival(acc, parts, part, part_stride, counter, out_at, ok, SPLIT: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Split K's epilogue: this program's fp32 part `acc` stored as part `part` (at `parts + part * part_stride`);
    the last of the tile's SPLIT programs to arrive (`counter`, left zero for the next call) adds the parts in
    split order and stores the sum at `out_at` in its dtype, so the result does not depend on arrival order."""
    tl.store(parts + part * part_stride, acc, mask=ok)
    tl.debug_barrier()  # every thread's part is stored before the counter says so
    if tl.atomic_add(counter, 1, sem="acq_rel") == SPLIT - 1:
        total = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for s in range(SPLIT):
            total += tl.load(parts + s * part_stride, mask=ok, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(counter, 0)  # ready for the next call
        tl.store(out_at, total.to(out_at.dtype.element_ty), mask=ok)


def _tiles(N: int, K: int, G: int, tiles: dict | None) -> dict:
    """BLOCK_N, BLOCK_K, warps, stages and the K split. Tiles from bench/investigations/kernel_sweep.py (run 22 on the
    H200: 32 columns, 256-deep K tiles, two warps came within a few percent of each shape's best; q_b's 32768 x 1024
    wanted 64 x 128, o_b's 4096 x 8192 six stages). The split only where the column blocks number fewer than
    the multiprocessors (K <= 4096): chunks of K until there are about two programs per multiprocessor, each at
    least two K tiles deep. In the batch-1 step (bench/decode_trace.py, run 34) it took a window layer's input
    projections from 8.1 us (cuBLAS) to 7.5 and an HCA layer's from 10.7 to 9.2; splitting o_a (256 blocks) and
    o_b (128 blocks of K = 8192) cost them 1-3 us each."""
    t = {"BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 2, "num_stages": 3}
    if N >= 16384 and K <= 1024:
        t.update(BLOCK_N=64, BLOCK_K=128)
    if K >= 8192:  # o_b's 4096 x 8192: 128 programs, each wants more of its long K in flight (run 22: 3.1 -> 3.7 TB/s)
        t.update(num_stages=6)
    t.update({k: v for k, v in (tiles or {}).items() if k != "split"})
    programs, split = triton.cdiv(N, t["BLOCK_N"]) * G, 1
    if programs < SMS and K <= 4096:
        while programs * split < 2 * SMS and K // (split * 2) >= 2 * t["BLOCK_K"]:
            split *= 2
    t["split"] = (tiles or {}).get("split", split)
    return t


def gemv(x: torch.Tensor, w: torch.Tensor, tiles: dict | None = None,
         counters: torch.Tensor | None = None, norm: tuple | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K].T -> [M, N] in x's dtype, for M <= MAX_ROWS (fp32 accumulation): one group."""
    return grouped_gemv(x[:, None], w[None], tiles, counters, norm)[:, 0]


def grouped_gemv(x: torch.Tensor, w: torch.Tensor, tiles: dict | None = None,
                 counters: torch.Tensor | None = None, norm: tuple | None = None) -> torch.Tensor:
    """x [M, G, K], w [G, N, K] -> [M, G, N]: group g of every row through w[g], for M <= MAX_ROWS.

    `counters`: zeroed int32 arrival counters on x's device, at least G * cdiv(N, BLOCK_N) of them, owned by the
    caller (a call leaves them zero; calls sharing them must not overlap in time, as on one stream). Without
    them (or with too few) K is not split. `norm` (weight [K], eps): each x[m, g] RMS-normed with it first
    (`Backend.rms_norm_linear`)."""
    M, G, K = x.shape
    N = w.shape[1]
    if M > ROW_BLOCK:
        raise ValueError(f"grouped_gemv computes at most {ROW_BLOCK} rows per call, got {M} (rows past it would "
                         f"be left unwritten); larger products go through cuBLAS")
    out = torch.empty((M, G, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    if w.stride(-1) != 1:
        w = w.contiguous()
    t = _tiles(N, K, G, tiles)
    blocks = triton.cdiv(N, t["BLOCK_N"])
    split = t["split"] if counters is not None and counters.numel() >= G * blocks else 1
    chunk = triton.cdiv(triton.cdiv(K, split), t["BLOCK_K"]) * t["BLOCK_K"]
    split = triton.cdiv(K, chunk)  # (rounding the chunk up can leave fewer chunks)
    part = torch.empty((split, G, M, N), dtype=torch.float32, device=x.device) if split > 1 else out
    _gemv_kernel[(blocks, G, split)](
        x, w, out, part, counters if split > 1 else out, norm[0] if norm is not None else x, M, N, K, chunk,
        float(norm[1]) if norm is not None else 0.0,
        x.stride(1), x.stride(0), w.stride(0), w.stride(1), out.stride(1), out.stride(0),
        BLOCK_M=ROW_BLOCK, BLOCK_N=t["BLOCK_N"], BLOCK_K=t["BLOCK_K"], PRECISION=dot_precision(x.dtype), SPLIT=split,
        NORM=norm is not None, num_warps=t["num_warps"], num_stages=t["num_stages"],
    )
    return out
