"""Projections of a few rows (a batch-1 to batch-4 decode step): `x @ w.T` read at the memory's pace.

At one to four rows a projection is a matrix-vector product: its time is the weight's bytes over the memory
bandwidth, and nothing else. cuBLAS picks tiles made for wider products at these shapes and (for the long-K
ones) a split-K pass with a second reduction kernel: 2.0-3.7 TB/s on the H200 (bench/kernel_sweep.py, run 22).
Here a program owns BLOCK_N output columns and walks the whole K, its weight tiles streamed through shared
memory by Triton's pipelined loads (`num_stages`), the few rows padded to the 16 a tensor-core dot needs. A
grouped projection (`grouped_linear`: x [T, G, K], w [G, N, K]) is the same with a group per grid row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import dot_precision

#: the most rows this path takes; wider steps go to cuBLAS, whose tiles then pay off
MAX_ROWS = 4


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xg, stride_xm, stride_wg, stride_wn, stride_og, stride_om,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    g = tl.program_id(1)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    x_rows = x_ptr + g * stride_xg + m[:, None] * stride_xm
    w_rows = w_ptr + g.to(tl.int64) * stride_wg + n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + k[None, :], mask=(m < M)[:, None] & (k < K)[None, :], other=0.0)
        w = tl.load(w_rows + k[None, :], mask=(n < N)[:, None] & (k < K)[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    tl.store(out_ptr + g * stride_og + m[:, None] * stride_om + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(m < M)[:, None] & (n < N)[None, :])


def _tiles(N: int, K: int, tiles: dict | None) -> dict:
    """BLOCK_N, BLOCK_K, warps and stages (bench/kernel_sweep.py, run 22 on the H200: 32 columns, 256-deep K
    tiles, two warps came within a few percent of each shape's best; q_b's 32768 x 1024 wanted 64 x 128, o_b's
    4096 x 8192 six stages)."""
    t = {"BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 2, "num_stages": 3}
    if N >= 16384 and K <= 1024:
        t.update(BLOCK_N=64, BLOCK_K=128)
    if K >= 8192:  # o_b's 4096 x 8192: 128 programs, each wants more of its long K in flight (run 22: 3.1 -> 3.7 TB/s)
        t.update(num_stages=6)
    t.update(tiles or {})
    return t


def gemv(x: torch.Tensor, w: torch.Tensor, tiles: dict | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K].T -> [M, N] in x's dtype, for M <= MAX_ROWS (fp32 accumulation): one group."""
    return grouped_gemv(x[:, None], w[None], tiles)[:, 0]


def grouped_gemv(x: torch.Tensor, w: torch.Tensor, tiles: dict | None = None) -> torch.Tensor:
    """x [M, G, K], w [G, N, K] -> [M, G, N]: group g of every row through w[g], for M <= MAX_ROWS."""
    M, G, K = x.shape
    N = w.shape[1]
    out = torch.empty((M, G, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    if w.stride(-1) != 1:
        w = w.contiguous()
    t = _tiles(N, K, tiles)
    _gemv_kernel[(triton.cdiv(N, t["BLOCK_N"]), G)](
        x, w, out, M, N, K, x.stride(1), x.stride(0), w.stride(0), w.stride(1), out.stride(1), out.stride(0),
        BLOCK_M=16, BLOCK_N=t["BLOCK_N"], BLOCK_K=t["BLOCK_K"], PRECISION=dot_precision(x.dtype),
        num_warps=t["num_warps"], num_stages=t["num_stages"],
    )
    return out
