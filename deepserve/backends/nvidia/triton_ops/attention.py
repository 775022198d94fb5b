"""Sparse MQA over an index list (V4 attention): one K=V head shared by all query heads, per-head sink.

One program owns one query and a block of heads. It walks the query's index list in blocks of keys, gathers
those rows of the pool straight from memory (no [T, K, d] gather in between), and keeps an online softmax whose
running maximum and denominator start at the head's sink logit, so the sink joins the denominator without a
separate pass and the maximum is finite from the first block on.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import dot_precision

LOG2E = 1.4426950408889634


@triton.jit
def _sparse_mqa_kernel(
    q_ptr, kv_ptr, idx_ptr, sink_ptr, out_ptr,
    K, H, scale_log2,
    stride_qt, stride_qh, stride_kvn, stride_it, stride_ot, stride_oh,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    t = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, D)
    head_ok = heads < H
    q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + dims[None, :], mask=head_ok[:, None], other=0.0)
    # logits are kept in log2 units: exp2 is the fast path
    m = tl.load(sink_ptr + heads, mask=head_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    denom = tl.full((BLOCK_H,), 1.0, tl.float32)
    acc = tl.zeros((BLOCK_H, D), tl.float32)
    for start in range(0, K, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        rows = tl.load(idx_ptr + t * stride_it + cols, mask=cols < K, other=-1)
        ok = rows >= 0
        keys = tl.load(kv_ptr + tl.where(ok, rows, 0)[:, None] * stride_kvn + dims[None, :], mask=ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(keys), input_precision=PRECISION) * scale_log2
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(keys.dtype), keys, input_precision=PRECISION)
        m = m_new
    out = acc / denom[:, None]
    tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=head_ok[:, None])


def sparse_mqa(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sinks: torch.Tensor, scale: float,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, d], kv [N, d] (same dtype), indices [T, K] (entries < 0 ignored), sinks [H] -> [T, H, d]."""
    T, H, d = q.shape
    if d & (d - 1):
        raise ValueError(f"head_dim must be a power of two, got {d}")
    q, kv = q.contiguous(), kv.contiguous()
    indices = indices.contiguous()
    out = torch.empty_like(q) if out is None else out
    if T == 0:
        return out
    K = indices.shape[1]
    block_h = max(16, min(32 if d >= 256 else 64, triton.next_power_of_2(H)))
    block_n = 32 if d >= 256 else 64
    grid = (T, triton.cdiv(H, block_h))
    _sparse_mqa_kernel[grid](
        q, kv, indices, sinks.float().contiguous(), out, K, H, scale * LOG2E,
        q.stride(0), q.stride(1), kv.stride(0), indices.stride(0), out.stride(0), out.stride(1),
        D=d, BLOCK_H=block_h, BLOCK_N=block_n, PRECISION=dot_precision(q.dtype), num_warps=8 if d >= 256 else 4, num_stages=2,
    )
    return out
