"""Mixture of experts (spec 3.8): sqrt-softplus router with a selection-only bias, or a frozen token-id hash
table in the first layers; clamped SwiGLU experts; one shared expert added to every token."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from deepserve.core.config import HASH_MOE, ModelConfig
from deepserve.core.interfaces import Backend

from .common import linear, stored
from .quant import QuantizedWeight


class Router(nn.Module):
    """Picks `top_k` experts per token and their weights. Hash layers select by `tid2eid[token_id]`."""

    def __init__(self, cfg: ModelConfig, backend: Backend, is_hash: bool):
        super().__init__()
        self.backend = backend
        self.top_k, self.scale, self.is_hash = cfg.num_experts_per_tok, cfg.routed_scaling_factor, is_hash
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        if is_hash:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.long))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bias = None if self.is_hash else self.e_score_correction_bias
        fused = self.backend.route_hidden(x, self.weight, bias, self.tid2eid if self.is_hash else None, token_ids,
                                          self.top_k, self.scale)
        if fused is not None:  # logits and routing in one launch
            return fused
        logits = self.backend.linear_fp32(x, self.weight)  # a backend that multiplies bf16 with fp32 output
        if logits is None:
            logits = self.backend.linear(x.float(), self.weight.float())
        return self.backend.route(logits, bias, self.tid2eid[token_ids] if self.is_hash else None, self.top_k,
                                  self.scale)


class Experts(nn.Module):
    """The routed experts' weights, stacked: all `n_routed_experts`, or under expert parallelism the
    `num_local_experts` slots this rank holds (`deepserve.distributed.placement`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E = cfg.num_local_experts if cfg.num_local_experts is not None else cfg.n_routed_experts
        I, D = cfg.moe_intermediate_size, cfg.hidden_size
        self.gate_up_proj = nn.Parameter(torch.zeros(E, 2 * I, D))
        self.down_proj = nn.Parameter(torch.zeros(E, D, I))


class SharedExpert(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: Backend):
        super().__init__()
        D, I = cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_proj, self.up_proj = linear(backend, D, I), linear(backend, D, I)
        self.down_proj = linear(backend, I, D)
        self.backend, self.limit = backend, cfg.swiglu_limit

    def input_projections(self) -> list:
        """gate and up read the same input (one GEMM once grouped: `common.SharedInput`)."""
        return [self.gate_proj, self.up_proj]

    def _gate_up_group(self):
        """The `SharedInput` group that stacks just gate and up, gate rows first (a routed expert's `gate_up_proj`
        layout), or None."""
        group = self.gate_proj.shared
        if group is None or self.up_proj.shared is not group or len(group.spans) != 2:
            return None
        (a, b), (c, d) = group.spans[self.gate_proj], group.spans[self.up_proj]
        return group if a == 0 and b == c and d == group.weight.shape[0] else None

    def gate_up_weight(self) -> torch.Tensor | None:
        """gate and up as one plain [2I, D] weight when `SharedInput` stacks them so (no copy); else None."""
        group = self._gate_up_group()
        return group.weight if group is not None and group.scale is None else None

    def stored_gate_up(self) -> QuantizedWeight | None:
        """`gate_up_weight` for gate and up kept as stored: their stacked data and scales as one [2I, D] stored
        weight (no copy); else None."""
        group = self._gate_up_group()
        if group is None or group.scale is None:
            return None
        return QuantizedWeight(group.weight, group.scale, group.block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.backend.swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: Backend, mlp_type: str):
        super().__init__()
        self.backend, self.limit = backend, cfg.swiglu_limit
        self.gate = Router(cfg, backend, is_hash=mlp_type == HASH_MOE)
        self.experts = Experts(cfg)
        self.shared_experts = SharedExpert(cfg, backend)
        self.expert_parallel: ExpertParallelSite | None = None

    def enable_expert_parallel(self, site: ExpertParallelSite) -> None:
        """Route this layer's tokens to the ranks that hold their experts (`self.experts` holds this rank's
        slots only); the shared expert stays local."""
        self.expert_parallel = site

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x, token_ids)
        if self.expert_parallel is not None:
            pair_outputs = self.expert_parallel.exchange(x, ids)
            return combine_in_expert_order(pair_outputs, ids, weights, x.dtype) + self.shared_experts(x)
        w13, w2 = stored(self.experts, "gate_up_proj"), stored(self.experts, "down_proj")
        if w13 is not None and w2 is not None:  # FP4/FP8 experts as stored: the backend dequantizes where it must
            shared_w13, shared_w2 = self.shared_experts.stored_gate_up(), self.shared_experts.down_proj.stored()
            if shared_w13 is not None and shared_w2 is not None:  # the shared expert stored too: one pass, if any
                fused = self.backend.quantized_moe_with_shared(x, ids, weights, w13, w2, self.limit, shared_w13,
                                                               shared_w2)
                if fused is not None:
                    return fused
            routed = self.backend.quantized_moe_experts(x, ids, weights, w13, w2, self.limit)
            return routed + self.shared_experts(x)
        shared_w13 = self.shared_experts.gate_up_weight()
        if shared_w13 is not None:  # the backend's routed + shared experts in one pass, where it has one
            fused = self.backend.moe_with_shared(x, ids, weights, self.experts.gate_up_proj, self.experts.down_proj,
                                                 self.limit, shared_w13, self.shared_experts.down_proj.weight)
            if fused is not None:
                return fused
        routed = self.backend.moe_experts(
            x, ids, weights, self.experts.gate_up_proj, self.experts.down_proj, self.limit
        )
        return routed + self.shared_experts(x)


class ExpertParallelSite(Protocol):
    """One MoE site's handle on the expert-parallel transport (`deepserve.distributed.expert_parallel`)."""

    def exchange(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each routed pair's expert output [T, k, D] (x's dtype, before the routing weight), wherever it ran."""


def combine_in_expert_order(pair_outputs: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                            dtype: torch.dtype) -> torch.Tensor:
    """`sum_k weights[t, k] * pair_outputs[t, k]` in fp32, each token's terms added in ascending expert id from
    zero, then cast to `dtype`: the reference backend's `moe_experts` order, so that expert parallelism gives the
    bits of one process."""
    order = torch.argsort(ids, dim=1, stable=True)
    terms = pair_outputs.gather(1, order[..., None].expand_as(pair_outputs)).float()
    terms = terms * weights.gather(1, order).float()[..., None]
    out = torch.zeros(terms.shape[0], terms.shape[2], dtype=torch.float32, device=terms.device)
    for j in range(terms.shape[1]):
        out += terms[:, j]
    return out.to(dtype)



def expert_rows(backend: Backend, rows: torch.Tensor, slots: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                limit: float) -> torch.Tensor:
    """`W2_e(swiglu(W13_e row))` for each row with expert `slots[i]` of the stacked `w13` / `w2`, in the rows'
    dtype: the backend's own MoE op with one expert per row at weight 1 (its fastest kernel). On the reference
    backend that is exactly the linear's output (x 1.0, added to zero in fp32, cast back: no rounding), which
    `combine_in_expert_order` then weighs and sums as `moe_experts` does."""
    ones = torch.ones(rows.shape[0], 1, dtype=torch.float32, device=rows.device)
    return backend.moe_experts(rows, slots[:, None], ones, w13, w2, limit)
