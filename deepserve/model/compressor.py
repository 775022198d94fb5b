"""KV compression (spec 3.6) and the lightning indexer (3.7).

A compressor pools every `ratio` tokens into one row: a per-channel softmax over the block's gates weights
the block's projected kv. CSA (ratio 4) overlaps blocks: each token projects two halves, "Ca" for the next
entry and "Cb" for its own, so entry w pools 8 slots (block w-1's Ca, block w's Cb). HCA (ratio 128) does not
overlap. Rows are RMS-normed and rotated at the position of their block's first token. The indexer is a
second, 128-wide CSA compressor whose rows are keys that each query scores to pick its top-k entries.
"""

from __future__ import annotations

import torch
from torch import nn

from deepserve.core.config import CSA, ModelConfig
from deepserve.core.interfaces import Backend, VisibleRows

from .batch import ForwardBatch, SeqChunk, paged_layout, paged_step_pools, to_device
from .common import NormWeight, linear
from .state import CompressorState, StreamSpec


class _Pooler(nn.Module):
    """Projection, frontier bookkeeping and softmax pooling shared by the main compressors and the indexer."""

    def __init__(self, cfg: ModelConfig, backend: Backend, ratio: int, dim: int, overlap: bool, inv_freq: torch.Tensor):
        super().__init__()
        width = 2 * dim if overlap else dim
        self.backend, self.ratio, self.dim, self.overlap, self.eps = backend, ratio, dim, overlap, cfg.rms_norm_eps
        self.kv_proj = linear(backend, cfg.hidden_size, width)
        self.gate_proj = linear(backend, cfg.hidden_size, width)
        self.position_bias = nn.Parameter(torch.zeros(ratio, width, dtype=torch.float32))
        self.kv_norm = NormWeight(dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def stream_spec(self) -> StreamSpec:
        return StreamSpec(self.ratio, self.dim, self.overlap)

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._biased(self.kv_proj(x), self.gate_proj(x), positions)

    def _biased(self, kv, gate, positions) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 projections, the gate with the position bias of each token's slot in its block."""
        return kv.float(), gate.float() + self.position_bias[positions % self.ratio]

    def emit(self, kv: torch.Tensor, gate: torch.Tensor, chunk: SeqChunk, state: CompressorState) -> None:
        """Add one chunk's projections to the frontier and append a row for every block it closes."""
        m, d = self.ratio, self.dim
        held = chunk.start % m
        if chunk.length == 1 and held + 1 < m and not chunk.snapshots and getattr(state, "journal", None) is None:
            # a decode token that closes no block: two row writes instead of this method's ~8 launches
            state.open_kv[held] = kv[0]
            state.open_gate[held] = gate[0]
            return
        kv = torch.cat((state.open_kv[:held], kv))
        gate = torch.cat((state.open_gate[:held], gate))
        state.record(chunk.start - held, kv, gate)  # speculative passes keep it for a rollback
        closed = kv.shape[0] // m
        rest = kv.shape[0] - closed * m
        state.open_kv[:rest] = kv[closed * m :]
        state.open_gate[:rest] = gate[closed * m :]
        if closed == 0:
            return
        kv = kv[: closed * m].view(closed, m, -1)
        gate = gate[: closed * m].view(closed, m, -1)
        first = state.rows.num_rows
        if self.overlap and state.snap_prev_kv is not None:
            for boundary, page in chunk.snapshots:  # the Ca half of the block that closes at the boundary
                block = boundary // m - 1 - first
                state.snap_prev_kv[page] = kv[block, :, :d]
                state.snap_prev_gate[page] = gate[block, :, :d]
        if self.overlap:
            slots_kv = kv.new_zeros((closed, 2 * m, d))
            slots_gate = gate.new_full((closed, 2 * m, d), float("-inf"))  # block 0 has no predecessor
            slots_kv[:, m:], slots_gate[:, m:] = kv[..., d:], gate[..., d:]
            slots_kv[1:, :m], slots_gate[1:, :m] = kv[:-1, :, :d], gate[:-1, :, :d]
            if first > 0:
                slots_kv[0, :m], slots_gate[0, :m] = state.prev_kv, state.prev_gate
            state.prev_kv.copy_(kv[-1, :, :d])
            state.prev_gate.copy_(gate[-1, :, :d])
            kv, gate = slots_kv, slots_gate
        state.rows.append(self._rows(kv, gate, first + torch.arange(closed, device=kv.device)))

    def _rows(self, kv: torch.Tensor, gate: torch.Tensor, first_row: torch.Tensor) -> torch.Tensor:
        """The rows of closed blocks (their slots' projections [B, slots, dim]): a per-channel softmax of the gates
        over the slots weights the kv; then RMSNorm, and RoPE at each block's first position (row * ratio)."""
        pooled = self.backend.softmax_pool(kv, gate)
        rows = self.backend.rms_norm(pooled, self.kv_norm.weight, self.eps)
        return self.backend.apply_rope(rows, first_row * self.ratio, self.inv_freq, inplace=True)

    def _snapshot_overlap(self, pools, block_kv, block_gate, snaps: list[tuple[int, int]]) -> None:
        """(rare) The prefix-hit overlap state at page boundaries, as `emit` saves it: the Ca halves of the closing
        blocks that `snaps` lists as (index in `block_kv`, page)."""
        if not (self.overlap and snaps):
            return
        k, page = to_device(snaps, torch.long, block_kv.device).unbind(1)
        pools.snap_kv.index_put_((page,), block_kv[k, :, : self.dim])
        pools.snap_gate.index_put_((page,), block_gate[k, :, : self.dim])

    def emit_all(self, kv, gate, batch: ForwardBatch, states: list[CompressorState], pools=None,
                 slots: list[int] | None = None) -> None:
        """`emit` for every chunk of the batch. With `pools` (this stream's `kv_cache._StreamPools`, when the
        step takes the paged decode path), the single-token chunks (page-boundary snapshots included) of
        sequences not journaling a speculative pass are done together (`slots`: each sequence's frontier row in
        the pools) in a fixed number of device ops: frontier writes in one scatter, the blocks they close
        pooled, normed, rotated and written to their pages at once. Per sequence only integer bookkeeping;
        the same arithmetic row by row as `emit`, so the same bits. Other chunks go through `emit`."""
        single: list[int] = []
        several: list[int] = []
        for i, (chunk, state) in enumerate(zip(batch.chunks, states)):
            if pools is None:
                self.emit(kv[chunk.offset : chunk.offset + chunk.length],
                          gate[chunk.offset : chunk.offset + chunk.length], chunk, state)
            elif chunk.length == 1 and state.journal is None:
                single.append(i)
            else:
                several.append(i)
        if single:
            self._emit_single_tokens(kv, gate, batch, states, pools, slots, single)
        if several:
            self._emit_chunks(kv, gate, batch, states, pools, slots, several)

    def _emit_single_tokens(self, kv, gate, batch: ForwardBatch, states, pools, slots, which: list[int]) -> None:
        m, device = self.ratio, kv.device
        opening, closing = [], []  # (batch row, slot, held) / (batch row, slot, first row, page, row in page)
        snapshots = []  # (index in `closing`, page): the Ca half of a block closing at a page boundary
        for i in which:
            chunk, state, slot = batch.chunks[i], states[i], slots[i]
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
        self._write_open(pools, opening, kv, gate)
        if not closing:
            return
        row, slot, first, page, in_page = to_device(closing, torch.long, device).unbind(1)
        block_kv = torch.cat((pools.open_kv[slot, : m - 1], kv[row][:, None]), dim=1)  # [B, m, width]
        block_gate = torch.cat((pools.open_gate[slot, : m - 1], gate[row][:, None]), dim=1)
        self._snapshot_overlap(pools, block_kv, block_gate, snapshots)
        self._close_blocks(pools, block_kv, block_gate, first, slot, slot, page, in_page)

    @staticmethod
    def _write_open(pools, entries: list[tuple[int, int, int]], kv, gate) -> None:
        """Rows of the new open blocks into the pool's frontier, one scatter each for kv and gate: `entries` lists
        (row of `kv`/`gate`, slot, position in the block)."""
        if entries:
            row, slot, held = to_device(entries, torch.long, kv.device).unbind(1)
            pools.open_kv.index_put_((slot, held), kv[row])
            pools.open_gate.index_put_((slot, held), gate[row])

    def _close_blocks(self, pools, block_kv, block_gate, first, slot, prev_slot, page, in_page) -> None:
        """Turn closing blocks ([B, ratio, frontier width], the `first`-th row of their sequences, in `slot`) into
        rows at `pools.rows[page, in_page]`: CSA pools block w-1's Ca half (the slot's overlap state; none for
        block 0) with block w's Cb half and leaves block w's Ca half in the overlap state of `prev_slot`."""
        d = self.dim
        if self.overlap:
            has_prev = (first > 0)[:, None, None]
            prev_kv = torch.where(has_prev, pools.prev_kv[slot], 0.0)
            prev_gate = torch.where(has_prev, pools.prev_gate[slot], float("-inf"))
            pools.prev_kv.index_put_((prev_slot,), block_kv[..., :d])
            pools.prev_gate.index_put_((prev_slot,), block_gate[..., :d])
            block_kv = torch.cat((prev_kv, block_kv[..., d:]), dim=1)
            block_gate = torch.cat((prev_gate, block_gate[..., d:]), dim=1)
        pools.rows.index_put_((page, in_page), self._rows(block_kv, block_gate, first).to(pools.rows.dtype))

    def emit_static(self, x, positions, layout, pools, pad_slot: int, trash_page: int) -> None:
        """`_emit_single_tokens` for a fixed-shape decode step (`StaticDecode`): one token per row, whether it
        closes its block read from its position on the device. A backend's fused kernel does it in one launch
        (`Backend.compress_decode`); else every row pools its block and a row whose block did not close writes
        its frontier, overlap half and row where no sequence reads them (the padding slot, the trash page), so
        the step's launches and shapes never depend on the rows. The same arithmetic row by row as
        `_emit_single_tokens`, so the same bits where a block closes."""
        m = self.ratio
        slot, tables = layout.slot[:, 0], layout.tables
        kv, gate = self.kv_proj(x), self.gate_proj(x)
        if self.backend.compress_decode(kv, gate, self.position_bias, positions, slot, tables, pools.open_kv,
                                        pools.open_gate, pools.prev_kv if self.overlap else None,
                                        pools.prev_gate if self.overlap else None, pools.rows, self.kv_norm.weight,
                                        self.inv_freq, self.eps):
            return
        kv, gate = self._biased(kv, gate, positions)
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
        self._close_blocks(pools, block_kv, block_gate, first, slot, torch.where(closing, slot, pad_slot), page,
                           first % rpp)

    def _emit_chunks(self, kv, gate, batch: ForwardBatch, states, pools, slots, which: list[int]) -> None:
        """`emit` for chunks of any length (prompt chunks, speculative verify with or without a journal), all
        together: every chunk's frontier (open block from the pool, then its new rows) is gathered into one flat
        tensor, whose slices become the journals' records (views), the new open blocks (one scatter) and the
        closed blocks (pooled with their predecessors' Ca halves, normed, rotated, scattered into the pages)."""
        m, d, device = self.ratio, self.dim, kv.device
        num_pool_rows = pools.open_kv.shape[0] * m
        src, opens, blocks, snaps, lasts = [], [], [], [], []  # host index lists, see below
        spans = []  # (first flat row, length) of each chunk's frontier
        for b, i in enumerate(which):
            chunk, state, slot = batch.chunks[i], states[i], slots[i]
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
                chunk = batch.chunks[i]
                states[i].record(chunk.start - chunk.start % m, f_kv[base : base + n], f_gate[base : base + n])
        self._write_open(pools, opens, f_kv, f_gate)
        if not blocks:
            return
        base, c, slot, has_prev, first_row, page, in_page = \
            to_device(blocks, torch.long, device).unbind(1)
        cols = base[:, None] + c[:, None] * m + torch.arange(m, device=device)[None, :]  # [NB, m] flat rows
        block_kv, block_gate = f_kv[cols], f_gate[cols]
        self._snapshot_overlap(pools, block_kv, block_gate, snaps)
        if self.overlap:  # block c pools block c-1's Ca half (the pool's for c = 0, none for a sequence's block 0)
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
        pools.rows.index_put_((page, in_page), self._rows(block_kv, block_gate, first_row).to(pools.rows.dtype))


class Indexer(_Pooler):
    """Lightning indexer: its own CSA-style key compressor plus query projection and per-head weights."""

    def __init__(self, cfg: ModelConfig, backend: Backend, inv_freq: torch.Tensor):
        ratio = cfg.compress_rate(CSA)
        super().__init__(cfg, backend, ratio, cfg.index_head_dim, overlap=True, inv_freq=inv_freq)
        self.n_heads, self.topk = cfg.index_n_heads, cfg.index_topk
        self.q_b_proj = linear(backend, cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim)
        self.scorer = nn.Module()
        self.scorer.weights_proj = linear(backend, cfg.hidden_size, cfg.index_n_heads)
        self.weight_scale = cfg.index_head_dim**-0.5 * cfg.index_n_heads**-0.5

    def select(self, x, qr, batch: ForwardBatch, states: list[CompressorState], layout=None) -> torch.Tensor:
        """Top-k compressed rows per query, as row numbers within the query's own sequence (-1 = none).
        With the step's `PagedLayout` (paged decode path) every sequence's keys come out of the page pool in one
        gather; else each sequence's rows are viewed and concatenated."""
        q = self.q_b_proj(qr).view(x.shape[0], self.n_heads, self.dim)
        q = self.backend.apply_rope(q, batch.positions, self.inv_freq, inplace=True)
        weights = self.scorer.weights_proj(x).float() * self.weight_scale
        counts = [state.rows.num_rows for state in states]
        starts = [0]
        for n in counts[:-1]:
            starts.append(starts[-1] + n)
        if layout is not None:
            keys = self._gather_keys(states[0].rows.pool, layout, counts, starts, x.device)
        else:
            keys = torch.cat([state.rows.view() for state in states])
        lengths = to_device([c.length for c in batch.chunks], torch.long, x.device)
        key_start = to_device(starts, torch.long, x.device)
        key_start = key_start.repeat_interleave(lengths, output_size=x.shape[0])
        key_count = (batch.positions + 1) // self.ratio
        chosen = self.backend.indexer_topk(q, weights, keys, key_start, key_count, self.topk)
        return torch.where(chosen >= 0, chosen - key_start[:, None], chosen)


    def scores_static(self, tables, pages) -> bool:
        """Whether `select_static` over these tables and pages scores the keys (and so reads its query)."""
        return tables.shape[1] * pages.shape[1] > self.topk

    def select_static(self, x, qr, positions, tables, pages) -> torch.Tensor | VisibleRows:
        """`select` for a fixed-shape decode step: the keys are read through the padded block tables (every
        query sees the table's full width, its own count masking the rest), so nothing depends on the row
        counts the host keeps. While the table holds at most top-k rows (a short context: the width is the
        bucket's), every visible row is chosen, and the rule says so (`VisibleRows`) with nothing computed."""
        if not self.scores_static(tables, pages):  # every row the table can hold is chosen: no query, no scores
            return VisibleRows(self.ratio, tables.shape[1] * pages.shape[1])
        q = self.q_b_proj(qr).view(x.shape[0], self.n_heads, self.dim)
        q = self.backend.apply_rope(q, positions, self.inv_freq, inplace=True)
        weights = self.scorer.weights_proj(x).float() * self.weight_scale
        key_count = (positions + 1) // self.ratio
        return self.backend.indexer_topk_paged(q, weights, pages, tables, key_count, self.topk)

    @staticmethod
    def _gather_keys(pool, layout, counts: list[int], starts: list[int], device) -> torch.Tensor:
        """Rows [0, counts[i]) of every sequence i, concatenated, gathered from the page pool [pages, rpp, dim]
        through the padded block tables: row r of sequence i is pool page tables[i, r // rpp], slot r % rpp."""
        rpp, total = pool.shape[1], sum(counts)
        per_seq = to_device([counts, starts], torch.long, device)
        seq = torch.arange(len(counts), device=device).repeat_interleave(per_seq[0], output_size=total)
        row = torch.arange(total, device=device) - per_seq[1][seq]
        page = layout.tables[seq, row // rpp]
        return pool.view(-1, pool.shape[-1])[page * rpp + row % rpp]


class Compressor(_Pooler):
    """Main-KV compressor of a CSA or HCA layer; a CSA compressor owns an indexer."""

    def __init__(self, cfg: ModelConfig, backend: Backend, layer_type: str, inv_freq: torch.Tensor):
        overlap = layer_type == CSA
        super().__init__(cfg, backend, cfg.compress_rate(layer_type), cfg.head_dim, overlap, inv_freq)
        self.indexer = Indexer(cfg, backend, inv_freq) if overlap else None

    def forward(self, x, qr, batch: ForwardBatch, states) -> torch.Tensor:
        """Emit this batch's rows into each sequence's state; return, per query, the compressed rows it
        attends to, numbered within its sequence, -1 padded: [T, K]."""
        layer_pools = paged_step_pools(batch, states)  # the batched path, or None
        slots = [st.slot for st in states] if layer_pools is not None else None
        kv, gate = self.project(x, batch.positions)
        self.emit_all(kv, gate, batch, [st.compressor for st in states],
                      layer_pools.compressor if layer_pools is not None else None, slots)
        if self.indexer is not None:
            ikv, igate = self.indexer.project(x, batch.positions)
            self.indexer.emit_all(ikv, igate, batch, [st.indexer for st in states],
                                  layer_pools.indexer if layer_pools is not None else None, slots)
            layout = paged_layout(batch, states) if layer_pools is not None else None
            return self.indexer.select(x, qr, batch, [st.indexer for st in states], layout)
        # HCA: every emitted row that the query may see (the widest from the host's chunk ends: no device sync)
        return visible_rows(batch.positions,
                            VisibleRows(self.ratio, max((c.end // self.ratio for c in batch.chunks), default=0)))

    def reads_query(self, batch: ForwardBatch, pools=None) -> bool:
        """Whether this step's `forward` (or, with the step's layer `pools`, `forward_static`) reads `qr`, the
        attention's normed query latent: only a CSA layer's indexer does, and in a static step only where it
        scores (else the attention need not keep `qr`)."""
        if self.indexer is None:
            return False
        if batch.static is None:
            return True
        return self.indexer.scores_static(batch.static.layout.tables, pools.indexer.rows)

    def forward_static(self, x, qr, batch: ForwardBatch, pools) -> torch.Tensor | VisibleRows:
        """`forward` for a fixed-shape decode step (`batch.static`) over the layer's pools: the same rows emitted
        and the same rows returned per query, with shapes set by the batch's bucket alone (HCA, and CSA while
        nothing is chosen: the rule `VisibleRows` for the table's full width of rows, -1 past each query's own)."""
        static = batch.static
        layout, positions = static.layout, batch.positions
        self.emit_static(x, positions, layout, pools.compressor, static.pad_slot, static.trash_page)
        if self.indexer is not None:
            self.indexer.emit_static(x, positions, layout, pools.indexer, static.pad_slot, static.trash_page)
            return self.indexer.select_static(x, qr, positions, layout.tables, pools.indexer.rows)
        return VisibleRows(self.ratio, layout.tables.shape[1] * pools.rows_per_page)


def visible_rows(positions: torch.Tensor, rule: VisibleRows) -> torch.Tensor:
    """The index list `rule` stands for, [T, width]: column j holds j where the query at that position may see
    compressed row j, else -1."""
    visible = (positions + 1) // rule.ratio
    offs = torch.arange(rule.width, device=positions.device)
    return torch.where(offs[None, :] < visible[:, None], offs[None, :], torch.full_like(offs, -1)[None, :])

