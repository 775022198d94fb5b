"""Block-scaled FP8 (e4m3) and FP4 (e2m1) weights of the released DeepSeek-V4 checkpoint (spec section 5.3), kept
as stored (`QuantizedWeight`) or dequantized.

* FP8: `float8_e4m3fn` [out, in] with e8m0 scales [ceil(out/bo), ceil(in/bi)] for the config's block
  (bo, bi) (V4: 128x128; V4.1: 32x32): `W[i, j] = q[i, j] * 2^(e[i // bo, j // bi] - 127)`.
* FP4 (routed experts): int8 [out, in/2], two e2m1 codes per byte (low nibble = even column), e8m0 scales
  [out, ceil(in/32)], one per 32 inputs. Codes 0-7 are {0, .5, 1, 1.5, 2, 3, 4, 6}; 8-15 the same, negated.

e8m0 scales load whether stored as `torch.float8_e8m0fnu` or as raw `uint8` exponents; float32 scales (used
as plain multipliers) are accepted too. The quantizers are the exact inverses used by tests and by
`--quantization fp8` on a bf16 checkpoint (DeepSeek's scheme: `is_fp8_linear` names, FP4 routed experts).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

FP8_BLOCK = 128
FP4_BLOCK = 32
FP8_MAX = 448.0
FP4_MAX = 6.0
E8M0 = getattr(torch, "float8_e8m0fnu", None)
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_E2M1_LUT = torch.cat([_E2M1, -_E2M1])
_E2M1_MIDPOINTS = (_E2M1[1:] + _E2M1[:-1]) / 2  # a magnitude on a midpoint goes to the smaller code


class QuantizationConfigError(ValueError):
    """A `quantization_config` deepserve cannot serve as stored; the message names the field."""


@dataclass(frozen=True, slots=True)
class QuantScheme:
    """How weights are stored: FP8 dense projections in `weight_block` blocks, routed experts as `expert_format`
    (`fp4`: e2m1 with one scale per 32 inputs, DeepSeek's and MXFP4's layout; `fp8`: the dense blocks)."""

    weight_block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)
    expert_format: str = "fp4"

    def __post_init__(self) -> None:
        if len(self.weight_block) != 2 or any(isinstance(b, bool) or not isinstance(b, int) or b <= 0
                                              for b in self.weight_block):
            raise QuantizationConfigError(f"weight_block_size must be two positive integers, got "
                                          f"{list(self.weight_block)}")
        if self.expert_format not in ("fp4", "fp8"):
            raise QuantizationConfigError(f"expert_dtype must be 'fp4' or 'fp8', got {self.expert_format!r}")

    @classmethod
    def from_hf(cls, config: dict[str, Any] | None, raw: dict[str, Any] | None = None) -> QuantScheme | None:
        """The scheme of a checkpoint's `quantization_config` as vLLM reads it (`quant_method: fp8`, `fmt: e4m3`,
        `activation_scheme: dynamic`, `weight_block_size`, `scale_fmt: ue8m0`), with DeepSeek's `expert_dtype`
        there or at the top level of config.json (`raw`); None when there is no quantization_config."""
        if config is None:
            return None
        if not isinstance(config, dict):
            raise QuantizationConfigError(f"quantization_config must be an object, got {config!r}")
        method = config.get("quant_method")
        if method != "fp8":
            raise QuantizationConfigError(f"quantization_config.quant_method {method!r} is not supported; deepserve "
                                          "serves block-scaled 'fp8' (DeepSeek's FP8 e4m3 with FP4 experts)")
        checks = (("fmt", ("e4m3",)), ("activation_scheme", ("dynamic",)), ("scale_fmt", ("ue8m0", None)))
        for key, allowed in checks:
            value = config.get(key, allowed[0])
            if value not in allowed:
                raise QuantizationConfigError(f"quantization_config.{key} {value!r} is not supported; expected "
                                              f"{' or '.join(repr(a) for a in allowed if a)}")
        block = config.get("weight_block_size", [FP8_BLOCK, FP8_BLOCK])
        if not isinstance(block, (list, tuple)) or len(block) != 2:
            raise QuantizationConfigError(f"quantization_config.weight_block_size must be [rows, cols], got {block!r}")
        expert = config.get("expert_dtype", (raw or {}).get("expert_dtype", "fp4"))
        return cls(tuple(block), expert)


# DeepSeek's FP8 projections (spec 5.3): the attention's q/kv/o, the indexer's query, the shared expert, the MTP
# block's input projections. Router, compressors, indexer weights, embedding and LM head stay bf16.
_FP8_LINEAR = re.compile(
    r"(self_attn\.(q_a_proj|q_b_proj|kv_proj|o_a_proj|o_b_proj|compressor\.indexer\.q_b_proj)"
    r"|mlp\.shared_experts\.(gate_proj|up_proj|down_proj)|(?:^|\.)[eh]_proj)\.weight$")
_ROUTED = re.compile(r"mlp\.experts\.(gate_up_proj|down_proj)$")


def is_fp8_linear(name: str) -> bool:
    """Whether DeepSeek stores the canonical weight `name` as FP8 (what `--quantization fp8` quantizes)."""
    return bool(_FP8_LINEAR.search(name))


def is_routed_expert(name: str) -> bool:
    """Whether `name` is a stacked routed-expert weight (`...mlp.experts.gate_up_proj` / `down_proj`)."""
    return bool(_ROUTED.search(name))


def scale_name(weight_name: str) -> str:
    """Where a stored weight's scales live: `<param>_scale_inv` (`q_a_proj.weight_scale_inv`, HF's name, and
    `experts.gate_up_proj_scale_inv`)."""
    return weight_name + "_scale_inv"


def _scale_multipliers(scale: torch.Tensor) -> torch.Tensor:
    """Scale tensor -> fp32 multipliers. e8m0 (or its uint8 bits) means 2^(e-127), computed exactly in fp64."""
    if scale.dtype == torch.uint8 or (E8M0 is not None and scale.dtype == E8M0):
        exponent = scale.view(torch.uint8).to(torch.float64) - 127.0
        return torch.pow(2.0, exponent).to(torch.float32)
    if scale.is_floating_point():
        return scale.to(torch.float32)
    raise TypeError(f"unsupported scale dtype {scale.dtype}; expected float8_e8m0fnu, uint8 or a float type")


def _expand(multipliers: torch.Tensor, rows: int, cols: int, block_rows: int, block_cols: int) -> torch.Tensor:
    full = multipliers.repeat_interleave(block_rows, dim=-2).repeat_interleave(block_cols, dim=-1)
    return full[..., :rows, :cols]


def fp8_scale_shape(shape: tuple[int, ...] | torch.Size,
                    block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)) -> tuple[int, ...]:
    """Shape of the block-scale grid of an [..., out, in] FP8 weight (ceil division)."""
    return (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1]))


def fp4_scale_shape(packed_shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
    """Shape of the scales of a packed [..., out, in/2] FP4 weight: one per 32 unpacked inputs."""
    return (*packed_shape[:-1], -(-2 * packed_shape[-1] // FP4_BLOCK))


def is_fp4(weight: torch.Tensor, scale: torch.Tensor) -> bool:
    """True when `weight` is packed e2m1: int8 [..., out, in/2] with one scale per 32 unpacked inputs."""
    return (weight.dtype in (torch.int8, torch.uint8) and weight.dim() >= 2
            and tuple(scale.shape) == fp4_scale_shape(weight.shape))


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor,
                   block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)) -> torch.Tensor:
    """FP8 e4m3 [..., out, in] with block scales -> fp32 [..., out, in]."""
    if tuple(scale.shape) != fp8_scale_shape(weight.shape, block):
        raise ValueError(f"FP8 weight {tuple(weight.shape)} needs scales {fp8_scale_shape(weight.shape, block)} "
                         f"for {block[0]}x{block[1]} blocks, got {tuple(scale.shape)}")
    mult = _expand(_scale_multipliers(scale), weight.shape[-2], weight.shape[-1], *block)
    return weight.to(torch.float32) * mult


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 int8 [..., out, in/2] with [..., out, in/32] e8m0 scales -> fp32 [..., out, in]."""
    *lead, rows, half = packed.shape
    raw = packed.view(torch.uint8)
    codes = torch.stack([raw & 0x0F, raw >> 4], dim=-1).reshape(*lead, rows, 2 * half)
    values = _E2M1_LUT.to(packed.device)[codes.long()]
    mult = _expand(_scale_multipliers(scale), rows, 2 * half, 1, FP4_BLOCK)
    return values * mult


