"""Helpers shared by the kernels."""

from __future__ import annotations

import torch


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 operands get full-precision products (the fp32 path must match the CPU oracle); bf16/fp16 products
    are exact in any mode."""
    return "ieee" if dtype == torch.float32 else "tf32"


#: multiprocessors of the GPU (an H100/H200's 132 where CUDA is not up), for the kernels' grid choices
SMS = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count \
    if torch.cuda.is_available() else 132
