"""A batch-invariant GEMM (`NvidiaBackend(invariant=True)`, the batch-invariant mode): one tile shape for every
row count, and no split of the reduction.

cuBLAS picks its kernel, tile and split-K by the problem's shape, and the backend's `gemv` splits K over programs
for a few rows, so the bits of a row's product depend on how many rows shared its call: on the batch. Here every
output element is accumulated over K in BLOCK_K steps, in order, in fp32, by the same tile shape whatever M is (a
row's tile position changes which program computes it, not how), so a row's output depends on that row and the
weight alone. The price is the tile: a decode step of one row computes a 64-row tile of which one row is kept
(decode reads the weight once either way; it is bound by that).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import dot_precision

#: the one tile shape (rows, columns, reduction step) and launch shape, whatever the batch
BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES = 64, 64, 64, 4, 3


@triton.jit
def _matmul_kernel(x_ptr, w_ptr, out_ptr, M, N, K,
                   stride_xm, stride_xg, stride_wg, stride_wn, stride_om, stride_og,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """out[m, g, n] = sum_k x[m, g, k] * w[g, n, k], K walked in BLOCK_K steps from 0 (group g: program axis 2)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.program_id(2).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < M, cols < N
    x_rows = x_ptr + g * stride_xg + rows.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + g * stride_wg + cols.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + ks < K
        a = tl.load(x_rows + (k0 + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_cols + (k0 + ks)[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc += tl.dot(a, b, input_precision=PRECISION)
    out = out_ptr + g * stride_og + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def matmul(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., K] times weight [N, K] transposed -> [..., N] in `out_dtype` (default x's), or grouped: x [T, G, K]
    and weight [G, N, K] -> [T, G, N] (each group its own weight). Operands of one dtype."""
    if x.dtype != weight.dtype:
        raise ValueError(f"matmul needs operands of one dtype, got {x.dtype} and {weight.dtype}")
    out_dtype = out_dtype or x.dtype
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    K = x.shape[-1]
    grouped = weight.dim() == 3
    if grouped:
        G, N = weight.shape[0], weight.shape[1]
        if x.dim() != 3 or x.shape[1] != G:
            raise ValueError(f"grouped matmul: x {tuple(x.shape)} does not match weight {tuple(weight.shape)}")
        x3 = x if x.stride(-1) == 1 else x.contiguous()
        out = torch.empty((x.shape[0], G, N), dtype=out_dtype, device=x.device)
        M = x.shape[0]
        strides = (x3.stride(0), x3.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1))
    else:
        G, N = 1, weight.shape[0]
        x3 = x.reshape(-1, K)
        x3 = x3 if x3.stride(-1) == 1 else x3.contiguous()
        M = x3.shape[0]
        out = torch.empty((M, N), dtype=out_dtype, device=x.device)
        strides = (x3.stride(0), 0, 0, weight.stride(0), out.stride(0), 0)
    if M and N:
        _matmul_kernel[(triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N), G)](
            x3, weight, out, M, N, K, *strides, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
            PRECISION=dot_precision(x.dtype), num_warps=NUM_WARPS, num_stages=NUM_STAGES,
        )
    return out if grouped else out.view(*x.shape[:-1], N)
