"""One V4 decoder block: mHC around attention, then mHC around the MoE (spec 3.2 layer order)."""

from __future__ import annotations

import torch
from torch import nn

from deepserve.core.config import ModelConfig
from deepserve.core.interfaces import Backend

from .attention import Attention
from .common import NormWeight
from .layouts import LayerLayout
from .mhc import HyperConnection
from .moe import MoE
from .state import LayerStateSpec


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: Backend, layer_type: str, mlp_type: str):
        super().__init__()
        self.backend, self.eps = backend, cfg.rms_norm_eps
        self.self_attn = Attention(cfg, backend, layer_type)
        self.mlp = MoE(cfg, backend, mlp_type)
        self.input_layernorm = NormWeight(cfg.hidden_size)
        self.post_attention_layernorm = NormWeight(cfg.hidden_size)
        self.attn_hc = HyperConnection(cfg, backend)
        self.ffn_hc = HyperConnection(cfg, backend)

    def state_spec(self) -> LayerStateSpec:
        return self.self_attn.state_spec()

    def forward(self, streams: torch.Tensor, layout: LayerLayout, token_ids: torch.Tensor) -> torch.Tensor:
        """streams [T, n, D] -> streams: attention then the MoE, each inside its mHC site. `layout`: where this
        layer's attention state lives for the step; `token_ids` [T]: the hash-routed MoE's input."""
        x, post, comb = self.attn_hc.pre_norm(streams, self.input_layernorm.weight, self.eps)
        streams = self.attn_hc.post(streams, self.self_attn(x, layout), post, comb)
        x, post, comb = self.ffn_hc.pre_norm(streams, self.post_attention_layernorm.weight, self.eps)
        return self.ffn_hc.post(streams, self.mlp(x, token_ids), post, comb)
