"""Kernels that read the FP8 KV cache's packed rows in place (`--kv-cache-dtype fp8`, deepserve/model/kv_precision.py).

A KV row (`FP8Rows`) is bytes: the e4m3 codes of the non-RoPE dims [0, nope), the RoPE dims as bf16, then one
UE8M0 scale byte (exponent + 127) per 64 non-RoPE dims. An indexer key (`FP4Keys`) is its e2m1 codes two a byte,
low nibble first, then one scale byte per 32 values. Each kernel turns the rows it loads into values in registers
(a code times a power of two: exactly the values `RowCodec.decode` gives) and then does what its plain twin does
on decoded rows:

* `sparse_mqa_packed`: `attention.sparse_mqa` (the online softmax with the sink, the index list split over
  programs for small steps, the parts merged by its `_merge_kernel`) over a packed storage, so a step gathers
  and decodes no keys into a temporary.
* `indexer_topk_packed`: `indexer.indexer_topk_paged` over packed key pages read through block tables (each
  query's table row given), so the fixed-shape decode step decodes no pages.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention import LOG2E, _merge_kernel, finish_part, launch_buffers, online_block, start_part, tile_choice
from .common import dot_precision, ue8m0, ue8m0_bf16
from .fp4_moe import _e2m1, _fp4_tile
from .indexer import _top_columns

FP8_BLOCK = 64  # non-RoPE dims per scale byte of a KV row
FP4_BLOCK = 32  # indexer-key values per scale byte


@triton.jit
def _fp8_rows(codes_ptr, bytes_ptr, rope_ptr, rows, ok, stride, dims, NOPE: tl.constexpr, SCALES_AT: tl.constexpr):
    """Rows `rows` [N] (where `ok`) of an `FP8Rows` storage as fp32 values [N, D]: codes times their block's
    scale for dims below NOPE, the bf16 RoPE dims after. The three pointers view the same bytes (e4m3, uint8,
    bf16); `stride` is a row's bytes."""
    base = tl.where(ok, rows, 0).to(tl.int64)[:, None] * stride
    nope = (dims < NOPE)[None, :]
    codes = tl.load(codes_ptr + base + dims[None, :], mask=ok[:, None] & nope, other=0.0).to(tl.float32)
    scale = ue8m0(tl.load(bytes_ptr + base + SCALES_AT + dims[None, :] // 64, mask=ok[:, None] & nope, other=0))
    # RoPE dim j is the bf16 at byte NOPE + 2 (j - NOPE), element NOPE / 2 + j - NOPE of the row's bf16 view
    rope = tl.load(rope_ptr + base // 2 + (dims[None, :] - NOPE // 2), mask=ok[:, None] & ~nope, other=0.0)
    return tl.where(nope, codes * scale, rope.to(tl.float32))


@triton.jit
def _fp8_rows_in_blocks(codes_ptr, bytes_ptr, rope_ptr, rows, ok, stride, NOPE: tl.constexpr,
                        SCALES_AT: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, DTYPE: tl.constexpr):
    """`_fp8_rows` for V4's rows (NOPE in whole 64-dim scale blocks, then 64 RoPE dims), as DTYPE: a row is D / 64
    blocks of 64 dims, each FP8 block's codes times its one scale byte (loaded once a block, not once a dim), the
    last block the bf16 RoPE dims; [BLOCK_N, D / 64, 64] tiles, contiguous in each block."""
    B: tl.constexpr = D // 64
    base = tl.where(ok, rows, 0).to(tl.int64)[:, None, None] * stride
    block = tl.arange(0, B)[None, :, None]
    j = tl.arange(0, 64)[None, None, :]
    fp8 = block < NOPE // 64
    row_ok = ok[:, None, None]
    codes = tl.load(codes_ptr + base + block * 64 + j, mask=row_ok & fp8, other=0.0)
    bits = tl.load(bytes_ptr + base + SCALES_AT + block, mask=row_ok & fp8, other=0)
    rope = tl.load(rope_ptr + base // 2 + NOPE // 2 + j, mask=row_ok, other=0.0)
    if DTYPE == tl.bfloat16:  # codes and a power of two: the product is exact in bf16, as in fp32 then rounded
        values = codes.to(tl.bfloat16) * ue8m0_bf16(bits)
    else:
        values = (codes.to(tl.float32) * ue8m0(bits)).to(DTYPE)
    return tl.reshape(tl.where(fp8, values, rope.to(DTYPE)), (BLOCK_N, D))


@triton.jit
def _sparse_mqa_packed_kernel(
    q_ptr, codes_ptr, bytes_ptr, rope_ptr, idx_ptr, sink_ptr, out_ptr, part_ptr, stat_ptr, pos_ptr, freq_ptr,
    K, H, scale_log2, per_split, half,
    stride_qt, stride_qh, stride_row, stride_it, stride_ot, stride_oh, stride_pos,
    D: tl.constexpr, NOPE: tl.constexpr, SCALES_AT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, SPLITS: tl.constexpr, ROPE: tl.constexpr, BLOCKS: tl.constexpr,
):
    """`attention._sparse_mqa_kernel` with each block of keys read from packed rows (`_fp8_rows`; BLOCKS: V4's
    layout, `_fp8_rows_in_blocks`)."""
    t, split, heads, head_ok, dims, q, m, denom, acc, lo, hi = start_part(q_ptr, sink_ptr, H, K, per_split, stride_qt,
                                                                           stride_qh, D, BLOCK_H)
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        rows = tl.load(idx_ptr + t * stride_it + cols, mask=cols < hi, other=-1)
        ok = rows >= 0
        if BLOCKS:
            keys = _fp8_rows_in_blocks(codes_ptr, bytes_ptr, rope_ptr, rows, ok, stride_row, NOPE, SCALES_AT, D,
                                       BLOCK_N, q.dtype)
        else:
            keys = _fp8_rows(codes_ptr, bytes_ptr, rope_ptr, rows, ok, stride_row, dims, NOPE, SCALES_AT).to(q.dtype)
        m, denom, acc = online_block(q, keys, ok, m, denom, acc, scale_log2, PRECISION)
    finish_part(acc, m, denom, out_ptr, part_ptr, stat_ptr, pos_ptr, freq_ptr, t, split, heads, head_ok, dims, H,
                half, stride_ot, stride_oh, stride_pos, D, SPLITS, ROPE)


def packed_tiles(tiles: dict, d: int, blocks: bool = False) -> dict:
    """`tile_choice`'s tiles made to fit a Hopper multiprocessor's 227 KB of shared memory when the keys are decoded
    from packed rows: a block of 64 keys of 512 dims decoded to fp32 ([64, 512] x 4 bytes) beside the pipelined loads
    asked 246-263 KB on the H100 (OutOfResources at launch), so wide heads take 32 keys a block in one stage. Rows
    decoded a 64-dim block at a time (`blocks`: V4's layout, straight to 16-bit queries' dtype) keep 64 keys in one
    stage: 131-164 KB at 512 dims (16 to 64 heads a program, `tests/test_kernels_compile.py`), and by
    bench/investigations/sass_mix.py's bound 3.1 TB/s of rows against 2.4 at 32 keys. A function of the model's
    widths alone, so the batch-invariant mode's fixed tiles stay fixed."""
    if d >= 256:
        tiles = {**tiles, "block_n": min(tiles["block_n"], 64 if blocks else 32), "num_stages": 1}
    return tiles


def sparse_mqa_packed(q: torch.Tensor, storage: torch.Tensor, nope: int, indices: torch.Tensor, sinks: torch.Tensor,
                      scale: float, out: torch.Tensor | None = None, rope: tuple | None = None,
                      tiles: dict | None = None) -> torch.Tensor:
    """`attention.sparse_mqa` over FP8 rows kept packed: q [T, H, d], storage [N, stored bytes] uint8 (`FP8Rows`
    of width d with `nope` non-RoPE dims), indices [T, K] rows of it (entries < 0 ignored), sinks [H] -> [T, H, d]
    in q's dtype. `rope` (positions [T], inv_freq [half]): the output's last 2 * half dims turned back by each
    query's position. `tiles` overrides the tile choice as `sparse_mqa`'s does (the batch-invariant mode's fixed
    tiles; tests' splits)."""
    T, H, d = q.shape
    if d & (d - 1):
        raise ValueError(f"head_dim must be a power of two, got {d}")
    if nope % 2 or storage.dtype != torch.uint8 or storage.shape[-1] % 2:
        raise ValueError("packed FP8 rows need an even number of non-RoPE dims and of bytes a row")
    q, storage, indices = q.contiguous(), storage.contiguous(), indices.contiguous()
    out = torch.empty_like(q) if out is None else out
    if T == 0:
        return out
    K = indices.shape[1]
    blocks = nope % FP8_BLOCK == 0 and d - nope == FP8_BLOCK and storage.shape[-1] % 2 == 0
    tiles = packed_tiles(tile_choice(T, H, d, K, q.element_size(), tiles), d, blocks and q.element_size() == 2)
    block_h, block_n, splits = tiles["block_h"], tiles["block_n"], tiles["splits"]
    per_split = triton.cdiv(triton.cdiv(K, splits), block_n) * block_n
    positions, freq, half, part, stat = launch_buffers(q, indices, sinks, out, rope, splits)
    width = storage.shape[-1]
    _sparse_mqa_packed_kernel[(T, triton.cdiv(H, block_h), splits)](
        q, storage.view(torch.float8_e4m3fn), storage, storage.view(torch.bfloat16), indices,
        sinks.float().contiguous(), out, part, stat, positions, freq, K, H, scale * LOG2E, per_split, half,
        q.stride(0), q.stride(1), width, indices.stride(0), out.stride(0), out.stride(1), positions.stride(0),
        D=d, NOPE=nope, SCALES_AT=nope + 2 * (d - nope), BLOCK_H=block_h, BLOCK_N=block_n,
        PRECISION=dot_precision(q.dtype), SPLITS=splits, ROPE=rope is not None,
        BLOCKS=blocks, num_warps=tiles["num_warps"],
        num_stages=tiles["num_stages"],
    )
    if splits > 1:
        _merge_kernel[(T, H)](part, stat, out, positions, freq, H, half, out.stride(0), out.stride(1),
                              positions.stride(0), D=d, SPLITS=splits, BLOCK_D=min(d, 256), ROPE=rope is not None,
                              num_warps=4)
    return out


@triton.jit
def _packed_index_scores_kernel(
    q_ptr, w_ptr, keys_ptr, keys_words_ptr, count_ptr, table_ptr, qrow_ptr, out_ptr,
    Hi, width,
    stride_qt, stride_qh, stride_wt, stride_key, stride_tt, stride_ot,
    DI: tl.constexpr, BLOCK_HI: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, RPP: tl.constexpr,
    QROWS: tl.constexpr, WORDS: tl.constexpr,
):
    """`indexer._indexer_scores_kernel` (PAGED) with each block of keys read as FP4 bytes: key r of query t is
    row r % RPP of page `table[qrow, r // RPP]`, qrow its table row (`qrow_ptr[t]` with QROWS, else t). WORDS:
    the pages also as int32 words (`keys_words_ptr`; a key's bytes a whole number of words)."""
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    count = tl.load(count_ptr + t).to(tl.int32)
    visible = cols < count
    if QROWS:
        qrow = tl.load(qrow_ptr + t)
    else:
        qrow = t
    if tl.program_id(1) * BLOCK_N < count:
        page = tl.load(table_ptr + qrow * stride_tt + cols // RPP, mask=visible, other=0)
        base = (page.to(tl.int64) * RPP + cols % RPP)[:, None] * stride_key
        heads = tl.arange(0, BLOCK_HI)
        dims = tl.arange(0, DI)
        head_ok = heads < Hi
        q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + dims[None, :], mask=head_ok[:, None],
                    other=0.0)
        w = tl.load(w_ptr + t * stride_wt + heads, mask=head_ok, other=0.0).to(tl.float32)
        if WORDS:  # a key's codes as words of eight, decoded as the FP4 experts' weights are (`_fp4_tile`)
            rows = page.to(tl.int64) * RPP + cols % RPP
            keys = _fp4_tile(keys_words_ptr, keys_ptr + DI // 2, rows, 0, visible, DI, stride_key // 4, stride_key,
                             BLOCK_N, DI, q.dtype)
        else:  # a code at a time (keys whose rows are not whole words: DI below 128)
            packed = tl.load(keys_ptr + base + dims[None, :] // 2, mask=visible[:, None], other=0)
            code = tl.where((dims % 2 == 0)[None, :], packed & 15, packed >> 4)
            scale = ue8m0(tl.load(keys_ptr + base + DI // 2 + dims[None, :] // 32, mask=visible[:, None], other=0))
            keys = (_e2m1(code) * scale).to(q.dtype)
        s = tl.dot(q, tl.trans(keys), input_precision=PRECISION)  # [heads, keys]
        score = tl.sum(tl.maximum(s, 0.0) * w[:, None], axis=0)
        tl.store(out_ptr + t * stride_ot + cols, tl.where(visible, score, float("-inf")), mask=cols < width)
    else:
        tl.store(out_ptr + t * stride_ot + cols, tl.full((BLOCK_N,), float("-inf"), tl.float32), mask=cols < width)


def packed_index_scores(q: torch.Tensor, weights: torch.Tensor, pages: torch.Tensor, tables: torch.Tensor,
                        key_count: torch.Tensor, dtype: torch.dtype, query_rows: torch.Tensor | None = None,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hi, Di], weights [T, Hi], key_count [T], pages [num_pages, rpp, Di / 2 + Di / 32] uint8 (`FP4Keys`),
    tables [B, P] int64, query_rows [T] (query t's row of `tables`; None: row t) -> fp32 scores [T, P * rpp]. The
    keys are decoded to `dtype` (the model's) and q rounded to it, as the plain kernel multiplies decoded keys."""
    T, Hi, Di = q.shape
    if Di & (Di - 1) or Di < 2:
        raise ValueError(f"index_head_dim must be a power of two, got {Di}")
    rpp, width = pages.shape[1], tables.shape[1] * pages.shape[1]
    if pages.dtype != torch.uint8 or pages.shape[-1] != Di // 2 + -(-Di // FP4_BLOCK):
        raise ValueError(f"pages of {pages.shape[-1]} {pages.dtype} bytes a key are not FP4 keys of width {Di}")
    pages, tables = pages.contiguous(), tables.contiguous()
    q = q.to(dtype).contiguous()
    weights, key_count = weights.float().contiguous(), key_count.contiguous()
    out = torch.empty((T, width), dtype=torch.float32, device=q.device) if out is None else out
    if T == 0 or width == 0:
        return out
    block_n = 64
    qrows = query_rows.contiguous() if query_rows is not None else key_count  # (unread without QROWS)
    words = Di >= FP4_BLOCK and pages.shape[-1] % 4 == 0  # (V4's 128-wide keys: 68 bytes, 17 words)
    _packed_index_scores_kernel[(T, triton.cdiv(width, block_n))](
        q, weights, pages, pages.view(torch.int32) if words else pages, key_count, tables, qrows, out, Hi, width,
        q.stride(0), q.stride(1), weights.stride(0), pages.shape[-1], tables.stride(0), out.stride(0),
        DI=Di, BLOCK_HI=max(16, triton.next_power_of_2(Hi)), BLOCK_N=block_n, PRECISION=dot_precision(dtype),
        RPP=rpp, QROWS=query_rows is not None, WORDS=words, num_warps=4, num_stages=2,
    )
    return out


def indexer_topk_packed(q, weights, pages, tables, key_count, topk: int, dtype: torch.dtype,
                        query_rows: torch.Tensor | None = None, lowest_on_ties: bool = False) -> torch.Tensor:
    """The backend op `indexer_topk_packed` for FP4 keys: `indexer.indexer_topk_paged`'s selection over
    `packed_index_scores`. Key numbers within each query's own keys, ascending, -1 in unused slots; every shape
    from the tables' width (no host sync). `lowest_on_ties`: among equal scores the lowest keys win (the
    batch-invariant mode), else whichever `torch.topk` returns first."""
    T = q.shape[0]
    width = tables.shape[1] * pages.shape[1]
    offs = torch.arange(width, device=q.device)
    if width <= topk:  # every visible key is chosen: no scores needed
        out = torch.full((T, topk), -1, dtype=torch.long, device=q.device)
        out[:, :width] = torch.where(offs[None, :] < key_count[:, None], offs[None, :], -1)
        return out
    scores = packed_index_scores(q, weights, pages, tables, key_count, dtype, query_rows)
    cols = _top_columns(scores, topk, width, lowest_on_ties)
    return torch.where(cols < width, cols, -1)
