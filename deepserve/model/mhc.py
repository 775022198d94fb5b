"""Manifold-constrained hyper-connections (spec 3.2): the parameters of one mixing site and of the final head.
The maths (Sinkhorn projection, collapse, expand) is a backend op."""

from __future__ import annotations

import torch
from torch import nn

from deepserve.core.config import ModelConfig
from deepserve.core.interfaces import Backend


class HyperConnection(nn.Module):
    """One mHC site around a block: `pre` collapses the n streams, `post`/`comb` expand and mix them back."""

    def __init__(self, cfg: ModelConfig, backend: Backend):
        super().__init__()
        n = cfg.hc_mult
        self.backend, self.cfg = backend, cfg
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * cfg.hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    def pre(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.cfg
        return self.backend.hc_pre(streams, self.fn, self.base, self.scale, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps)

    def pre_norm(self, streams: torch.Tensor, weight: torch.Tensor, eps: float):
        """`pre`, its collapsed rows then RMS-normed with `weight` (the block's input norm), in one backend op."""
        c = self.cfg
        return self.backend.hc_pre_norm(streams, self.fn, self.base, self.scale, c.hc_sinkhorn_iters, c.hc_eps,
                                        c.rms_norm_eps, weight, eps)

    def post(self, streams, block_out, post, comb) -> torch.Tensor:
        return self.backend.hc_post(streams, block_out, post, comb)


class HyperHead(nn.Module):
    """Final collapse of the n streams into one hidden vector."""

    def __init__(self, cfg: ModelConfig, backend: Backend):
        super().__init__()
        n = cfg.hc_mult
        self.backend, self.cfg = backend, cfg
        self.hc_fn = nn.Parameter(torch.zeros(n, n * cfg.hidden_size, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        return self.backend.hc_head(streams, self.hc_fn, self.hc_base, self.hc_scale, c.hc_eps, c.rms_norm_eps)

    def norm(self, streams: torch.Tensor, weight: torch.Tensor, eps: float):
        """The collapse, then the model's final RMSNorm with `weight`, in one backend op."""
        c = self.cfg
        return self.backend.hc_head_norm(streams, self.hc_fn, self.hc_base, self.hc_scale, c.hc_eps, c.rms_norm_eps,
                                         weight, eps)
