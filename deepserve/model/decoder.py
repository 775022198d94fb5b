"""One V4 decoder block: mHC around attention, then mHC around the MoE (spec 3.2 layer order)."""

from __future__ import annotations

import torch
from torch import nn

from deepserve.core.config import ModelConfig
from deepserve.core.interfaces import Backend

from .attention import Attention
from .batch import ForwardBatch
from .common import NormWeight
from .mhc import HyperConnection, HyperHead
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
        return self.forward_mixed(streams, batch, states, token_ids)[0]

    def forward_mixed(self, streams: torch.Tensor, batch: ForwardBatch, states: list[AttentionState],
                      token_ids: torch.Tensor, mix: object | None = None,
                      following: HyperConnection | HyperHead | None = None) -> tuple[torch.Tensor, object | None]:
        """`forward` in a stack: `mix` is what the layer before left for this layer's first mHC site, and the
        return is (streams, what this layer leaves for `following`: the next layer's first site, or the final
        head). Each site's post then starts the next site's mix (`Backend.hc_post_mix`)."""
        x, post, comb = self.attn_hc.pre_norm(streams, self.input_layernorm.weight, self.eps, mix)
        a = self.self_attn(x, batch, states)
        streams, mix = self.attn_hc.post_mix(streams, a, post, comb, self.ffn_hc)
        x, post, comb = self.ffn_hc.pre_norm(streams, self.post_attention_layernorm.weight, self.eps, mix)
        f = self.mlp(x, token_ids)
        if following is None:
            return self.ffn_hc.post(streams, f, post, comb), None
        return self.ffn_hc.post_mix(streams, f, post, comb, following)
