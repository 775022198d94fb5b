"""mHC mixing: the per-token Sinkhorn projection and stream collapse in one launch, and the expand-and-mix in
another (the reference spends ~80 small launches per site on the 4x4 Sinkhorn loop alone)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _hc_pre_kernel(
    mix_ptr, base_ptr, scale_ptr, streams_ptr, x_ptr, post_ptr, comb_ptr,
    D, iters, hc_eps, norm_eps,
    stride_mt, stride_st, stride_sn, stride_xt,
    N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    j = tl.arange(0, N)
    rows = tl.arange(0, N)[:, None]
    cols = tl.arange(0, N)[None, :]
    # the RMS norm of the flattened streams, a per-token scalar applied to the (unnormed) mix
    squares = tl.zeros((BLOCK_D,), tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        xs = tl.load(streams_ptr + t * stride_st + j[:, None] * stride_sn + d[None, :], mask=d[None, :] < D, other=0.0)
        xs = xs.to(tl.float32)
        squares += tl.sum(xs * xs, axis=0)
    r = tl.rsqrt(tl.sum(squares, axis=0) / (N * D) + norm_eps)
    s_pre = tl.load(scale_ptr)
    s_post = tl.load(scale_ptr + 1)
    s_comb = tl.load(scale_ptr + 2)
    mix = mix_ptr + t * stride_mt
    pre = tl.sigmoid(tl.load(mix + j) * r * s_pre + tl.load(base_ptr + j)) + hc_eps
    post = 2.0 * tl.sigmoid(tl.load(mix + N + j) * r * s_post + tl.load(base_ptr + N + j))
    logits = tl.load(mix + 2 * N + rows * N + cols) * r * s_comb + tl.load(base_ptr + 2 * N + rows * N + cols)
    e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    comb = e / tl.sum(e, axis=1)[:, None] + hc_eps
    comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
    for _ in range(iters - 1):  # Sinkhorn: rows, then columns
        comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
    tl.store(post_ptr + t * N + j, post)
    tl.store(comb_ptr + t * N * N + rows * N + cols, comb)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        xs = tl.load(streams_ptr + t * stride_st + j[:, None] * stride_sn + d[None, :], mask=d[None, :] < D, other=0.0)
        out = tl.sum(xs.to(tl.float32) * pre[:, None], axis=0)
        tl.store(x_ptr + t * stride_xt + d, out.to(x_ptr.dtype.element_ty), mask=d < D)


@triton.jit
def _hc_post_kernel(
    streams_ptr, y_ptr, post_ptr, comb_ptr, out_ptr,
    D,
    stride_st, stride_sn, stride_yt, stride_ot, stride_on,
    N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < D
    j = tl.arange(0, N)
    xs = tl.load(streams_ptr + t * stride_st + j[:, None] * stride_sn + d[None, :], mask=d_ok[None, :], other=0.0)
    y = tl.load(y_ptr + t * stride_yt + d, mask=d_ok, other=0.0).to(tl.float32)
    post = tl.load(post_ptr + t * N + j)
    comb = tl.load(comb_ptr + t * N * N + j[:, None] * N + j[None, :])  # [source j, destination k]
    mixed = tl.sum(comb[:, :, None] * xs.to(tl.float32)[:, None, :], axis=0)  # [k, d]
    out = post[:, None] * y[None, :] + mixed
    tl.store(out_ptr + t * stride_ot + j[:, None] * stride_on + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=d_ok[None, :])


def hc_pre(streams, fn, base, scale, iters, hc_eps, norm_eps, out=None):
    """streams [T, n, D], fn [(2 + n) * n, n * D] fp32 -> the op's (collapsed [T, D], post [T, n], comb [T, n, n]):
    the mix by cuBLAS in fp32 (a Triton fp32 mix was slower at every T measured: bench/gpu_notes.md), then one
    program per token divides it by the streams' RMS, projects and collapses."""
    T, n, D = streams.shape
    streams = streams.contiguous()
    x = torch.empty((T, D), dtype=streams.dtype, device=streams.device) if out is None else out
    post = torch.empty((T, n), dtype=torch.float32, device=streams.device)
    comb = torch.empty((T, n, n), dtype=torch.float32, device=streams.device)
    if T:
        mix = torch.mm(streams.flatten(1).float(), fn.float().t())  # the kernel divides by the streams' RMS
        _hc_pre_kernel[(T,)](
            mix, base.float().contiguous(), scale.float().contiguous(), streams, x, post, comb,
            D, int(iters), float(hc_eps), float(norm_eps),
            mix.stride(0), streams.stride(0), streams.stride(1), x.stride(0),
            N=n, BLOCK_D=1024, num_warps=4,
        )
    return x, post, comb


def hc_post(streams, block_out, post, comb, out=None):
    T, n, D = streams.shape
    streams, block_out = streams.contiguous(), block_out.contiguous()
    out = torch.empty_like(streams) if out is None else out
    if T:
        block_d = 512
        _hc_post_kernel[(T, triton.cdiv(D, block_d))](
            streams, block_out, post.float().contiguous(), comb.float().contiguous(), out, D,
            streams.stride(0), streams.stride(1), block_out.stride(0), out.stride(0), out.stride(1),
            N=n, BLOCK_D=block_d, num_warps=4,
        )
    return out
