"""V4.1's MoE (v41-architecture.md §5): a fp32 sqrt-softplus router whose correction bias picks experts (image
tokens would use `bias_vl`), MXFP4 routed experts whose routing weight scales the SwiGLU activation before `w2`,
one FP8 shared expert, the routed sum accumulated in fp32."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import V41Config
from .numerics import QuantWeight, gemm, linear, per_row, topk_low_ties


class Expert:
    def __init__(self, w1: QuantWeight, w2: QuantWeight, w3: QuantWeight, limit: float):
        self.w1, self.w2, self.w3, self.limit = w1, w2, w3, limit

    def __call__(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        gate, up = linear(x, self.w1).float(), linear(x, self.w3).float()
        if self.limit > 0:
            up = up.clamp(-self.limit, self.limit)
            gate = gate.clamp(max=self.limit)
        h = F.silu(gate) * up
        if weight is not None:
            h = weight * h
        return linear(h.to(x.dtype), self.w2)

    def to(self, device) -> "Expert":
        return Expert(self.w1.to(device), self.w2.to(device), self.w3.to(device), self.limit)


class MoE(nn.Module):
    def __init__(self, cfg: V41Config, layer: int):
        super().__init__()
        self.cfg = cfg
        self.n_experts, self.top_k = cfg.moe_shape(layer)
        self.gate_weight: torch.Tensor | None = None  # bf16 [experts, D]
        self.gate_bias: torch.Tensor | None = None  # fp32 [experts]
        self.gate_bias_vl: torch.Tensor | None = None  # fp32 [experts]: image tokens (not served yet)
        self.experts: list[Expert] = []
        self.shared: Expert | None = None

    def route(self, x: torch.Tensor, min_rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        scores = gemm(x.float(), self.gate_weight.float(), min_rows) / c.gate_temp
        if c.score_func == "softmax":
            scores = scores.softmax(dim=-1)
        elif c.score_func == "sigmoid":
            scores = scores.sigmoid()
        else:
            scores = F.softplus(scores).sqrt()
        _, idx = topk_low_ties(scores + self.gate_bias, self.top_k)
        weights = scores.gather(1, idx)
        if c.norm_topk_prob and self.top_k > 1:
            weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
        weights *= c.route_scale
        return weights, idx

    def forward(self, x: torch.Tensor, min_rows: int = 1, apart: bool = False) -> torch.Tensor:
        """`apart`: the rows are different sequences' decode tokens; the router's plain GEMM and activations then
        run per row (`per_row`); the experts' block-scaled GEMMs give each row the same bits at any row count."""
        weights, idx = per_row(lambda r: self.route(r, min_rows), x) if apart else self.route(x, min_rows)
        y = torch.zeros_like(x, dtype=torch.float32)
        for e in torch.unique(idx).tolist():
            rows, slot = torch.where(idx == e)
            y[rows] += self.experts[e](x[rows], weights[rows, slot, None])
        y += self.shared(x)
        return y.to(x.dtype)
