"""Helpers shared by the kernels."""

from __future__ import annotations

import torch


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 operands get full-precision products (the fp32 path must match the CPU oracle); bf16/fp16 products
    are exact in any mode."""
    return "ieee" if dtype == torch.float32 else "tf32"
