"""The static layout: a decode step whose shapes depend only on its bucket (rows, table width), not on the
sequences in it, so that a CUDA graph can replay it (`deepserve.model.cuda_graphs`).

One new token per row; the rows' slots, positions and padded block tables are device tensors (`StaticDecode.index`,
one query per row) over the cache's pools. Nothing reads host-side chunks or row counts (the host advances those
itself after the step), so a compressor cannot know on the host which rows close a block: every row pools its
block, and a row whose block did not close writes where no sequence reads (the padding slot, the trash page).
On the reference backend this layout gives the paged layout's bits (tests/test_cuda_graphs.py).

A *verify* step (`StaticDecode.width` > 1: a speculative step's base token and drafts, the same number for every
sequence) is the same with `width` consecutive rows a sequence: the window keys of its earlier rows come from the
scratch region (`paged_keys`), and every compressed block the rows close (up to (ratio - 1 + width) // ratio of
them) is pooled from a fixed-size frontier gathered per sequence (`emit_static_chunks`), whose rows the step keeps
(`StaticStep.frontiers`): the compressors' open blocks and overlap states are set from them after the step, for
the tokens each sequence keeps (`verify_graphs.VerifyGraphs`). With that, on the reference backend it gives the
paged layout's bits for verify chunks (tests/test_verify_graphs.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepserve.core.interfaces import VisibleRows

from ..batch import ForwardBatch
from .base import StepLayout, visible_rows
from .paged import PagedIndex, PoolLayer, attend_rows, close_blocks, paged_keys, store_block_rows, write_rings


@dataclass(frozen=True, slots=True)
class StaticDecode:
    """A fixed-shape decode step's device-side description: the cache's `layers` pools (`kv_cache._LayerPools`,
    one per main layer), the rows' `index`, and where unwanted writes go: padding rows use `pad_slot`, table
    entries past a sequence's pages and blocks that did not close go to `trash_page`."""

    layers: Sequence
    index: PagedIndex
    pad_slot: int
    trash_page: int
    width: int = 1  # rows a sequence: 1 for decode, 1 + drafts for a verify step


class StaticStep(StepLayout):
    """`frontiers` (a verify step): (layer, stream) -> the frontier rows each sequence's compressor gathered,
    kv and gate [sequences, ratio - 1 + width, F], from which the caller sets the open blocks and overlap states
    after the step."""

    every_row_logits = True  # every row is a logits row, in order: the forward gathers none

    def __init__(self, batch: ForwardBatch, static: StaticDecode, backend) -> None:
        self.batch, self.static, self.backend = batch, static, backend
        self.frontiers: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}

    def layer(self, index: int) -> StaticLayer:
        return StaticLayer(self, self.static.layers[index], index)


