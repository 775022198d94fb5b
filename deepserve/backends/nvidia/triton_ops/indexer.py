"""Lightning-indexer scores: score[t, w] = sum_h weights[t, h] * relu(q[t, h] . keys[key_start[t] + w]).

One program scores one query against one block of its keys: the query's heads are the rows of one matrix
product with the key block, so the head sum is a reduction over that product's rows. Keys past the query's
count score -inf, so a top-k over the row never picks them. The keys are either one flat tensor (each query's
from its `key_start`) or pages read through each query's block table (`PAGED`: key r of query t is page
`table[t, r // RPP]`, row `r % RPP`), so a fixed-shape decode step gathers nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import dot_precision


@triton.jit
def _indexer_scores_kernel(
    q_ptr, w_ptr, keys_ptr, start_ptr, count_ptr, table_ptr, out_ptr,
    Hi, width,
    stride_qt, stride_qh, stride_wt, stride_kn, stride_tt, stride_ot,
    DI: tl.constexpr, BLOCK_HI: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    PAGED: tl.constexpr, RPP: tl.constexpr,
):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    count = tl.load(count_ptr + t).to(tl.int32)
    visible = cols < count
    if PAGED:
        page = tl.load(table_ptr + t * stride_tt + cols // RPP, mask=visible, other=0)
        rows = page.to(tl.int64) * RPP + cols % RPP
    else:
        rows = tl.load(start_ptr + t) + cols
    if tl.program_id(1) * BLOCK_N < count:
        heads = tl.arange(0, BLOCK_HI)
        dims = tl.arange(0, DI)
        head_ok = heads < Hi
        q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + dims[None, :], mask=head_ok[:, None], other=0.0)
        w = tl.load(w_ptr + t * stride_wt + heads, mask=head_ok, other=0.0).to(tl.float32)
        keys = tl.load(keys_ptr + rows[:, None] * stride_kn + dims[None, :], mask=visible[:, None], other=0.0)
        s = tl.dot(q, tl.trans(keys), input_precision=PRECISION)  # [heads, keys]
        score = tl.sum(tl.maximum(s, 0.0) * w[:, None], axis=0)
        tl.store(out_ptr + t * stride_ot + cols, tl.where(visible, score, float("-inf")), mask=cols < width)
    else:
        tl.store(out_ptr + t * stride_ot + cols, tl.full((BLOCK_N,), float("-inf"), tl.float32), mask=cols < width)


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, key_start: torch.Tensor | None,
                   key_count: torch.Tensor, width: int, out: torch.Tensor | None = None,
                   tables: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hi, Di], weights [T, Hi], key_count [T] -> fp32 scores [T, width]. Keys: flat [N, Di] from
    `key_start` [T], or with `tables` [T, P] pages [num_pages, rpp, Di] read through the tables."""
    T, Hi, Di = q.shape
    if Di & (Di - 1):
        raise ValueError(f"index_head_dim must be a power of two, got {Di}")
    paged = tables is not None
    rpp = keys.shape[1] if paged else 1
    keys = keys.reshape(-1, Di).contiguous()
    q = q.to(keys.dtype).contiguous()
    weights = weights.float().contiguous()
    key_count = key_count.contiguous()
    out = torch.empty((T, width), dtype=torch.float32, device=q.device) if out is None else out
    if T == 0 or width == 0:
        return out
    block_n = 64
    grid = (T, triton.cdiv(width, block_n))
    tables = tables.contiguous() if paged else key_count  # (unread when not paged)
    _indexer_scores_kernel[grid](
        q, weights, keys, key_count if paged else key_start.contiguous(), key_count, tables, out, Hi, width,
        q.stride(0), q.stride(1), weights.stride(0), keys.stride(0), tables.stride(0), out.stride(0),
        DI=Di, BLOCK_HI=max(16, triton.next_power_of_2(Hi)), BLOCK_N=block_n, PRECISION=dot_precision(keys.dtype),
        PAGED=paged, RPP=rpp, num_warps=4, num_stages=2,
    )
    return out


def indexer_topk(q, weights, keys, key_start, key_count, topk: int, lowest_on_ties: bool = False) -> torch.Tensor:
    """The backend op: top-k rows by score, ascending row order, -1 in unused slots. Ties among equal scores
    go to whichever row torch.topk returns first (not pinned to the lowest row, unlike the reference), or with
    `lowest_on_ties` to the lowest rows, as the reference pins them."""
    T = q.shape[0]
    out = torch.full((T, topk), -1, dtype=torch.long, device=q.device)
    width = int(key_count.max().item()) if T else 0  # the compressor syncs on the same count already
    if width == 0:
        return out
    offs = torch.arange(width, device=q.device)
    if width <= topk:  # every visible key is chosen: no scores needed
        chosen = torch.where(offs[None, :] < key_count[:, None], key_start[:, None] + offs[None, :], -1)
        out[:, :width] = chosen
        return out
    scores = indexer_scores(q, weights, keys, key_start, key_count, width)
    cols = _top_columns(scores, topk, width, lowest_on_ties)
    return torch.where(cols < width, key_start[:, None] + cols, -1)


def indexer_topk_paged(q, weights, pages, tables, key_count, topk: int, lowest_on_ties: bool = False) -> torch.Tensor:
    """The backend op `indexer_topk_paged`: `indexer_topk` with the keys read through block tables and every
    shape from the table's width (no host sync: a CUDA graph can hold it). Key numbers within each query's own
    keys, ascending, -1 in unused slots; `lowest_on_ties` as `indexer_topk`'s."""
    T, P = tables.shape
    width = P * pages.shape[1]
    offs = torch.arange(width, device=q.device)
    if width <= topk:  # every visible key is chosen: no scores needed
        out = torch.full((T, topk), -1, dtype=torch.long, device=q.device)
        out[:, :width] = torch.where(offs[None, :] < key_count[:, None], offs[None, :], -1)
        return out
    scores = indexer_scores(q, weights, pages, None, key_count, width, tables=tables)
    cols = _top_columns(scores, topk, width, lowest_on_ties)
    return torch.where(cols < width, cols, -1)


def _top_columns(scores: torch.Tensor, topk: int, width: int, lowest_on_ties: bool) -> torch.Tensor:
    """Each row's `topk` best columns, ascending, `width` where fewer than `topk` keys are visible (score -inf).
    `lowest_on_ties`: among equal scores the lowest columns win, as the reference pins it (a stable descending
    sort: a full sort of the row, for the batch-invariant mode); else whichever `torch.topk` returns first."""
    if lowest_on_ties:
        values, cols = torch.sort(scores, dim=1, descending=True, stable=True)
        values, cols = values[:, :topk], cols[:, :topk]
    else:
        values, cols = torch.topk(scores, topk, dim=1, sorted=False)
    return torch.where(values > float("-inf"), cols, width).sort(dim=1).values
