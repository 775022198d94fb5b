"""V4 attention (spec 3.3-3.5): MQA with one shared K=V head over the sliding window plus compressed rows.

For each query the keys are an index list into one pool per layer: the pool holds, per sequence, the window
rows it needs (old ones from the ring, new ones from this batch) followed by its compressed rows. The backend's
`sparse_attention` then does the softmax with the per-head sink. Window-only, CSA and HCA layers differ only
in the compressor that supplies (or not) the compressed part of the index list. Where the rings and rows live
(a sequence's own tensors, the paged cache, a CUDA-graph step) is the layout's: `deepserve.model.layouts`.
"""

from __future__ import annotations

import torch
from torch import nn

from deepserve.core.config import SLIDING, ModelConfig
from deepserve.core.interfaces import Backend

from .common import NormWeight, linear
from .compressor import Compressor
from .kv_precision import KVPrecision
from .layouts import LayerLayout
from .state import LayerStateSpec


def rope_inv_freq(cfg: ModelConfig, layer_type: str) -> torch.Tensor:
    rope = cfg.main_rope if layer_type == SLIDING else cfg.compress_rope
    return torch.tensor(rope.inv_freq(), dtype=torch.float32)


class Attention(nn.Module):
    #: how a token's kv row is rounded on its way into the window and the cache (`kv_precision.use_kv_cache_dtype`)
    kv_precision = KVPrecision()

    def __init__(self, cfg: ModelConfig, backend: Backend, layer_type: str):
        super().__init__()
        self.backend, self.cfg, self.layer_type = backend, cfg, layer_type
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

    def forward(self, x: torch.Tensor, layout: LayerLayout) -> torch.Tensor:
        """x [T, D]: the normed input of the step's tokens, at `layout.positions`; `layout`: where this layer's
        state lives for the step (`deepserve.model.layouts`), which the keys are read from and written to."""
        b, eps, T = self.backend, self.cfg.rms_norm_eps, x.shape[0]
        positions = layout.positions
        qa = self.q_a_proj(x)
        if self.q_b_proj.shared is None and self.q_b_proj.stored() is None and (
                self.compressor is None or not self.compressor.reads_query(layout)):
            qr = None  # nothing else reads the normed latent: the projection norms it as it reads it
            qb = b.rms_norm_linear(qa, self.q_a_norm.weight, eps, self.q_b_proj.weight)
        else:
            qr = b.rms_norm(qa, self.q_a_norm.weight, eps)
            qb = self.q_b_proj(qr)
        q, kv = b.qk_norm_rope(qb.view(T, self.num_heads, self.head_dim), self.kv_proj(x), self.kv_norm.weight, eps,
                               positions, self.inv_freq)
        if not layout.rounds_on_store():  # packed pools round it as they store it (the encoding is the rounding)
            kv = self.kv_precision.round_kv(kv)  # as the cache keeps it: this token attends to its rounded row too
        compressed = self.compressor(x, qr, layout) if self.compressor is not None else None
        # the attention output, its rotary dims turned back (V = K carries them); packed keys read as stored
        out = layout.attend(q, kv, compressed, self.sinks, self.scale, self.inv_freq)
        layout.store_window(kv)
        return self.o_b_proj(self._grouped_o_a(out))

    def _grouped_o_a(self, out: torch.Tensor) -> torch.Tensor:
        """Heads in G groups; group g goes through its own slice of `o_a_proj`."""
        G, T = self.cfg.o_groups, out.shape[0]
        return self.o_a_proj.grouped(out.reshape(T, G, -1)).reshape(T, -1)  # weight as [G, d_g, H*d/G]
