"""V4 attention (spec 3.3-3.5): MQA with one shared K=V head over the sliding window plus compressed rows.

For each query the keys are an index list into one pool per layer: the pool holds, per sequence, the window
rows it needs (old ones from the ring, new ones from this batch) followed by its compressed rows. The backend's
`sparse_attention` then does the softmax with the per-head sink. Window-only, CSA and HCA layers differ only
in the compressor that supplies (or not) the compressed part of the index list.
"""

from __future__ import annotations

import torch
from torch import nn

from deepserve.core.config import SLIDING, ModelConfig
from deepserve.core.interfaces import Backend, VisibleRows

from .batch import ForwardBatch, paged_layout, paged_step_pools, to_device
from .common import NormWeight, linear
from .compressor import Compressor, visible_rows
from .state import AttentionState, LayerStateSpec


def rope_inv_freq(cfg: ModelConfig, layer_type: str) -> torch.Tensor:
    rope = cfg.main_rope if layer_type == SLIDING else cfg.compress_rope
    return torch.tensor(rope.inv_freq(), dtype=torch.float32)


class Attention(nn.Module):
    """`layer_index`: which of the cache's layer pools a fixed-shape decode step (`batch.static`) gives this
    layer (None for layers outside the main stack, which never run such steps)."""

    def __init__(self, cfg: ModelConfig, backend: Backend, layer_type: str, layer_index: int | None = None):
        super().__init__()
        self.backend, self.cfg, self.layer_type, self.layer_index = backend, cfg, layer_type, layer_index
        H, d = cfg.num_attention_heads, cfg.head_dim
        self.num_heads, self.head_dim, self.window = H, d, cfg.sliding_window
        self.scale = d**-0.5
        self.q_a_proj = linear(backend, cfg.hidden_size, cfg.q_lora_rank)
        self.q_a_norm = NormWeight(cfg.q_lora_rank)
        self.q_b_proj = linear(backend, cfg.q_lora_rank, H * d)
        self.kv_proj = linear(backend, cfg.hidden_size, d)
        self.kv_norm = NormWeight(d)
        self.o_a_proj = linear(backend, H * d // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank)
        self.o_b_proj = linear(backend, cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size)
        self.sinks = nn.Parameter(torch.zeros(H, dtype=torch.float32))
        inv_freq = rope_inv_freq(cfg, layer_type)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.compressor = None if layer_type == SLIDING else Compressor(cfg, backend, layer_type, inv_freq.clone())

    def input_projections(self) -> list:
        """The projections of this layer's normed input (one GEMM once grouped: `common.SharedInput`)."""
        out = [self.q_a_proj, self.kv_proj]
        c = self.compressor
        if c is not None:
            out += [c.kv_proj, c.gate_proj]
            if c.indexer is not None:
                out += [c.indexer.kv_proj, c.indexer.gate_proj, c.indexer.scorer.weights_proj]
        return out

    def state_spec(self) -> LayerStateSpec:
        c = self.compressor
        return LayerStateSpec(
            window=self.window, width=self.head_dim,
            compressor=c.stream_spec() if c is not None else None,
            indexer=c.indexer.stream_spec() if c is not None and c.indexer is not None else None,
        )

    def forward(self, x: torch.Tensor, batch: ForwardBatch, states: list[AttentionState]) -> torch.Tensor:
        b, eps, T = self.backend, self.cfg.rms_norm_eps, x.shape[0]
        static = batch.static
        step_pools = static.layers[self.layer_index] if static is not None else None
        qa = self.q_a_proj(x)
        if self.q_b_proj.shared is None and (self.compressor is None
                                             or not self.compressor.reads_query(batch, step_pools)):
            qr = None  # nothing else reads the normed latent: the projection norms it as it reads it
            qb = b.rms_norm_linear(qa, self.q_a_norm.weight, eps, self.q_b_proj.weight)
        else:
            qr = b.rms_norm(qa, self.q_a_norm.weight, eps)
            qb = self.q_b_proj(qr)
        q, kv = b.qk_norm_rope(qb.view(T, self.num_heads, self.head_dim), self.kv_proj(x), self.kv_norm.weight, eps,
                               batch.positions, self.inv_freq)

        if static is not None:  # a fixed-shape decode step: everything from device tensors, no host state
            pools, layout = step_pools, static.layout
            compressed = self.compressor.forward_static(x, qr, batch, pools) if self.compressor is not None else None
        else:
            compressed = self.compressor(x, qr, batch, states) if self.compressor is not None else None
            pools = self._paged_pools(kv, batch, states)
            layout = paged_layout(batch, states) if pools is not None else None

        def attend(pool, indices):  # the attention output, its rotary dims turned back (V = K carries them)
            return b.sparse_attention_rope(q, pool, indices, self.sinks, self.scale, batch.positions, self.inv_freq)

        rows = None
        if static is not None:  # one token a row: its key into its ring first, then every window key from there
            rows = b.decode_key_rows(pools.storage, kv, batch.positions, layout.slot[:, 0], layout.query_tables,
                                     compressed, self.window, pools.rows_per_page, pools.comp_base)
        if rows is not None:
            out = attend(pools.storage, rows)
        elif pools is not None:  # the batched zero-copy decode path
            if isinstance(compressed, VisibleRows):
                compressed = visible_rows(batch.positions, compressed)
            pool, indices = self._paged_key_pool(kv, batch, layout, compressed, pools)
            out = attend(pool, indices)
            positions, slot, keep = batch.positions, layout.slot[:, 0], None
            if static is None:  # a static step's snapshots are taken after it, from the written rings
                self._snapshot_windows(batch, states, pools)  # (rare) before the ring write overwrites rows
                keep = self._ring_rows_kept(batch, kv.device)
                if keep is not None:
                    positions, slot, kv = positions[keep], slot[keep], kv[keep]
            if not b.paged_window_write(pool, kv, positions, slot, self.window):
                pool.index_put_((slot * self.window + positions % self.window,), kv)  # all rings in one scatter
        else:
            pool, indices, windows = self._key_pool(kv, batch, states, compressed)
            out = attend(pool, indices)
            for chunk, st, (first, rows) in zip(batch.chunks, states, windows):
                for boundary, page in chunk.snapshots:  # window tail [boundary - W, boundary) for prefix hits
                    st.snap_window[page] = rows[boundary - self.window - first : boundary - first]
                st.window.write(chunk.start, kv[chunk.offset : chunk.offset + chunk.length])

        return self.o_b_proj(self._grouped_o_a(out))

    def _ring_rows_kept(self, batch: ForwardBatch, device) -> torch.Tensor | None:
        """The batch rows whose keys the window rings keep: each chunk's last W (one write per ring slot), or None
        when every chunk is at most W long. Built once per forward (every layer has the same window)."""
        key = ("ring rows kept", self.window)
        if key not in batch.memo:
            W = self.window
            batch.memo[key] = None if all(c.length <= W for c in batch.chunks) else to_device(
                [c.offset + j for c in batch.chunks for j in range(max(0, c.length - W), c.length)], torch.long, device)
        return batch.memo[key]

    def _grouped_o_a(self, out: torch.Tensor) -> torch.Tensor:
        """Heads in G groups; group g goes through its own slice of `o_a_proj`."""
        G, T = self.cfg.o_groups, out.shape[0]
        w = self.o_a_proj.weight.view(G, -1, self.num_heads * self.head_dim // G)  # [G, d_g, H*d/G]
        return self.backend.grouped_linear(out.reshape(T, G, -1), w).reshape(T, -1)

    def _key_pool(self, kv, batch: ForwardBatch, states, compressed):
        """Concatenate each sequence's window rows and compressed rows; index them per query. Also returns, per
        sequence, (first position, rows) of the window rows gathered."""
        if all(c.length <= self.window and not c.snapshots for c in batch.chunks):
            return self._decode_key_pool(kv, batch, states, compressed)
        W, device = self.window, kv.device
        pieces, index_parts, windows, base = [], [], [], 0
        width_c = compressed.shape[1] if compressed is not None else 0
        for chunk, st in zip(batch.chunks, states):
            first = max(0, chunk.start - W + 1)
            new = kv[chunk.offset : chunk.offset + chunk.length]
            window_rows = torch.cat((st.window.read(first, chunk.start), new)) if first < chunk.start else new
            pieces.append(window_rows)
            windows.append((first, window_rows))
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
        return torch.cat(pieces), indices, windows

    def _decode_key_pool(self, kv, batch: ForwardBatch, states, compressed):
        """`_key_pool` for a step of at most `window` new tokens per sequence (decode: 1; speculative verify: 1 + k),
        in a constant number of launches: each whole ring goes into the pool as it is and the indices name its
        slots (the same keys in the same order as the general path, so the same results), the new rows go last.
        Per-sequence gathers were most of a decode step's launches."""
        device = kv.device
        lengths = to_device([c.length for c in batch.chunks], torch.long, device)

        def per_query(values):  # one value per chunk -> one per query, [T, 1]
            return to_device(values, torch.long, device).repeat_interleave(lengths, output_size=kv.shape[0])[:, None]

        pieces, ring_base, comp_base, base = [], [], [], 0
        for st in states:
            pieces.append(st.window.ring)
            ring_base.append(base)
            base += st.window.ring.shape[0]
            if compressed is not None:
                rows = st.compressor.rows
                pieces.append(rows.view())
                comp_base.append(base)
                base += rows.num_rows
        pieces.append(kv)
        parts = [self._window_indices(batch.positions, per_query([c.start for c in batch.chunks]),
                                      per_query(ring_base), base + per_query([c.offset for c in batch.chunks]))]
        if compressed is not None:
            parts.append(torch.where(compressed >= 0, per_query(comp_base) + compressed, compressed))
        return torch.cat(pieces), torch.cat(parts, dim=1), [(c.start, None) for c in batch.chunks]

    def _window_indices(self, positions, chunk_start, ring_base, new_base) -> torch.Tensor:
        """[T, W] pool rows of each query's window keys (-1 before position 0), when the pool holds each sequence's
        whole ring (position p at `ring_base + p % W`, for positions before its chunk) and its chunk's new rows
        (position p at `new_base + p - chunk_start`). The last three are per query, [T, 1]."""
        W = self.window
        key_pos = positions[:, None] - (W - 1) + torch.arange(W, device=positions.device)[None, :]
        window = torch.where(key_pos < chunk_start, ring_base + key_pos % W, new_base + key_pos - chunk_start)
        return torch.where(key_pos >= 0, window, torch.full_like(key_pos, -1))

    def _paged_pools(self, kv, batch: ForwardBatch, states):
        """The layer pools of the paged cache when this step can index them directly (the batched path): every
        state of the batch from the same cache, the new rows fitting the scratch region. Else None."""
        pools = paged_step_pools(batch, states)
        if pools is None or kv.dtype != pools.storage.dtype:
            return None
        return pools

    def _paged_key_pool(self, kv, batch: ForwardBatch, layout, compressed, pools):
        """`_key_pool` over the paged storage itself, with no copy of rings or rows and a fixed number of
        device ops: a query's window keys are ring rows `slot * W + position % W` (positions before its chunk)
        or its chunk's new rows (copied to the scratch region), its compressed row r is `comp_base +
        table[r // rpp] * rpp + r % rpp`. The same keys in the same order as `_key_pool`, so the same results."""
        W, T = self.window, kv.shape[0]
        storage = pools.storage
        storage[pools.scratch_base : pools.scratch_base + T] = kv
        rows = self.backend.paged_key_rows(batch.positions, layout.chunk_start, layout.chunk_offset, layout.slot,
                                           layout.query_tables, compressed, W, pools.rows_per_page, pools.comp_base,
                                           pools.scratch_base)
        if rows is not None:  # the backend's one-launch kernel
            return storage, rows
        parts = [self._window_indices(batch.positions, layout.chunk_start, layout.slot * W,
                                      pools.scratch_base + layout.chunk_offset)]
        if compressed is not None:
            rpp, row = pools.rows_per_page, compressed.clamp(min=0)
            page = torch.gather(layout.query_tables, 1, row // rpp)
            parts.append(torch.where(compressed >= 0, pools.comp_base + page * rpp + row % rpp, compressed))
        return storage, torch.cat(parts, dim=1)

    def _snapshot_windows(self, batch: ForwardBatch, states, pools) -> None:
        """Window tails [boundary - W, boundary) at the page boundaries the chunks cross, from the storage (ring
        rows before the chunk, the chunk's new rows in the scratch region): one gather per snapshot."""
        W, storage = self.window, pools.storage
        for chunk, st in zip(batch.chunks, states):
            for boundary, page in chunk.snapshots:
                rows = [st.slot * W + p % W if p < chunk.start else pools.scratch_base + chunk.offset + p - chunk.start
                        for p in range(boundary - W, boundary)]
                st.snap_window[page] = storage[to_device(rows, torch.long, storage.device)]
