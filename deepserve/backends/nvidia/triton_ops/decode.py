"""Two kernels for the decode step over the paged cache, each replacing a few dozen small torch launches.

`compress_decode`: one program per row (one decode token) of one compressed stream (CSA or HCA main KV, or the
indexer's keys). It adds the position bias to the token's gate; a token that does not close its block writes its
projections into the slot's open block and stops; a token that closes it pools the block (CSA: the previous
block's Ca halves, then this block's Cb halves, 2 x ratio slots; HCA: ratio slots) with a per-channel softmax over
the slots kept online, RMS-norms and rotates the row at its block's first position, writes it into its page, and
(CSA) keeps the block's Ca halves as the next overlap state. The model's torch ops do the same
(`layouts.static.emit_static`); this is one launch instead of ~40.

`paged_key_rows`: the storage rows every decode or verify query attends to (`layouts.paged.paged_keys`): its
window keys (older positions from its slot's ring, its chunk's new rows from the scratch region, -1 before
position 0), then its compressed rows through its block table. One launch instead of ~25.

`decode_key_rows`: the same for a step of one token per row (a fixed-shape decode step), after writing each
row's key into its window ring (so every window key is read from the ring, and nothing goes to the scratch
region or is written after the attention), with the compressed rows either given or formed from their rule.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from deepserve.core.interfaces import VisibleRows

from .packed_writes import store_fp4_tile, store_fp8_tile


@triton.jit
def _online_update(mx, den, acc, g, k):
    """Fold a tile of slots (gates g and values k, [slots, D]) into the running per-channel softmax."""
    new_mx = tl.maximum(mx, tl.max(g, axis=0))
    alpha = tl.where(new_mx == float("-inf"), 0.0, tl.exp(mx - new_mx))
    p = tl.where(g == float("-inf"), 0.0, tl.exp(g - new_mx[None, :]))
    return new_mx, den * alpha + tl.sum(p, axis=0), acc * alpha + tl.sum(p * k, axis=0)


@triton.jit
def _compress_decode_kernel(
    kv_ptr, gate_ptr, bias_ptr, pos_ptr, slot_ptr, table_ptr,
    open_kv_ptr, open_gate_ptr, prev_kv_ptr, prev_gate_ptr, rows_ptr, rows16_ptr, turn_ptr, norm_ptr, freq_ptr,
    eps, stride_kv, stride_gate, stride_pos, stride_slot, stride_table,
    M: tl.constexpr, D: tl.constexpr, OVERLAP: tl.constexpr, RPP: tl.constexpr, NOPE: tl.constexpr,
    BLOCK_S: tl.constexpr, STORE: tl.constexpr, WIDTH: tl.constexpr, NUM_SCALES: tl.constexpr, TILE: tl.constexpr,
):
    """STORE: 0 the row's values at the rows' dtype ([pages, RPP, D]); 1 packed as `FP8Rows` (WIDTH bytes a row,
    NUM_SCALES scale bytes, TILE dims a scale block's tile: 64, or D where it is shorter); 2 turned by the matrix
    at `turn_ptr` [D, D] and packed as `FP4Keys` (TILE pairs a tile: 16, or D / 2). `rows16_ptr`: the rows as
    int16 (FP8 RoPE dims)."""
    F: tl.constexpr = 2 * D if OVERLAP else D
    b = tl.program_id(0)
    pos = tl.load(pos_ptr + b * stride_pos)
    slot = tl.load(slot_ptr + b * stride_slot).to(tl.int64)
    held = pos % M
    first = pos // M
    c = tl.arange(0, D)
    frontier_kv = open_kv_ptr + slot * (M * F)
    frontier_gate = open_gate_ptr + slot * (M * F)
    if held != M - 1:  # the block stays open: keep the token's projections (gate with its position bias)
        for h in tl.static_range(F // D):
            k = tl.load(kv_ptr + b * stride_kv + h * D + c).to(tl.float32)
            g = tl.load(gate_ptr + b * stride_gate + h * D + c).to(tl.float32) + tl.load(bias_ptr + held * F + h * D + c)
            tl.store(frontier_kv + held * F + h * D + c, k)
            tl.store(frontier_gate + held * F + h * D + c, g)
        return
    mx = tl.full((D,), float("-inf"), tl.float32)
    den = tl.zeros((D,), tl.float32)
    acc = tl.zeros((D,), tl.float32)
    s = tl.arange(0, BLOCK_S)
    col = 0
    if OVERLAP:
        col = D  # this block contributes its Cb halves; the previous one its Ca halves
        if first > 0:
            for s0 in range(0, M, BLOCK_S):
                at = slot * (M * D) + (s0 + s)[:, None] * D + c[None, :]
                ok = (s0 + s)[:, None] < M
                mx, den, acc = _online_update(mx, den, acc, tl.load(prev_gate_ptr + at, mask=ok, other=float("-inf")),
                                              tl.load(prev_kv_ptr + at, mask=ok, other=0.0))
    for s0 in range(0, M - 1, BLOCK_S):  # the block's earlier tokens, from the open block
        at = (s0 + s)[:, None] * F + col + c[None, :]
        ok = (s0 + s)[:, None] < M - 1
        mx, den, acc = _online_update(mx, den, acc, tl.load(frontier_gate + at, mask=ok, other=float("-inf")),
                                      tl.load(frontier_kv + at, mask=ok, other=0.0))
    own_k = tl.load(kv_ptr + b * stride_kv + col + c).to(tl.float32)
    own_g = tl.load(gate_ptr + b * stride_gate + col + c).to(tl.float32) + tl.load(bias_ptr + (M - 1) * F + col + c)
    mx, den, acc = _online_update(mx, den, acc, own_g[None, :], own_k[None, :])
    pooled = acc / den
    if OVERLAP:  # the next block pools this one's Ca halves: the open block's rows, then this token's
        tl.debug_barrier()  # every read of the old overlap rows is done
        own_ca_k = tl.load(kv_ptr + b * stride_kv + c).to(tl.float32)
        own_ca_g = tl.load(gate_ptr + b * stride_gate + c).to(tl.float32) + tl.load(bias_ptr + (M - 1) * F + c)
        for s0 in range(0, M, BLOCK_S):
            r = (s0 + s)[:, None]
            from_open = r < M - 1
            k = tl.load(frontier_kv + r * F + c[None, :], mask=from_open, other=0.0)
            g = tl.load(frontier_gate + r * F + c[None, :], mask=from_open, other=0.0)
            k = tl.where(from_open, k, own_ca_k[None, :])
            g = tl.where(from_open, g, own_ca_g[None, :])
            at = slot * (M * D) + r * D + c[None, :]
            tl.store(prev_kv_ptr + at, k, mask=r < M)
            tl.store(prev_gate_ptr + at, g, mask=r < M)
    y = pooled * tl.rsqrt(tl.sum(pooled * pooled, axis=0) / D + eps) * tl.load(norm_ptr + c).to(tl.float32)
    even, odd = tl.split(tl.reshape(y, (D // 2, 2)))  # interleaved pairs; the last D - NOPE dims rotate
    i = tl.arange(0, D // 2) - NOPE // 2
    rotate = i >= 0
    angle = (first * M).to(tl.float32) * tl.load(freq_ptr + tl.where(rotate, i, 0), mask=rotate, other=0.0)
    cos, sin = libdevice.cos(angle), libdevice.sin(angle)
    even, odd = tl.where(rotate, even * cos - odd * sin, even), tl.where(rotate, odd * cos + even * sin, odd)
    out = tl.reshape(tl.join(even, odd), (D,))
    page = tl.load(table_ptr + b * stride_table + first // RPP).to(tl.int64)
    row = page * RPP + first % RPP
    if STORE == 0:
        tl.store(rows_ptr + row * D + c, out.to(rows_ptr.dtype.element_ty))
    elif STORE == 1:  # the fp32 row encoded as it is stored (the unfused path encodes the same fp32 row)
        store_fp8_tile(tl.reshape(out, (D // TILE, TILE)), tl.reshape(c, (D // TILE, TILE)), rows_ptr + row * WIDTH,
                       rows16_ptr + row * (WIDTH // 2), NOPE, D - NOPE, NUM_SCALES, WIDTH)
    else:  # an indexer key: turned by the Hadamard matrix (symmetric), then encoded
        turned = tl.sum(tl.load(turn_ptr + c[:, None] * D + c[None, :]) * out[None, :], axis=1)
        lo, hi = tl.split(tl.reshape(turned, (D // 2, 2)))
        pairs = tl.arange(0, D // 2)
        store_fp4_tile(tl.reshape(lo, (D // 2 // TILE, TILE)), tl.reshape(hi, (D // 2 // TILE, TILE)),
                       tl.reshape(pairs, (D // 2 // TILE, TILE)), rows_ptr + row * WIDTH, D, NUM_SCALES)


def compress_decode(kv, gate, position_bias, positions, slot, tables, open_kv, open_gate, prev_kv, prev_gate,
                    rows, norm_weight, inv_freq, eps, store: str = "values", turn=None) -> None:
    """The backend op `compress_decode` (see `Backend.compress_decode`): kv/gate [B, F] raw projections,
    position_bias [ratio, F] fp32, positions/slot [B] (any stride), tables [B, P], open_kv/open_gate
    [slots, ratio, F] fp32, prev_kv/prev_gate [slots, ratio, D] fp32 or None, rows [pages, rpp, D] (`store`
    "values"), or [pages, rpp, row bytes] uint8 packed as `FP8Rows` ("fp8") or, turned by `turn` [D, D] fp32 first,
    as `FP4Keys` ("fp4"), norm_weight [D], inv_freq [rope dims / 2]."""
    B, F = kv.shape
    ratio, D = open_kv.shape[1], norm_weight.shape[0]
    overlap = prev_kv is not None
    if B == 0:
        return
    for t in (open_kv, open_gate, position_bias, rows) + ((prev_kv, prev_gate) if overlap else ()):
        if not t.is_contiguous():
            raise ValueError("compress_decode needs contiguous frontier, bias and row tensors")
    freq = inv_freq.float().contiguous()
    nope = D - 2 * freq.shape[0]
    if store == "values":
        mode, tile, num_scales, rows16 = 0, 1, 0, rows
    elif store == "fp8":
        mode, tile, num_scales, rows16 = 1, min(64, D), -(-nope // 64), rows.view(torch.int16)
    elif store == "fp4":
        mode, tile, num_scales, rows16 = 2, min(16, D // 2), -(-D // 32), rows
    else:
        raise ValueError(f"compress_decode stores values, fp8 or fp4 rows, not {store!r}")
    turn = turn.float().contiguous() if turn is not None else freq
    _compress_decode_kernel[(B,)](
        kv, gate, position_bias, positions, slot, tables, open_kv, open_gate,
        prev_kv if overlap else open_kv, prev_gate if overlap else open_gate, rows, rows16, turn, norm_weight, freq,
        float(eps), kv.stride(0), gate.stride(0), positions.stride(0), slot.stride(0), tables.stride(0),
        M=ratio, D=D, OVERLAP=overlap, RPP=rows.shape[1], NOPE=nope,
        BLOCK_S=min(16, triton.next_power_of_2(ratio)), STORE=mode, WIDTH=rows.shape[-1], NUM_SCALES=num_scales,
        TILE=tile, num_warps=4,
    )


@triton.jit
def _paged_key_rows_kernel(
    pos_ptr, start_ptr, offset_ptr, slot_ptr, table_ptr, comp_ptr, out_ptr,
    comp_base, scratch_base, K,
    stride_pos, stride_start, stride_offset, stride_slot, stride_table, stride_comp, stride_out,
    W: tl.constexpr, RPP: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t * stride_pos)
    start = tl.load(start_ptr + t * stride_start)
    slot = tl.load(slot_ptr + t * stride_slot)
    new_base = scratch_base + tl.load(offset_ptr + t * stride_offset)
    j = tl.arange(0, BLOCK_W)
    key = pos - (W - 1) + j
    row = tl.where(key < start, slot * W + key % W, new_base + key - start)
    tl.store(out_ptr + t * stride_out + j, tl.where(key >= 0, row, -1), mask=j < W)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        r = tl.load(comp_ptr + t * stride_comp + k, mask=k < K, other=-1)
        seen = r >= 0
        page = tl.load(table_ptr + t * stride_table + tl.where(seen, r, 0) // RPP, mask=seen & (k < K), other=0)
        tl.store(out_ptr + t * stride_out + W + k, tl.where(seen, comp_base + page * RPP + r % RPP, -1), mask=k < K)


def paged_key_rows(positions, chunk_start, chunk_offset, slot, tables, compressed, window, rows_per_page, comp_base,
                   scratch_base):
    """The backend op `paged_key_rows` (see `Backend.paged_key_rows`)."""
    T = positions.shape[0]
    K = compressed.shape[1] if compressed is not None else 0
    out = torch.empty((T, window + K), dtype=torch.long, device=positions.device)
    if T == 0:
        return out
    comp = compressed if compressed is not None else out  # (unread when K = 0)
    _paged_key_rows_kernel[(T,)](
        positions, chunk_start, chunk_offset, slot, tables, comp, out, int(comp_base), int(scratch_base), K,
        positions.stride(0), chunk_start.stride(0), chunk_offset.stride(0), slot.stride(0), tables.stride(0),
        comp.stride(0), out.stride(0),
        W=window, RPP=max(int(rows_per_page), 1), BLOCK_W=triton.next_power_of_2(window), BLOCK_K=128, num_warps=4,
    )
    return out


@triton.jit
def _decode_key_rows_kernel(
    kv_ptr, storage_ptr, pos_ptr, slot_ptr, table_ptr, comp_ptr, out_ptr,
    comp_base, D, K,
    stride_kv, stride_s, stride_pos, stride_slot, stride_table, stride_comp, stride_out,
    W: tl.constexpr, RPP: tl.constexpr, RATIO: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Row t's key into its ring, then its key rows: W window rows from the ring, K compressed rows through
    its block table. RATIO > 0: the compressed rows are the rule `VisibleRows` (row k where k < (p + 1) //
    RATIO), else read from comp_ptr."""
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t * stride_pos)
    slot = tl.load(slot_ptr + t * stride_slot).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    own = slot * W + pos % W
    for d0 in range(0, D, BLOCK_D):
        v = tl.load(kv_ptr + t * stride_kv + d0 + d, mask=d0 + d < D)
        tl.store(storage_ptr + own * stride_s + d0 + d, v.to(storage_ptr.dtype.element_ty), mask=d0 + d < D)
    j = tl.arange(0, BLOCK_W)
    key = pos - (W - 1) + j
    tl.store(out_ptr + t * stride_out + j, tl.where(key >= 0, slot * W + key % W, -1), mask=j < W)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        if RATIO > 0:
            r = tl.where(k < (pos + 1) // RATIO, k, -1)
        else:
            r = tl.load(comp_ptr + t * stride_comp + k, mask=k < K, other=-1)
        seen = r >= 0
        page = tl.load(table_ptr + t * stride_table + tl.where(seen, r, 0) // RPP, mask=seen & (k < K), other=0)
        tl.store(out_ptr + t * stride_out + W + k, tl.where(seen, comp_base + page * RPP + r % RPP, -1), mask=k < K)


def decode_key_rows(storage, kv, positions, slot, tables, compressed, window, rows_per_page, comp_base):
    """The backend op `decode_key_rows` (see `Backend.decode_key_rows`): one program per row, where the unfused
    path spends a copy to the scratch region, `paged_key_rows`, the ring write after the attention and, for a
    `VisibleRows` list, four small launches to form it."""
    T, D = kv.shape
    if isinstance(compressed, VisibleRows):
        K, ratio, comp = compressed.width, compressed.ratio, None
    else:
        K, ratio, comp = (compressed.shape[1] if compressed is not None else 0), 0, compressed
    out = torch.empty((T, window + K), dtype=torch.long, device=kv.device)
    if T == 0:
        return out
    comp = comp if comp is not None else out  # (unread: a rule, or no compressed rows)
    _decode_key_rows_kernel[(T,)](
        kv, storage, positions, slot, tables, comp, out, int(comp_base), D, K,
        kv.stride(0), storage.stride(0), positions.stride(0), slot.stride(0), tables.stride(0), comp.stride(0),
        out.stride(0),
        W=window, RPP=max(int(rows_per_page), 1), RATIO=ratio, BLOCK_W=triton.next_power_of_2(window), BLOCK_K=128,
        BLOCK_D=min(1024, triton.next_power_of_2(D)), num_warps=4,
    )
    return out


@triton.jit
def _window_write_kernel(kv_ptr, storage_ptr, pos_ptr, slot_ptr, D, stride_kv, stride_s, stride_pos, stride_slot,
                         W: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    row = tl.load(slot_ptr + t * stride_slot).to(tl.int64) * W + tl.load(pos_ptr + t * stride_pos) % W
    d = tl.arange(0, BLOCK_D)
    for d0 in range(0, D, BLOCK_D):
        v = tl.load(kv_ptr + t * stride_kv + d0 + d, mask=d0 + d < D)
        tl.store(storage_ptr + row * stride_s + d0 + d, v.to(storage_ptr.dtype.element_ty), mask=d0 + d < D)


def paged_window_write(storage, kv, positions, slot, window):
    """The backend op `paged_window_write`: one program per row (where torch spent a multiply, a remainder, an
    add and a scatter: four launches a layer at decode)."""
    T, D = kv.shape
    if T:
        _window_write_kernel[(T,)](kv, storage, positions, slot, D, kv.stride(0), storage.stride(0),
                                   positions.stride(0), slot.stride(0), W=window,
                                   BLOCK_D=min(1024, triton.next_power_of_2(D)), num_warps=4)
