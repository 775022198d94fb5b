"""One V4 decoder block: mHC around attention, then mHC around the MoE (spec 3.2 layer order)."""

from __future__ import annotations

import torch
from torch import nn

from deepserve.core.config import ModelConfig
from deepserve.core.interfaces import Backend

from .attention import Attention
from .batch import ForwardBatch
from .common import NormWeight
from .mhc import HyperConnection
from .moe import MoE
from .state import AttentionState, LayerStateSpec


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: Backend, layer_type: str, mlp_type: str, index: int | None = None):
        super().__init__()
        self.backend, self.eps = backend, cfg.rms_norm_eps
        self.self_attn = Attention(cfg, backend, layer_type, index)
        self.mlp = MoE(cfg, backend, mlp_type)
        self.input_layernorm = NormWeight(cfg.hidden_size)
        self.post_attention_layernorm = NormWeight(cfg.hidden_size)
        self.attn_hc = HyperConnection(cfg, backend)
        self.ffn_hc = HyperConnection(cfg, backend)

    def state_spec(self) -> LayerStateSpec:
        return self.self_attn.state_spec()

    def forward(
        self, streams: torch.Tensor, batch: ForwardBatch, states: list[AttentionState], token_ids: torch.Tensor
    ) -> torch.Tensor:
        x, post, comb = self.attn_hc.pre_norm(streams, self.input_layernorm.weight, self.eps)
        a = self.self_attn(x, batch, states)
        streams = self.attn_hc.post(streams, a, post, comb)
        x, post, comb = self.ffn_hc.pre_norm(streams, self.post_attention_layernorm.weight, self.eps)
        f = self.mlp(x, token_ids)
        return self.ffn_hc.post(streams, f, post, comb)
