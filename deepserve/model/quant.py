"""Block-scaled FP8 (e4m3) and FP4 (e2m1) weights of the released DeepSeek-V4 checkpoint (spec section 5.3).

* FP8: `float8_e4m3fn` [out, in] with e8m0 scales [ceil(out/128), ceil(in/128)]:
  `W[i, j] = q[i, j] * 2^(e[i // 128, j // 128] - 127)`.
* FP4 (routed experts): int8 [out, in/2], two e2m1 codes per byte (low nibble = even column), e8m0 scales
  [out, ceil(in/32)], one per 32 inputs. Codes 0-7 are {0, .5, 1, 1.5, 2, 3, 4, 6}; 8-15 the same, negated.

e8m0 scales load whether stored as `torch.float8_e8m0fnu` or as raw `uint8` exponents; float32 scales (used
as plain multipliers) are accepted too. The quantizers are the exact inverses used by tests to write files.
"""

from __future__ import annotations

import torch

FP8_BLOCK = 128
FP4_BLOCK = 32
FP8_MAX = 448.0
FP4_MAX = 6.0
E8M0 = getattr(torch, "float8_e8m0fnu", None)
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_E2M1_LUT = torch.cat([_E2M1, -_E2M1])


def _scale_multipliers(scale: torch.Tensor) -> torch.Tensor:
    """Scale tensor -> fp32 multipliers. e8m0 (or its uint8 bits) means 2^(e-127), computed exactly in fp64."""
    if scale.dtype == torch.uint8 or (E8M0 is not None and scale.dtype == E8M0):
        exponent = scale.view(torch.uint8).to(torch.float64) - 127.0
        return torch.pow(2.0, exponent).to(torch.float32)
    if scale.is_floating_point():
        return scale.to(torch.float32)
    raise TypeError(f"unsupported scale dtype {scale.dtype}; expected float8_e8m0fnu, uint8 or a float type")


def _expand(multipliers: torch.Tensor, rows: int, cols: int, block_rows: int, block_cols: int) -> torch.Tensor:
    full = multipliers.repeat_interleave(block_rows, dim=0).repeat_interleave(block_cols, dim=1)
    return full[:rows, :cols]


def fp8_scale_shape(shape: tuple[int, int] | torch.Size) -> tuple[int, int]:
    """Shape of the 128x128 block-scale grid of an [out, in] FP8 weight (ceil division)."""
    return (-(-shape[0] // FP8_BLOCK), -(-shape[1] // FP8_BLOCK))


def is_fp4(weight: torch.Tensor, scale: torch.Tensor) -> bool:
    """True when `weight` is packed e2m1: int8 [out, in/2] with one scale per 32 unpacked inputs."""
    return (
        weight.dtype in (torch.int8, torch.uint8)
        and weight.dim() == 2 and scale.dim() == 2
        and scale.shape[0] == weight.shape[0]
        and scale.shape[1] == -(-2 * weight.shape[1] // FP4_BLOCK)
    )


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP8 e4m3 [out, in] with 128x128 block scales -> fp32 [out, in]."""
    rows, cols = weight.shape
    if tuple(scale.shape) != fp8_scale_shape(weight.shape):
        raise ValueError(f"FP8 weight {tuple(weight.shape)} needs scales {fp8_scale_shape(weight.shape)}, "
                         f"got {tuple(scale.shape)}")
    mult = _expand(_scale_multipliers(scale), rows, cols, FP8_BLOCK, FP8_BLOCK)
    return weight.to(torch.float32) * mult


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 int8 [out, in/2] with [out, in/32] e8m0 scales -> fp32 [out, in]."""
    rows, half = packed.shape
    raw = packed.view(torch.uint8)
    codes = torch.stack([raw & 0x0F, raw >> 4], dim=-1).reshape(rows, 2 * half)
    values = _E2M1_LUT.to(packed.device)[codes.long()]
    mult = _expand(_scale_multipliers(scale), rows, 2 * half, 1, FP4_BLOCK)
    return values * mult


def dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Dequantize a (weight, scale) pair, telling FP4 from FP8 by dtype and scale shape."""
    if is_fp4(weight, scale):
        return dequantize_fp4(weight, scale)
    if weight.dtype == torch.float8_e4m3fn:
        return dequantize_fp8(weight, scale)
    raise ValueError(f"cannot dequantize a {weight.dtype} weight of shape {tuple(weight.shape)} "
                     f"with scales {tuple(scale.shape)}")


def _e8m0(exponent: torch.Tensor, as_uint8: bool) -> torch.Tensor:
    bits = (exponent + 127).to(torch.uint8)
    return bits if as_uint8 or E8M0 is None else bits.view(E8M0)


def _block_exponent(amax: torch.Tensor, limit: float) -> torch.Tensor:
    """Smallest power-of-two exponent s with amax / 2^s <= limit (0 for all-zero blocks)."""
    safe = torch.where(amax > 0, amax, torch.full_like(amax, limit))
    return torch.ceil(torch.log2(safe.double() / limit)).clamp(-127, 127).to(torch.int32)


def quantize_fp8(weight: torch.Tensor, *, scale_as_uint8: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [out, in] -> (float8_e4m3fn [out, in], e8m0 scales [ceil(out/128), ceil(in/128)])."""
    rows, cols = weight.shape
    grid_r, grid_c = fp8_scale_shape(weight.shape)
    padded = torch.zeros(grid_r * FP8_BLOCK, grid_c * FP8_BLOCK, dtype=torch.float32)
    padded[:rows, :cols] = weight.float().abs()
    amax = padded.view(grid_r, FP8_BLOCK, grid_c, FP8_BLOCK).amax(dim=(1, 3))
    exponent = _block_exponent(amax, FP8_MAX)
    mult = _expand(torch.pow(2.0, exponent.double()).float(), rows, cols, FP8_BLOCK, FP8_BLOCK)
    quant = (weight.float() / mult).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return quant, _e8m0(exponent, scale_as_uint8)


def quantize_fp4(weight: torch.Tensor, *, scale_as_uint8: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [out, in] (in even) -> (packed int8 [out, in/2], e8m0 scales [out, ceil(in/32)]), round to nearest."""
    rows, cols = weight.shape
    if cols % 2:
        raise ValueError(f"FP4 packing needs an even input dim, got {cols}")
    groups = -(-cols // FP4_BLOCK)
    padded = torch.zeros(rows, groups * FP4_BLOCK, dtype=torch.float32)
    padded[:, :cols] = weight.float().abs()
    exponent = _block_exponent(padded.view(rows, groups, FP4_BLOCK).amax(dim=2), FP4_MAX)
    mult = _expand(torch.pow(2.0, exponent.double()).float(), rows, cols, 1, FP4_BLOCK)
    scaled = weight.float() / mult
    magnitude = (scaled.abs().unsqueeze(-1) - _E2M1).abs().argmin(dim=-1).to(torch.uint8)
    codes = magnitude | ((scaled < 0) & (magnitude > 0)).to(torch.uint8) << 3
    pairs = codes.view(rows, cols // 2, 2)
    packed = (pairs[..., 0] | (pairs[..., 1] << 4)).view(torch.int8)
    return packed, _e8m0(exponent, scale_as_uint8)
