"""The paged layout: every state of the step in one `kv_cache.PagedKVCache`, whose pools the layers index in place.

A layer's pools (`kv_cache._LayerPools`) are one storage tensor holding every slot's window ring, every page's
compressed rows and a scratch region for the step's new keys, so a query's keys are global row numbers into it
and nothing is copied. Per sequence only integer bookkeeping runs on the host; the device work is a fixed number
of launches whatever the batch (decode, speculative verify and prompt chunks alike), with the same arithmetic
row by row as the contiguous layout, so the same bits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..batch import ForwardBatch, to_device
from ..state import AttentionState
from .base import LayerLayout, StepLayout, chunk_visible, topk_in_sequences, window_indices


def paged_step_pools(batch: ForwardBatch, states: Sequence[AttentionState]):
    """The layer pools (`kv_cache._LayerPools`) shared by every state of the batch when the step can take the
    paged layout: all states paged in the same cache and the step's new rows fitting its scratch region (any
    chunk lengths: decode, speculative verify, prompt chunks). Else None. Host-side checks only."""
    if not states:
        return None
    pools = states[0].pools
    if pools is None or any(st.pools is not pools for st in states):
        return None
    if batch.num_tokens > pools.scratch_rows:
        return None
    return pools


@dataclass(frozen=True, slots=True)
class PagedIndex:
    """Where a step's sequences live in the paged cache, as device tensors shared by every layer of a forward:
    per query (row of the batch) its sequence's slot, first new position and first row in the batch, [T, 1];
    per sequence its block table padded with page 0, [B, max pages] (`tables`), per query that row
    (`query_tables`, [T, max pages]) and its number (`query_seq`, [T]; None: row t, one query per sequence). The
    layers turn them into global row numbers of their pools."""

    slot: torch.Tensor
    chunk_start: torch.Tensor
    chunk_offset: torch.Tensor
    tables: torch.Tensor
    query_tables: torch.Tensor
    query_seq: torch.Tensor | None = None


def block_table(st: AttentionState) -> list[int]:
    """The block table of a paged layer state (its compressed streams read it); window-only layers have none."""
    for comp in (st.compressor, st.indexer):
        if comp is not None:
            return comp.rows.table
    return _NO_TABLE


_NO_TABLE: list[int] = []  # window-only layers: one shared empty table, so their index is memoised too


class PagedStep(StepLayout):
    def __init__(self, batch: ForwardBatch, layer_states: Sequence[Sequence[AttentionState]], backend) -> None:
        self.batch, self.layer_states, self.backend = batch, layer_states, backend
        self.memo: dict = {}  # what every layer derives from the batch alone, built by the first that needs it

    def layer(self, index: int) -> PagedLayer:
        states = [states[index] for states in self.layer_states]
        pools = paged_step_pools(self.batch, states)
        if pools is None:
            raise ValueError(f"layer {index}: the step's states are not all paged in one cache")
        return PagedLayer(self, states, pools)

    def index(self, states: Sequence[AttentionState]) -> PagedIndex:
        """The `PagedIndex` of these states (one layer's), built once per forward and sequence set: later layers
        (the same slots and block tables) get the memoised one. Two asynchronous host-to-device copies."""
        tables = [block_table(st) for st in states]
        key = ("paged", tuple(st.slot for st in states), tuple(id(t) for t in tables), tuple(map(len, tables)))
        index = self.memo.get(key)
        if index is None:
            batch = self.batch
            device, T = batch.positions.device, batch.num_tokens
            width = max(map(len, tables), default=0) or 1
            per_seq = to_device([[st.slot, c.start, c.offset, c.length] for st, c in zip(states, batch.chunks)],
                                torch.long, device)
            padded = to_device([t + [0] * (width - len(t)) for t in tables], torch.long, device)
            seq = torch.arange(len(states), device=device).repeat_interleave(per_seq[:, 3], output_size=T)
            per_query = per_seq[seq]
            index = PagedIndex(per_query[:, 0:1], per_query[:, 1:2], per_query[:, 2:3], padded, padded[seq], seq)
            self.memo[key] = index
        return index

    def ring_rows_kept(self, window: int, device) -> torch.Tensor | None:
        """The batch rows whose keys the window rings keep: each chunk's last W (one write per ring slot), or None
        when every chunk is at most W long. Built once per forward (every layer has the same window)."""
        key = ("ring rows kept", window)
        if key not in self.memo:
            W = window
            self.memo[key] = None if all(c.length <= W for c in self.batch.chunks) else to_device(
                [c.offset + j for c in self.batch.chunks for j in range(max(0, c.length - W), c.length)],
                torch.long, device)
        return self.memo[key]


class PoolLayer(LayerLayout):
    """A layer whose KV lives in page pools (`self.pools`, the paged and the static layouts), values or packed."""

    pools: object

    def rounds_on_store(self) -> bool:
        """Packed pools: the row goes to the attention and the rings only through `store_rows` (encoded)."""
        return not self.pools.codec.holds_values


class PagedLayer(PoolLayer):
    def __init__(self, step: PagedStep, states: list[AttentionState], pools) -> None:
        super().__init__(step.batch, step.backend)
        self.step, self.states, self.pools = step, states, pools
        self.window = pools.spec.window
        self._index: PagedIndex | None = None

    @property
    def index(self) -> PagedIndex:
        if self._index is None:
            self._index = self.step.index(self.states)
        return self._index

    # -- compressed streams

    def emit(self, pooler, kv, gate, stream: str) -> None:
        """The single-token chunks (page-boundary snapshots included) of sequences not journaling a speculative
        pass together, frontier writes in one scatter, the blocks they close pooled, normed, rotated and written
        to their pages at once; the other chunks (prompt chunks, verify passes) together in `_emit_chunks`."""
        kv, gate = pooler.biased(kv, gate, self.positions)
        states = [getattr(st, stream) for st in self.states]
        pools = getattr(self.pools, stream)
        single: list[int] = []
        several: list[int] = []
        for i, (chunk, state) in enumerate(zip(self.batch.chunks, states)):
            (single if chunk.length == 1 and state.journal is None else several).append(i)
        if single:
            self._emit_single_tokens(pooler, kv, gate, states, pools, single)
        if several:
            self._emit_chunks(pooler, kv, gate, states, pools, several)

    def _emit_single_tokens(self, pooler, kv, gate, states, pools, which: list[int]) -> None:
        m, device = pooler.ratio, kv.device
        opening, closing = [], []  # (batch row, slot, held) / (batch row, slot, first row, page, row in page)
        snapshots = []  # (index in `closing`, page): the Ca half of a block closing at a page boundary
        for i in which:
            chunk, state, slot = self.batch.chunks[i], states[i], self.states[i].slot
            held = chunk.start % m
            if held + 1 < m:
                opening.append((chunk.offset, slot, held))
                continue
            rows, first = state.rows, state.rows.num_rows
            if first >= len(rows.table) * rows.per_page:
                raise RuntimeError(f"block table holds {len(rows.table)} pages, too few for {first + 1} rows")
            snapshots += [(len(closing), page) for _, page in chunk.snapshots]
            closing.append((chunk.offset, slot, first, rows.table[first // rows.per_page], first % rows.per_page))
            rows.num_rows = first + 1
        write_open(pools, opening, kv, gate)
        if not closing:
            return
        row, slot, first, page, in_page = to_device(closing, torch.long, device).unbind(1)
        block_kv = torch.cat((pools.open_kv[slot, : m - 1], kv[row][:, None]), dim=1)  # [B, m, width]
        block_gate = torch.cat((pools.open_gate[slot, : m - 1], gate[row][:, None]), dim=1)
        snapshot_overlap(pooler, pools, block_kv, block_gate, snapshots)
        close_blocks(pooler, pools, block_kv, block_gate, first, slot, slot, page, in_page)

    def _emit_chunks(self, pooler, kv, gate, states, pools, which: list[int]) -> None:
        """Chunks of any length (prompt chunks, speculative verify with or without a journal), all together:
        every chunk's frontier (open block from the pool, then its new rows) is gathered into one flat tensor,
        whose slices become the journals' records (views), the new open blocks (one scatter) and the closed
        blocks (pooled with their predecessors' Ca halves, normed, rotated, scattered into the pages)."""
        m, d, device = pooler.ratio, pooler.dim, kv.device
        num_pool_rows = pools.open_kv.shape[0] * m
        src, opens, blocks, snaps, lasts = [], [], [], [], []  # host index lists, see below
        spans = []  # (first flat row, length) of each chunk's frontier
        for i in which:
            chunk, state, slot = self.batch.chunks[i], states[i], self.states[i].slot
            held = chunk.start % m
            n = held + chunk.length
            base = len(src)
            spans.append((base, n))
            # source rows of the frontier: pool rows slot*m + j of the open block, then batch rows (after the pool)
            src += [slot * m + j for j in range(held)]
            src += range(num_pool_rows + chunk.offset, num_pool_rows + chunk.offset + chunk.length)
            closed, rows = n // m, state.rows
            first = rows.num_rows
            opens += [(base + closed * m + r, slot, r) for r in range(n - closed * m)]
            if first + closed > len(rows.table) * rows.per_page:
                raise RuntimeError(f"block table holds {len(rows.table)} pages, too few for {first + closed} rows")
            for boundary, page in chunk.snapshots:
                snaps.append((len(blocks) + boundary // m - 1 - first, page))
            if closed:  # the chunk's last closed block leaves its Ca half as the overlap state
                lasts.append((len(blocks) + closed - 1, slot))
            for c in range(closed):
                r = first + c
                blocks.append((base, c, slot, int(first > 0), r, rows.table[r // rows.per_page], r % rows.per_page))
            rows.num_rows = first + closed
        src = to_device(src, torch.long, device)
        from_pool = (src < num_pool_rows)[:, None]
        pool_row, batch_row = src.clamp(max=num_pool_rows - 1), (src - num_pool_rows).clamp(min=0)
        f_kv = torch.where(from_pool, pools.open_kv.view(-1, kv.shape[1])[pool_row], kv[batch_row])  # [rows, F]
        f_gate = torch.where(from_pool, pools.open_gate.view(-1, gate.shape[1])[pool_row], gate[batch_row])
        for (base, n), i in zip(spans, which):  # speculative passes keep their frontier for a rollback (views)
            if states[i].journal is not None:
                chunk = self.batch.chunks[i]
                states[i].record(chunk.start - chunk.start % m, f_kv[base : base + n], f_gate[base : base + n])
        write_open(pools, opens, f_kv, f_gate)
        if not blocks:
            return
        base, c, slot, has_prev, first_row, page, in_page = to_device(blocks, torch.long, device).unbind(1)
        cols = base[:, None] + c[:, None] * m + torch.arange(m, device=device)[None, :]  # [NB, m] flat rows
        block_kv, block_gate = f_kv[cols], f_gate[cols]
        snapshot_overlap(pooler, pools, block_kv, block_gate, snaps)
        if pooler.overlap:  # block c pools block c-1's Ca half (the pool's for c = 0, none for a sequence's block 0)
            earlier = (cols - m).clamp(min=0)
            in_chunk = (c > 0)[:, None, None]
            pool_prev = (has_prev > 0)[:, None, None]
            prev_kv = torch.where(in_chunk, f_kv[earlier][..., :d], torch.where(pool_prev, pools.prev_kv[slot], 0.0))
            prev_gate = torch.where(in_chunk, f_gate[earlier][..., :d],
                                    torch.where(pool_prev, pools.prev_gate[slot], float("-inf")))
            k, last_slot = to_device(lasts, torch.long, device).unbind(1)
            pools.prev_kv.index_put_((last_slot,), block_kv[k, :, :d])
            pools.prev_gate.index_put_((last_slot,), block_gate[k, :, :d])
            block_kv = torch.cat((prev_kv, block_kv[..., d:]), dim=1)
            block_gate = torch.cat((prev_gate, block_gate[..., d:]), dim=1)
        rows = pooler.rows(block_kv, block_gate, first_row, encoded=not pools.codec.holds_values)
        store_block_rows(self.backend, pools, rows, page, in_page)

    def index_topk(self, indexer, q, weights) -> torch.Tensor:
        """Every sequence's keys out of the page pool in one gather through the padded block tables; keys kept
        packed (FP4) go to the backend's `indexer_topk_packed` as stored, read through the tables."""
        pools = self.pools.indexer
        if not pools.codec.holds_values:
            key_count = (self.positions + 1) // indexer.ratio
            return self.backend.indexer_topk_packed(q, weights, pools.rows, pools.codec, self.index.tables, key_count,
                                                    indexer.topk, query_rows=self.index.query_seq)
        counts = [st.indexer.rows.num_rows for st in self.states]
        keys = gather_rows(pools.rows, self.index.tables, counts, q.device)
        return topk_in_sequences(indexer, self.batch, q, weights, keys, counts)

    def all_visible(self, pooler, stream: str) -> torch.Tensor:
        return chunk_visible(self.batch, pooler.ratio)

    # -- window keys

    def keys(self, kv, compressed):
        """A query's window keys are ring rows `slot * W + position % W` (positions before its chunk) or its
        chunk's new rows (copied to the scratch region), its compressed row r is `comp_base + table[r // rpp] *
        rpp + r % rpp`: the same keys in the same order as the contiguous layout. The storage itself where it
        holds the values, else the rows read, decoded (`RowCodec.gather`)."""
        rows = paged_keys(self.backend, kv, self.positions, self.index, compressed, self.pools)
        return self.pools.codec.gather(self.pools.storage, rows)

    def attend(self, q, kv, compressed, sinks, scale, inv_freq) -> torch.Tensor:
        """Over the storage rows `keys` names, packed ones read as stored (`attend_rows`)."""
        rows = paged_keys(self.backend, kv, self.positions, self.index, compressed, self.pools)
        return attend_rows(self.backend, q, self.pools, rows, sinks, scale, self.positions, inv_freq)

    def store_window(self, kv) -> None:
        self._snapshot_windows()  # (rare) before the ring write overwrites rows
        positions, slot = self.positions, self.index.slot[:, 0]
        keep = self.step.ring_rows_kept(self.window, kv.device)
        if keep is not None:
            positions, slot, kv = positions[keep], slot[keep], kv[keep]
        write_rings(self.backend, self.pools, kv, positions, slot)

    def _snapshot_windows(self) -> None:
        """Window tails [boundary - W, boundary) at the page boundaries the chunks cross, from the storage (ring
        rows before the chunk, the chunk's new rows in the scratch region): one gather per snapshot."""
        W, pools = self.window, self.pools
        storage = pools.storage
        for chunk, st in zip(self.batch.chunks, self.states):
            for boundary, page in chunk.snapshots:
                rows = [st.slot * W + p % W if p < chunk.start else pools.scratch_base + chunk.offset + p - chunk.start
                        for p in range(boundary - W, boundary)]
                st.snap_window[page] = storage[to_device(rows, torch.long, storage.device)]


# -- shared with the static layout


def paged_keys(backend, kv, positions, index: PagedIndex, compressed, pools) -> torch.Tensor:
    """The step's keys into the scratch region, then each query's storage rows [T, W + K] (-1 = none): the
    backend's one-launch `paged_key_rows`, or the same index arithmetic in torch."""
    W, T = pools.spec.window, kv.shape[0]
    storage = pools.storage
    store_rows(backend, storage, pools.codec, kv, base=pools.scratch_base)
    rows = backend.paged_key_rows(positions, index.chunk_start, index.chunk_offset, index.slot, index.query_tables,
                                  compressed, W, pools.rows_per_page, pools.comp_base, pools.scratch_base)
    if rows is None:
        parts = [window_indices(positions, W, index.chunk_start, index.slot * W,
                                pools.scratch_base + index.chunk_offset)]
        if compressed is not None:
            rpp, row = pools.rows_per_page, compressed.clamp(min=0)
            page = torch.gather(index.query_tables, 1, row // rpp)
            parts.append(torch.where(compressed >= 0, pools.comp_base + page * rpp + row % rpp, compressed))
        rows = torch.cat(parts, dim=1)
    return rows


def attend_rows(backend, q, pools, rows, sinks, scale, positions, inv_freq, fixed_shape: bool = False):
    """The attention of q over the storage rows `rows` [T, W + K] (-1 = none), its output's rotary dims turned
    back: over the storage in place where its codec holds the values (`sparse_attention_rope`), else over the rows
    as stored (`sparse_attention_packed`: a backend's kernel reads them packed; the default decodes the rows
    read, one per entry in a fixed-shape step)."""
    if pools.codec.holds_values:
        return backend.sparse_attention_rope(q, pools.storage, rows, sinks, scale, positions, inv_freq)
    return backend.sparse_attention_packed(q, pools.storage, pools.codec, rows, sinks, scale, positions, inv_freq,
                                           fixed_shape=fixed_shape)


def store_rows(backend, storage, codec, rows, dest=None, base: int = 0) -> None:
    """rows [n, width] into storage [N, stored width] at rows `dest` [n] (base .. base + n without dest) in the
    pool's stored form: the backend's one-launch kernel where it has one for the codec
    (`Backend.store_packed_rows`), else `codec.encode` and a scatter."""
    if not codec.holds_values and backend.store_packed_rows(storage, codec, rows, dest, base):
        return
    if dest is None:
        storage[base : base + rows.shape[0]] = codec.encode(rows)
    else:
        storage.index_put_((dest,), codec.encode(rows))


def store_block_rows(backend, pools, rows, page, in_page) -> None:
    """Compressed rows [n, width] into their pages: row i at `pools.rows[page[i], in_page[i]]`."""
    store_rows(backend, pools.rows.flatten(0, 1), pools.codec, rows, page * pools.rows.shape[1] + in_page)


def write_rings(backend, pools, kv, positions, slot) -> None:
    """Row t of kv into its sequence's window ring (rows naming distinct ring slots): all rings in one scatter;
    the backend's kernel where the storage holds the values, else encoded by torch ops."""
    W = pools.spec.window
    if pools.codec.holds_values and backend.paged_window_write(pools.storage, kv, positions, slot, W):
        return
    store_rows(backend, pools.storage, pools.codec, kv, slot * W + positions % W)


def gather_rows(pool, tables, counts: list[int], device) -> torch.Tensor:
    """Rows [0, counts[i]) of every sequence i, concatenated, gathered from the page pool [pages, rpp, dim]
    through the padded block tables: row r of sequence i is pool page tables[i, r // rpp], slot r % rpp."""
    rpp, total = pool.shape[1], sum(counts)
    starts = [0]
    for n in counts[:-1]:
        starts.append(starts[-1] + n)
    per_seq = to_device([counts, starts], torch.long, device)
    seq = torch.arange(len(counts), device=device).repeat_interleave(per_seq[0], output_size=total)
    row = torch.arange(total, device=device) - per_seq[1][seq]
    page = tables[seq, row // rpp]
    return pool.view(-1, pool.shape[-1])[page * rpp + row % rpp]


def write_open(pools, entries: list[tuple[int, int, int]], kv, gate) -> None:
    """Rows of the new open blocks into the pool's frontier, one scatter each for kv and gate: `entries` lists
    (row of `kv`/`gate`, slot, position in the block)."""
    if entries:
        row, slot, held = to_device(entries, torch.long, kv.device).unbind(1)
        pools.open_kv.index_put_((slot, held), kv[row])
        pools.open_gate.index_put_((slot, held), gate[row])


def snapshot_overlap(pooler, pools, block_kv, block_gate, snaps: list[tuple[int, int]]) -> None:
    """(rare) The prefix-hit overlap state at page boundaries, as `contiguous.emit_chunk` saves it: the Ca halves
    of the closing blocks that `snaps` lists as (index in `block_kv`, page)."""
    if not (pooler.overlap and snaps):
        return
    k, page = to_device(snaps, torch.long, block_kv.device).unbind(1)
    pools.snap_kv.index_put_((page,), block_kv[k, :, : pooler.dim])
    pools.snap_gate.index_put_((page,), block_gate[k, :, : pooler.dim])


def close_blocks(pooler, pools, block_kv, block_gate, first, slot, prev_slot, page, in_page) -> None:
    """Turn closing blocks ([B, ratio, frontier width], the `first`-th row of their sequences, in `slot`) into
    rows at `pools.rows[page, in_page]`: CSA pools block w-1's Ca half (the slot's overlap state; none for
    block 0) with block w's Cb half and leaves block w's Ca half in the overlap state of `prev_slot`."""
    d = pooler.dim
    if pooler.overlap:
        has_prev = (first > 0)[:, None, None]
        prev_kv = torch.where(has_prev, pools.prev_kv[slot], 0.0)
        prev_gate = torch.where(has_prev, pools.prev_gate[slot], float("-inf"))
        pools.prev_kv.index_put_((prev_slot,), block_kv[..., :d])
        pools.prev_gate.index_put_((prev_slot,), block_gate[..., :d])
        block_kv = torch.cat((prev_kv, block_kv[..., d:]), dim=1)
        block_gate = torch.cat((prev_gate, block_gate[..., d:]), dim=1)
    rows = pooler.rows(block_kv, block_gate, first, encoded=not pools.codec.holds_values)
    store_block_rows(pooler.backend, pools, rows, page, in_page)