def dequantize(weight: torch.Tensor, scale: torch.Tensor,
               block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)) -> torch.Tensor:
    """Dequantize a (weight, scale) pair, telling FP4 from FP8 by dtype and scale shape."""
    if is_fp4(weight, scale):
        return dequantize_fp4(weight, scale)
    if weight.dtype == torch.float8_e4m3fn:
        return dequantize_fp8(weight, scale, block)
    raise ValueError(f"cannot dequantize a {weight.dtype} weight of shape {tuple(weight.shape)} "
                     f"with scales {tuple(scale.shape)}")


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """A weight kept as stored: `data` FP8 e4m3 [..., N, K] with `block` scales, or packed FP4 int8
    [..., N, K/2] with one scale per 32 inputs (`block` (1, 32)). Leading dims stack experts. What the
    backend's `quantized_*` ops take; `dequantize` is their oracle (bitwise the load-time dequantization)."""

    data: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]

    @property
    def fp4(self) -> bool:
        return self.data.dtype in (torch.int8, torch.uint8)

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical [..., N, K] shape (FP4: twice the packed columns)."""
        *lead, n, k = self.data.shape
        return (*lead, n, 2 * k if self.fp4 else k)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in `dtype`: dequantized in fp32, then cast (as the loader does)."""
        if self.fp4:
            return dequantize_fp4(self.data, self.scale).to(dtype)
        return dequantize_fp8(self.data, self.scale, self.block).to(dtype)

    def expert(self, index: int) -> QuantizedWeight:
        """One expert of a stacked weight."""
        return QuantizedWeight(self.data[index], self.scale[index], self.block)


