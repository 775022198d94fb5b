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
from deepserve.core.interfaces import Backend

from .batch import ForwardBatch, SeqChunk
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
        kv = self.kv_proj(x).float()
        gate = self.gate_proj(x).float() + self.position_bias[positions % self.ratio]
        return kv, gate

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
        pooled = (kv * torch.softmax(gate, dim=1)).sum(dim=1)
        rows = self.backend.rms_norm(pooled, self.kv_norm.weight, self.eps)
        positions = (first + torch.arange(closed, device=rows.device)) * m
        state.rows.append(self.backend.apply_rope(rows, positions, self.inv_freq))


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

    def select(self, x, qr, batch: ForwardBatch, states: list[CompressorState]) -> torch.Tensor:
        """Top-k compressed rows per query, as row numbers within the query's own sequence (-1 = none)."""
        q = self.q_b_proj(qr).view(x.shape[0], self.n_heads, self.dim)
        q = self.backend.apply_rope(q, batch.positions, self.inv_freq)
        weights = self.scorer.weights_proj(x).float() * self.weight_scale
        keys, starts = [], []
        base = 0
        for chunk, state in zip(batch.chunks, states):
            keys.append(state.rows.view())
            starts.append(base)
            base += state.rows.num_rows
        lengths = torch.tensor([c.length for c in batch.chunks], device=x.device)
        key_start = torch.tensor(starts, dtype=torch.long, device=x.device)
        key_start = key_start.repeat_interleave(lengths, output_size=x.shape[0])
        key_count = (batch.positions + 1) // self.ratio
        chosen = self.backend.indexer_topk(q, weights, torch.cat(keys), key_start, key_count, self.topk)
        return torch.where(chosen >= 0, chosen - key_start[:, None], chosen)


class Compressor(_Pooler):
    """Main-KV compressor of a CSA or HCA layer; a CSA compressor owns an indexer."""

    def __init__(self, cfg: ModelConfig, backend: Backend, layer_type: str, inv_freq: torch.Tensor):
        overlap = layer_type == CSA
        super().__init__(cfg, backend, cfg.compress_rate(layer_type), cfg.head_dim, overlap, inv_freq)
        self.indexer = Indexer(cfg, backend, inv_freq) if overlap else None

    def forward(self, x, qr, batch: ForwardBatch, states) -> torch.Tensor:
        """Emit this batch's rows into each sequence's state; return, per query, the compressed rows it
        attends to, numbered within its sequence, -1 padded: [T, K]."""
        kv, gate = self.project(x, batch.positions)
        for chunk, st in zip(batch.chunks, states):
            rows = slice(chunk.offset, chunk.offset + chunk.length)
            self.emit(kv[rows], gate[rows], chunk, st.compressor)
        if self.indexer is not None:
            ikv, igate = self.indexer.project(x, batch.positions)
            for chunk, st in zip(batch.chunks, states):
                rows = slice(chunk.offset, chunk.offset + chunk.length)
                self.indexer.emit(ikv[rows], igate[rows], chunk, st.indexer)
            return self.indexer.select(x, qr, batch, [st.indexer for st in states])
        # HCA: every emitted row that the query may see
        visible = (batch.positions + 1) // self.ratio
        width = int(visible.max().item()) if visible.numel() else 0
        offs = torch.arange(width, device=x.device)
        return torch.where(offs[None, :] < visible[:, None], offs[None, :], torch.full_like(offs, -1)[None, :])

