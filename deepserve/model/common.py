"""Small parameter holders shared by the V4 modules."""

from __future__ import annotations

import torch
from torch import nn

from deepserve.core.interfaces import Backend


class NormWeight(nn.Module):
    """The learned scale of an RMSNorm, kept in fp32 like the reference; the backend applies the norm."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))


class Linear(nn.Module):
    """A bias-free projection whose GEMM is the backend's (batch-invariant, FP8-capable where the backend is).
    Accepts [..., in_features]."""

    def __init__(self, backend: Backend, in_features: int, out_features: int) -> None:
        super().__init__()
        self.backend = backend
        self.weight = nn.Parameter(torch.zeros(out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        return self.backend.linear(x.reshape(-1, x.shape[-1]), self.weight).view(*lead, -1)


def linear(backend: Backend, in_features: int, out_features: int) -> Linear:
    return Linear(backend, in_features, out_features)