class StaticLayer(PoolLayer):
    def __init__(self, step: StaticStep, pools, number: int = 0) -> None:
        super().__init__(step.batch, step.backend)
        self.step, self.number = step, number
        self.static, self.pools, self.index = step.static, pools, step.static.index
        self._rings_written = False

    # -- compressed streams

    def emit(self, pooler, kv, gate, stream: str) -> None:
        static = self.static
        if static.width == 1:
            emit_static(pooler, kv, gate, self.positions, self.index, getattr(self.pools, stream), static.pad_slot,
                        static.trash_page)
            return
        self.step.frontiers[(self.number, stream)] = emit_static_chunks(
            pooler, kv, gate, self.positions, self.index, getattr(self.pools, stream), static.width, static.trash_page)

    def index_scored(self, indexer) -> bool:
        """While the tables hold at most top-k rows (a short context: the width is the bucket's), every visible
        row is chosen: no query, no scores."""
        return self.index.tables.shape[1] * self.pools.indexer.rows.shape[1] > indexer.topk

    def index_topk(self, indexer, q, weights) -> torch.Tensor:
        """The keys read through the padded block tables: every query sees the table's full width, its own
        count masking the rest, so nothing depends on the row counts the host keeps. Keys kept packed (FP4) go to
        the backend's `indexer_topk_packed` as stored (its default decodes the pages of each row's table)."""
        key_count = (self.positions + 1) // indexer.ratio
        pools, tables = self.pools.indexer, self.index.tables
        if not pools.codec.holds_values:
            return self.backend.indexer_topk_packed(q, weights, pools.rows, pools.codec, tables, key_count,
                                                    indexer.topk)
        return self.backend.indexer_topk_paged(q, weights, pools.rows, tables, key_count, indexer.topk)

    def all_visible(self, pooler, stream: str) -> VisibleRows:
        """The rule for the table's full width of rows (-1 past each query's own), which a backend's key-row kernel
        forms itself (`decode_key_rows`)."""
        return VisibleRows(pooler.ratio, self.index.tables.shape[1] * getattr(self.pools, stream).rows.shape[1])

    # -- window keys

    def keys(self, kv, compressed):
        """The storage where it holds the values; else the rows read, decoded one per index entry (fixed shapes)."""
        return self.pools.codec.gather(self.pools.storage, self._key_rows(kv, compressed), fixed_shape=True)

    def attend(self, q, kv, compressed, sinks, scale, inv_freq) -> torch.Tensor:
        """Over the storage rows `keys` names, packed ones read as stored (`paged.attend_rows`, fixed shapes)."""
        return attend_rows(self.backend, q, self.pools, self._key_rows(kv, compressed), sinks, scale, self.positions,
                           inv_freq, fixed_shape=True)

    def _key_rows(self, kv, compressed) -> torch.Tensor:
        """One token a row: the backend's `decode_key_rows` writes its key into its ring first and forms every
        window key from there (where the storage holds the values); else the paged layout's way (scratch region,
        rings written after)."""
        pools = self.pools
        one_token = self.static.width == 1 and pools.codec.holds_values
        rows = self.backend.decode_key_rows(pools.storage, kv, self.positions, self.index.slot[:, 0],
                                            self.index.query_tables, compressed, pools.spec.window,
                                            pools.rows_per_page, pools.comp_base) if one_token else None
        if rows is not None:
            self._rings_written = True
            return rows
        if isinstance(compressed, VisibleRows):
            compressed = visible_rows(self.positions, compressed)
        return paged_keys(self.backend, kv, self.positions, self.index, compressed, pools)

    def store_window(self, kv) -> None:
        """(A static step's page-boundary snapshots are taken after it, from the written rings: `cuda_graphs`.)"""
        if not self._rings_written:
            write_rings(self.backend, self.pools, kv, self.positions, self.index.slot[:, 0])


