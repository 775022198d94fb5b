"""The multi-token-prediction block (spec 3.9), used as the speculative drafter.

Token alignment (DeepSeek-V3 convention, which V4 keeps): at position i the block combines the main model's
final mHC streams at i, `H_i`, with the embedding of the *next* token `t_{i+1}`, and predicts `t_{i+2}`:
`X_in[k] = e_proj(enorm(Emb(t_{i+1}))) + h_proj(hnorm(H_i[k]))` for every stream k, then a window-only decoder
block at the same position i, its own `hc_head`, `norm`, and the shared LM head. The evidence for choosing this
over the (H_p, t_p) pairing is written down in docs/architecture.md.
"""

from __future__ import annotations

import torch

from deepserve.core.config import MOE, SLIDING, ModelConfig
from deepserve.core.interfaces import Backend

from .common import NormWeight, linear
from .decoder import DecoderLayer
from .layouts import LayerLayout
from .mhc import HyperHead


class MTPBlock(DecoderLayer):
    def __init__(self, cfg: ModelConfig, backend: Backend):
        super().__init__(cfg, backend, SLIDING, MOE)
        D = cfg.hidden_size
        self.cfg = cfg
        self.enorm, self.hnorm = NormWeight(D), NormWeight(D)
        self.e_proj, self.h_proj = linear(backend, D, D), linear(backend, D, D)
        self.hc_head = HyperHead(cfg, backend)
        self.norm = NormWeight(D)

    def forward(  # type: ignore[override]
        self, embeds: torch.Tensor, prev_streams: torch.Tensor, layout: LayerLayout, token_ids: torch.Tensor
    ) -> torch.Tensor:
        norm = self.backend.rms_norm
        e = self.e_proj(norm(embeds, self.enorm.weight, self.eps))
        h = self.h_proj(norm(prev_streams, self.hnorm.weight, self.eps))  # per stream
        streams = e.unsqueeze(1) + h
        return super().forward(streams, layout, token_ids)

    def final_hidden(self, streams: torch.Tensor) -> torch.Tensor:
        return self.backend.rms_norm(self.hc_head(streams), self.norm.weight, self.eps)
