"""Small parameter holders shared by the V4 modules."""

from __future__ import annotations

import torch
from torch import nn


class NormWeight(nn.Module):
    """The learned scale of an RMSNorm, kept in fp32 like the reference; the backend applies the norm."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))


def linear(in_features: int, out_features: int) -> nn.Linear:
    return nn.Linear(in_features, out_features, bias=False)