def check_scale(name: str, weight: torch.Tensor, scale: torch.Tensor, scheme: QuantScheme) -> tuple[int, int]:
    """The block of a stored (weight, scale) pair under `scheme`, or a ValueError naming what does not fit."""
    if weight.dtype in (torch.int8, torch.uint8):
        if tuple(scale.shape) != fp4_scale_shape(weight.shape):
            raise ValueError(f"{name}: packed FP4 weight {tuple(weight.shape)} needs scales "
                             f"{fp4_scale_shape(weight.shape)} (one per {FP4_BLOCK} inputs), got {tuple(scale.shape)}")
        return (1, FP4_BLOCK)
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}: a {weight.dtype} weight has a scale tensor; stored weights are float8_e4m3fn "
                         "or packed int8 FP4")
    block = scheme.weight_block
    if tuple(scale.shape) != fp8_scale_shape(weight.shape, block):
        raise ValueError(f"{name}: FP8 weight {tuple(weight.shape)} with scales {tuple(scale.shape)} does not match "
                         f"the {block[0]}x{block[1]} blocks of weight_block_size (needs "
                         f"{fp8_scale_shape(weight.shape, block)})")
    return block


def _e8m0(exponent: torch.Tensor, as_uint8: bool) -> torch.Tensor:
    bits = (exponent + 127).to(torch.uint8)
    return bits if as_uint8 or E8M0 is None else bits.view(E8M0)


def _block_exponent(amax: torch.Tensor, limit: float) -> torch.Tensor:
    """Smallest power-of-two exponent s with amax / 2^s <= limit (0 for all-zero blocks)."""
    safe = torch.where(amax > 0, amax, torch.full_like(amax, limit))
    return torch.ceil(torch.log2(safe.double() / limit)).clamp(-127, 127).to(torch.int32)


def quantize_fp8(weight: torch.Tensor, *, scale_as_uint8: bool = False,
                 block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [..., out, in] -> (float8_e4m3fn [..., out, in], e8m0 scales [..., ceil(out/bo), ceil(in/bi)])."""
    *lead, rows, cols = weight.shape
    grid = fp8_scale_shape(weight.shape, block)
    padded = torch.zeros(*lead, grid[-2] * block[0], grid[-1] * block[1], dtype=torch.float32, device=weight.device)
    padded[..., :rows, :cols] = weight.float().abs()
    amax = padded.view(*lead, grid[-2], block[0], grid[-1], block[1]).amax(dim=(-3, -1))
    exponent = _block_exponent(amax, FP8_MAX)
    mult = _expand(torch.pow(2.0, exponent.double()).float(), rows, cols, *block)
    quant = (weight.float() / mult).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return quant, _e8m0(exponent, scale_as_uint8)


def quantize_fp4(weight: torch.Tensor, *, scale_as_uint8: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [..., out, in] (in even) -> (packed int8 [..., out, in/2], e8m0 scales [..., out, ceil(in/32)]), round
    to nearest (a tie to the smaller magnitude)."""
    *lead, rows, cols = weight.shape
    if cols % 2:
        raise ValueError(f"FP4 packing needs an even input dim, got {cols}")
    groups = -(-cols // FP4_BLOCK)
    padded = torch.zeros(*lead, rows, groups * FP4_BLOCK, dtype=torch.float32, device=weight.device)
    padded[..., :cols] = weight.float().abs()
    exponent = _block_exponent(padded.view(*lead, rows, groups, FP4_BLOCK).amax(dim=-1), FP4_MAX)
    mult = _expand(torch.pow(2.0, exponent.double()).float(), rows, cols, 1, FP4_BLOCK)
    scaled = weight.float() / mult
    magnitude = torch.bucketize(scaled.abs(), _E2M1_MIDPOINTS.to(weight.device)).to(torch.uint8)
    codes = magnitude | ((scaled < 0) & (magnitude > 0)).to(torch.uint8) << 3
    pairs = codes.view(*lead, rows, cols // 2, 2)
    packed = (pairs[..., 0] | (pairs[..., 1] << 4)).view(torch.int8)
    return packed, _e8m0(exponent, scale_as_uint8)


def quantize_stored(name: str, tensor: torch.Tensor, scheme: QuantScheme) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(data, scales) for a bf16/fp32 canonical tensor that `scheme` stores quantized (DeepSeek's FP8 projections
    in the scheme's blocks; routed experts as its `expert_format`), else None."""
    if is_routed_expert(name):
        if scheme.expert_format == "fp4":
            return quantize_fp4(tensor)
        return quantize_fp8(tensor, block=scheme.weight_block)
    if is_fp8_linear(name):
        return quantize_fp8(tensor, block=scheme.weight_block)
    return None