def emit_static(pooler, kv, gate, positions, index: PagedIndex, pools, pad_slot: int, trash_page: int) -> None:
    """One decode token per row into one compressed stream's pools, whether it closes its block read from its
    position on the device. A backend's fused kernel does it in one launch (`Backend.compress_decode`); else every
    row pools its block and a row whose block did not close writes its frontier, overlap half and row where no
    sequence reads them (`pad_slot`, `trash_page`), so the step's launches and shapes never depend on the rows.
    The same arithmetic row by row as the paged layout, so the same bits where a block closes."""
    m = pooler.ratio
    slot, tables = index.slot[:, 0], index.tables
    # the fused kernel writes rows at the model dtype (`auto`) or encodes them as the packed pools keep them (`fp8`);
    # a `bf16` cache (rows rounded, kept as values) takes the ops below
    precision = pooler.kv_precision
    packed = precision.fp8
    if (precision.kv_cache_dtype == "auto" or packed) and pooler.backend.compress_decode(
            kv, gate, pooler.position_bias, positions, slot, tables, pools.open_kv, pools.open_gate,
            pools.prev_kv if pooler.overlap else None, pools.prev_gate if pooler.overlap else None, pools.rows,
            pooler.kv_norm.weight, pooler.inv_freq, pooler.eps, codec=pools.codec if packed else None,
            turn=pooler.stored_turn() if packed else None):
        return
    kv, gate = pooler.biased(kv, gate, positions)
    held = positions % m
    closing = held == m - 1
    first = positions // m  # the row a closing block becomes
    open_slot = torch.where(closing, pad_slot, slot)
    pools.open_kv.index_put_((open_slot, held), kv)
    pools.open_gate.index_put_((open_slot, held), gate)
    rpp = pools.rows.shape[1]
    page = tables.gather(1, (first // rpp).clamp(max=tables.shape[1] - 1)[:, None])[:, 0]
    page = torch.where(closing, page, trash_page)
    block_kv = torch.cat((pools.open_kv[slot, : m - 1], kv[:, None]), dim=1)  # [B, m, width]
    block_gate = torch.cat((pools.open_gate[slot, : m - 1], gate[:, None]), dim=1)
    close_blocks(pooler, pools, block_kv, block_gate, first, slot, torch.where(closing, slot, pad_slot), page,
                 first % rpp)


def emit_static_chunks(pooler, kv, gate, positions, index: PagedIndex, pools, width: int,
                       trash_page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`width` consecutive tokens a sequence (rows s * width ..) into one compressed stream's pages, with shapes
    that depend only on the bucket: each sequence's frontier (its open block's `held` rows from the pool, then its
    new rows: `ratio - 1 + width` rows, those past `held + width` unused) is gathered into one tensor; of its
    possible blocks, those its rows close are pooled (CSA: with the Ca half of the block before, from the frontier
    or the pool's overlap state) and written to their pages, the others to the trash page. The same arithmetic as
    the paged layout's `_emit_chunks`, so the same rows. The open block and the overlap state are left as they
    were: which of the rows count is known only after the step, and the caller sets both from the returned
    frontier (kv, gate) for the tokens each sequence keeps (`VerifyGraphs._rollback`)."""
    m, d, device = pooler.ratio, pooler.dim, kv.device
    kv, gate = pooler.biased(kv, gate, positions)
    S, F = positions.shape[0] // width, kv.shape[1]
    start = positions.view(S, width)[:, 0]
    slot = index.slot[:, 0].view(S, width)[:, 0]
    tables = index.tables.view(S, width, -1)[:, 0]
    held = start % m
    j = torch.arange(m - 1 + width, device=device)
    from_pool = (j[None, :] < held[:, None])[..., None]
    pool_row = slot[:, None] * m + j.clamp(max=m - 1)[None, :]
    batch_row = torch.arange(S, device=device)[:, None] * width + (j[None, :] - held[:, None]).clamp(0, width - 1)
    f_kv = torch.where(from_pool, pools.open_kv.view(-1, F)[pool_row], kv[batch_row])  # [S, m - 1 + width, F]
    f_gate = torch.where(from_pool, pools.open_gate.view(-1, F)[pool_row], gate[batch_row])
    C = (m - 1 + width) // m  # the most blocks a sequence can close
    if C:
        closed = (held + width) // m
        c = torch.arange(C, device=device)
        cols = c[:, None] * m + torch.arange(m, device=device)[None, :]  # [C, m]
        block_kv, block_gate = f_kv[:, cols], f_gate[:, cols]  # [S, C, m, F]
        first = start // m  # rows the sequence had before the step
        row = first[:, None] + c[None, :]  # [S, C]
        rpp = pools.rows.shape[1]
        page = tables.gather(1, (row // rpp).clamp(max=tables.shape[1] - 1))
        page = torch.where(c[None, :] < closed[:, None], page, trash_page)
        if pooler.overlap:  # block c pools block c-1's Ca half (the pool's overlap state for c = 0, none at row 0)
            has_prev = (first > 0)[:, None, None]
            prev_kv = torch.where(has_prev, pools.prev_kv[slot], 0.0)[:, None]
            prev_gate = torch.where(has_prev, pools.prev_gate[slot], float("-inf"))[:, None]
            prev_kv = torch.cat((prev_kv, block_kv[:, : C - 1, :, :d]), dim=1)
            prev_gate = torch.cat((prev_gate, block_gate[:, : C - 1, :, :d]), dim=1)
            block_kv = torch.cat((prev_kv, block_kv[..., d:]), dim=2)
            block_gate = torch.cat((prev_gate, block_gate[..., d:]), dim=2)
        rows = pooler.rows(block_kv.flatten(0, 1), block_gate.flatten(0, 1), row.flatten(),
                           encoded=not pools.codec.holds_values)
        store_block_rows(pooler.backend, pools, rows, page.flatten(), (row % rpp).flatten())
    return f_kv, f_gate
