"""The contiguous layout: each sequence's own window ring and row stores (`state.contiguous_state`), or paged
states on a step the batched path cannot take. Per-sequence host loops; the general case every other layout
must equal."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..batch import ForwardBatch, SeqChunk, to_device
from ..state import AttentionState, CompressorState
from .base import LayerLayout, StepLayout, chunk_visible, topk_in_sequences, window_indices


class ContiguousStep(StepLayout):
    def __init__(self, batch: ForwardBatch, layer_states: Sequence[Sequence[AttentionState]], backend) -> None:
        self.batch, self.layer_states, self.backend = batch, layer_states, backend

    def layer(self, index: int) -> ContiguousLayer:
        return ContiguousLayer(self.batch, self.backend, [states[index] for states in self.layer_states])


class ContiguousLayer(LayerLayout):
    def __init__(self, batch: ForwardBatch, backend, states: list[AttentionState]) -> None:
        super().__init__(batch, backend)
        self.states = states
        self.window = states[0].window.ring.shape[0] if states else 0
        self._windows: list[tuple[int, torch.Tensor | None]] = []  # per sequence: (first position, rows) gathered

    # -- compressed streams

    def emit(self, pooler, kv, gate, stream: str) -> None:
        kv, gate = pooler.biased(kv, gate, self.positions)
        for chunk, st in zip(self.batch.chunks, self.states):
            rows = slice(chunk.offset, chunk.offset + chunk.length)
            emit_chunk(pooler, kv[rows], gate[rows], chunk, getattr(st, stream))

    def index_topk(self, indexer, q, weights) -> torch.Tensor:
        streams = [st.indexer for st in self.states]
        keys = torch.cat([s.rows.view() for s in streams])
        return topk_in_sequences(indexer, self.batch, q, weights, keys, [s.rows.num_rows for s in streams])

    def all_visible(self, pooler, stream: str) -> torch.Tensor:
        return chunk_visible(self.batch, pooler.ratio)

    # -- window keys

    def keys(self, kv, compressed):
        """Each sequence's window rows and compressed rows, concatenated, indexed per query."""
        if all(c.length <= self.window and not c.snapshots for c in self.batch.chunks):
            return self._whole_ring_keys(kv, compressed)
        W, device = self.window, kv.device
        pieces, index_parts, base = [], [], 0
        width_c = compressed.shape[1] if compressed is not None else 0
        for chunk, st in zip(self.batch.chunks, self.states):
            first = max(0, chunk.start - W + 1)
            new = kv[chunk.offset : chunk.offset + chunk.length]
            window_rows = torch.cat((st.window.read(first, chunk.start), new)) if first < chunk.start else new
            pieces.append(window_rows)
            self._windows.append((first, window_rows))
            t = torch.arange(chunk.start, chunk.end, device=device)
            key_pos = t[:, None] - W + 1 + torch.arange(W, device=device)[None, :]  # window of each query
            win_idx = torch.where(key_pos >= 0, base + key_pos - first, torch.full_like(key_pos, -1))
            base += window_rows.shape[0]
            if compressed is not None:
                rows = st.compressor.rows
                pieces.append(rows.view())
                local = compressed[chunk.offset : chunk.offset + chunk.length]
                win_idx = torch.cat((win_idx, torch.where(local >= 0, base + local, local)), dim=1)
                base += rows.num_rows
            index_parts.append(win_idx)
        indices = torch.cat(index_parts) if index_parts else kv.new_zeros((0, W + width_c), dtype=torch.long)
        return torch.cat(pieces), indices

    def _whole_ring_keys(self, kv, compressed):
        """`keys` for a step of at most `window` new tokens per sequence (decode: 1; speculative verify: 1 + k),
        in a constant number of launches: each whole ring goes into the pool as it is and the indices name its
        slots (the same keys in the same order as the general case, so the same results), the new rows go last.
        Per-sequence gathers were most of a decode step's launches."""
        device, chunks = kv.device, self.batch.chunks
        lengths = to_device([c.length for c in chunks], torch.long, device)

        def per_query(values):  # one value per chunk -> one per query, [T, 1]
            return to_device(values, torch.long, device).repeat_interleave(lengths, output_size=kv.shape[0])[:, None]

        pieces, ring_base, comp_base, base = [], [], [], 0
        for st in self.states:
            pieces.append(st.window.values())
            ring_base.append(base)
            base += st.window.ring.shape[0]
            if compressed is not None:
                rows = st.compressor.rows
                pieces.append(rows.view())
                comp_base.append(base)
                base += rows.num_rows
        pieces.append(kv)
        parts = [window_indices(self.positions, self.window, per_query([c.start for c in chunks]),
                                per_query(ring_base), base + per_query([c.offset for c in chunks]))]
        if compressed is not None:
            parts.append(torch.where(compressed >= 0, per_query(comp_base) + compressed, compressed))
        self._windows = [(c.start, None) for c in chunks]
        return torch.cat(pieces), torch.cat(parts, dim=1)

    def store_window(self, kv) -> None:
        for chunk, st, (first, rows) in zip(self.batch.chunks, self.states, self._windows):
            for boundary, page in chunk.snapshots:  # window tail [boundary - W, boundary) for prefix hits
                st.snap_window[page] = st.window.encode(rows[boundary - self.window - first : boundary - first])
            st.window.write(chunk.start, kv[chunk.offset : chunk.offset + chunk.length])


def emit_chunk(pooler, kv: torch.Tensor, gate: torch.Tensor, chunk: SeqChunk, state: CompressorState) -> None:
    """One chunk's biased projections into one sequence's frontier, a row appended for every block it closes."""
    m, d = pooler.ratio, pooler.dim
    held = chunk.start % m
    if chunk.length == 1 and held + 1 < m and not chunk.snapshots and getattr(state, "journal", None) is None:
        # a decode token that closes no block: two row writes instead of this function's ~8 launches
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
    if pooler.overlap and state.snap_prev_kv is not None:
        for boundary, page in chunk.snapshots:  # the Ca half of the block that closes at the boundary
            block = boundary // m - 1 - first
            state.snap_prev_kv[page] = kv[block, :, :d]
            state.snap_prev_gate[page] = gate[block, :, :d]
    if pooler.overlap:
        slots_kv = kv.new_zeros((closed, 2 * m, d))
        slots_gate = gate.new_full((closed, 2 * m, d), float("-inf"))  # block 0 has no predecessor
        slots_kv[:, m:], slots_gate[:, m:] = kv[..., d:], gate[..., d:]
        slots_kv[1:, :m], slots_gate[1:, :m] = kv[:-1, :, :d], gate[:-1, :, :d]
        if first > 0:
            slots_kv[0, :m], slots_gate[0, :m] = state.prev_kv, state.prev_gate
        state.prev_kv.copy_(kv[-1, :, :d])
        state.prev_gate.copy_(gate[-1, :, :d])
        kv, gate = slots_kv, slots_gate
    state.rows.append(pooler.rows(kv, gate, first + torch.arange(closed, device=kv.device)))
