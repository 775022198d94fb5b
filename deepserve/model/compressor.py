"""KV compression (spec 3.6) and the lightning indexer (3.7).

A compressor pools every `ratio` tokens into one row: a per-channel softmax over the block's gates weights
the block's projected kv. CSA (ratio 4) overlaps blocks: each token projects two halves, "Ca" for the next
entry and "Cb" for its own, so entry w pools 8 slots (block w-1's Ca, block w's Cb). HCA (ratio 128) does not
overlap. Rows are RMS-normed and rotated at the position of their block's first token. The indexer is a
second, 128-wide CSA compressor whose rows are keys that each query scores to pick its top-k entries.

Where the frontier and the rows live, and how a step's blocks are closed into them, is the layout's
(`deepserve.model.layouts`): a compressor hands it the projections, and it calls back `_Pooler.rows` for the maths.
"""

from __future__ import annotations

import torch
from torch import nn

from deepserve.core.config import CSA, ModelConfig
from deepserve.core.interfaces import Backend, VisibleRows

from .common import NormWeight, linear
from .kv_precision import KVPrecision, hadamard_matrix
from .layouts import LayerLayout
from .state import StreamSpec


class _Pooler(nn.Module):
    """Projection, position bias and softmax pooling shared by the main compressors and the indexer."""

    #: how the rows are rounded on their way into the cache (`kv_precision.use_kv_cache_dtype`)
    kv_precision = KVPrecision()

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

    def emit(self, x: torch.Tensor, layout: LayerLayout, stream: str) -> None:
        """Project the step's tokens and let the layout add them to `stream`'s frontier, closing blocks into rows."""
        layout.emit(self, self.kv_proj(x), self.gate_proj(x), stream)

    def biased(self, kv, gate, positions) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 projections, the gate with the position bias of each token's slot in its block."""
        return kv.float(), gate.float() + self.position_bias[positions % self.ratio]

    def rows(self, kv: torch.Tensor, gate: torch.Tensor, first_row: torch.Tensor,
             encoded: bool = False) -> torch.Tensor:
        """The rows of closed blocks (their slots' projections [B, slots, dim]): a per-channel softmax of the gates
        over the slots weights the kv; then RMSNorm, RoPE at each block's first position (row * ratio), and the
        cache's rounding (`stored`; `encoded`: the pools' codec rounds them as it stores them)."""
        pooled = self.backend.softmax_pool(kv, gate)
        rows = self.backend.rms_norm(pooled, self.kv_norm.weight, self.eps)
        rows = self.backend.apply_rope(rows, first_row * self.ratio, self.inv_freq, inplace=True)
        return self.stored(rows, encoded)

    def stored(self, rows: torch.Tensor, encoded: bool = False) -> torch.Tensor:
        """Compressed KV rows as the cache keeps them; as they are where the pools encode them (`encoded`: their
        codec's encoding is the same rounding)."""
        return rows if encoded else self.kv_precision.round_kv(rows)

    def stored_turn(self) -> torch.Tensor | None:
        """The matrix rows are turned by before they are rounded (`stored`): none for KV rows."""
        return None


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

    def stored(self, rows: torch.Tensor, encoded: bool = False) -> torch.Tensor:
        """Indexer keys as the cache keeps them (fp8 mode: Hadamard-turned, FP4-rounded); only turned where the
        pools encode them (`encoded`: the FP4 codec rounds them as it stores them)."""
        if encoded:
            return self.kv_precision.turn_index_keys(rows)
        return self.kv_precision.round_index_keys(rows)

    def stored_turn(self) -> torch.Tensor | None:
        """fp8 mode: the Hadamard matrix the keys are turned by before they are rounded; else none."""
        return hadamard_matrix(self.dim, self.inv_freq.device) if self.kv_precision.fp8 else None

    def select(self, x, qr, layout: LayerLayout) -> torch.Tensor | VisibleRows:
        """Top-k compressed rows per query, as row numbers within the query's own sequence (-1 = none); or, where
        the layout knows every row is chosen (`index_scored` false), all of them, with nothing computed."""
        if not layout.index_scored(self):
            return layout.all_visible(self, "indexer")
        q = self.q_b_proj(qr).view(x.shape[0], self.n_heads, self.dim)
        q = self.backend.apply_rope(q, layout.positions, self.inv_freq, inplace=True)
        q = self.kv_precision.rotate_index_queries(q)  # into the keys' frame (fp8 mode turns them): q . k unchanged
        weights = self.scorer.weights_proj(x).float() * self.weight_scale
        return layout.index_topk(self, q, weights)


class Compressor(_Pooler):
    """Main-KV compressor of a CSA or HCA layer; a CSA compressor owns an indexer."""

    def __init__(self, cfg: ModelConfig, backend: Backend, layer_type: str, inv_freq: torch.Tensor):
        overlap = layer_type == CSA
        super().__init__(cfg, backend, cfg.compress_rate(layer_type), cfg.head_dim, overlap, inv_freq)
        self.indexer = Indexer(cfg, backend, inv_freq) if overlap else None

    def forward(self, x, qr, layout: LayerLayout) -> torch.Tensor | VisibleRows:
        """Emit this step's rows into each sequence's state; return, per query, the compressed rows it attends to,
        numbered within its sequence, -1 padded ([T, K]), or their rule (`VisibleRows`)."""
        self.emit(x, layout, "compressor")
        if self.indexer is None:  # HCA: every emitted row that the query may see
            return layout.all_visible(self, "compressor")
        self.indexer.emit(x, layout, "indexer")
        return self.indexer.select(x, qr, layout)

    def reads_query(self, layout: LayerLayout) -> bool:
        """Whether this step's `forward` reads `qr`, the attention's normed query latent: only a CSA layer's
        indexer does, and only where it scores (else the attention need not keep `qr`)."""
        return self.indexer is not None and layout.index_scored(self.indexer)
