"""Helpers shared by the kernels."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 operands get full-precision products (the fp32 path must match the CPU oracle); bf16/fp16 products
    are exact in any mode."""
    return "ieee" if dtype == torch.float32 else "tf32"


#: multiprocessors of the GPU (an H100/H200's 132 where CUDA is not up), for the kernels' grid choices
SMS = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count \
    if torch.cuda.is_available() else 132


@triton.jit
def ue8m0(byte):
    """UE8M0 scale bytes as the fp32 powers of two they stand for: the byte is the float's exponent field (byte 0
    reads 0.0 rather than 2^-127)."""
    return (byte.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def ue8m0_bf16(byte):
    """`ue8m0` as bf16, whose exponent field is fp32's: a power of two times an FP8 or FP4 value is exact there."""
    return (byte.to(tl.int16) << 7).to(tl.bfloat16, bitcast=True)
