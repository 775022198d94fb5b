"""Kernels that write the FP8 KV cache's packed rows (`--kv-cache-dtype fp8`, deepserve/model/kv_precision.py): a
step's rows encoded and stored in one launch, where `RowCodec.encode` then `index_put_` take about fifteen torch
ops (block maxima, exponents, scaling, clamping, the e4m3 / e2m1 conversion, the RoPE dims to bf16, the
concatenation, the scatter), three times per layer in a decode step.

* `store_fp8_rows`: KV rows as `FP8Rows` (e4m3 codes of the non-RoPE dims in blocks of 64 with a UE8M0 scale
  byte each, the RoPE dims as bf16, zero padding);
* `store_fp4_keys`: indexer keys (already turned by the Hadamard matrix) as `FP4Keys` (e2m1 nibbles, low first,
  a scale byte per 32).

Bit for bit the codecs' bytes (tests/test_kv_fp8_triton.py checks them equal, edge values included): every
rounding is done in integer arithmetic on the fp32 bits, as the codecs' torch ops round (a block's exponent
from the bits of its maximum, e4m3 and bf16 to nearest even, e2m1 by counting the midpoints below, a tie to the
smaller magnitude), and the scaling is a product by an exact power of two, the same value as the codecs'
division by one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_BLOCK, FP4_BLOCK = 64, 32


@triton.jit
def _pow2_exponent(amax, LIMIT_EXP: tl.constexpr, LIMIT_MANTISSA: tl.constexpr):
    """Per block, the e of the smallest power of two with amax / 2^e <= limit, where limit = (1 + LIMIT_MANTISSA /
    2^23) * 2^LIMIT_EXP (448: 8 and 0x600000; 6: 2 and 0x400000): amax = m 2^E needs e = E - LIMIT_EXP, one more
    where m is above the limit's mantissa. 0 for an all-zero block; within [-126, 127] (`kv_precision._pow2_exponent`)."""
    bits = amax.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 - LIMIT_EXP + ((bits & 0x7FFFFF) > LIMIT_MANTISSA).to(tl.int32)
    e = tl.where(amax > 0, e, 0)
    return tl.minimum(tl.maximum(e, -126), 127)


@triton.jit
def _inverse_pow2(e):
    """2^-e as fp32 for e in [-126, 126] (a finite block never needs 127): its exponent field."""
    return ((127 - e) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_bytes(y):
    """fp32 values within [-448, 448] as e4m3 bytes, to nearest even (the sign kept for a zero)."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude = bits & 0x7FFFFFFF
    # normal codes (|y| >= 2^-6): the fp32 mantissa rounded to 3 bits (a carry moves the exponent), rebiased 127 -> 7
    normal = ((magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) >> 20) - (120 << 3)
    # subnormal codes: multiples of 2^-9; adding and taking away 2^23 rounds |y| 2^9 < 8 to an integer, nearest even
    scaled = magnitude.to(tl.float32, bitcast=True) * 512.0
    subnormal = ((scaled + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(magnitude >= 0x3C800000, normal, subnormal)  # 0x3C800000: 2^-6
    return (sign | code).to(tl.uint8)


@triton.jit
def _bf16_bits(x):
    """fp32 values as the bits of bf16, to nearest even."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16)


@triton.jit
def _e2m1_nibbles(s):
    """Values within [-6, 6] as e2m1 nibbles: bit 3 the sign (kept for a zero), bits 0-2 the number of midpoints of
    0, .5, 1, 1.5, 2, 3, 4, 6 below the magnitude (`torch.bucketize`: a magnitude on a midpoint goes down)."""
    a = tl.abs(s)
    index = ((a > 0.25).to(tl.int32) + (a > 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
             + (a > 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a > 3.5).to(tl.int32) + (a > 5.0).to(tl.int32))
    sign = (s.to(tl.int32, bitcast=True) >> 28) & 0x8
    return sign | index


@triton.jit
def _load_fp32(ptr, mask, BF16_BITS: tl.constexpr):
    """Values as fp32; with BF16_BITS, `ptr` reads bf16 values as int16 and widens their bits (exact, subnormals
    included, whatever the conversion of the platform: Triton's interpreter loses bf16 subnormals' low bits)."""
    if BF16_BITS:
        return (tl.load(ptr, mask=mask, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return tl.load(ptr, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _destination(dest_ptr, base, i, HAS_DEST: tl.constexpr):
    if HAS_DEST:
        return tl.load(dest_ptr + i).to(tl.int64)
    return (base + i).to(tl.int64)


@triton.jit
def store_fp8_tile(x, dims, dst, dst16, NOPE: tl.constexpr, ROPE: tl.constexpr, NUM_SCALES: tl.constexpr,
                   WIDTH: tl.constexpr):
    """One row's fp32 values x [blocks, block] (dim numbers `dims`; a block of 64 dims, or the whole row where it
    is shorter; dims past the row masked by the caller with zeros) stored as `FP8Rows` bytes at `dst` (uint8;
    `dst16` the same row start as int16): e4m3 codes and a scale byte per 64 non-RoPE dims, the RoPE dims as
    bf16, zero padding to WIDTH bytes."""
    nope = dims < NOPE
    e = _pow2_exponent(tl.max(tl.where(nope, tl.abs(x), 0.0), axis=1), 8, 0x600000)
    y = tl.minimum(tl.maximum(x * _inverse_pow2(e)[:, None], -448.0), 448.0)
    tl.store(dst + dims, _e4m3_bytes(y), mask=nope)
    # RoPE dim j is the bf16 at byte NOPE + 2 (j - NOPE): element j - NOPE / 2 of the row's int16 view
    tl.store(dst16 + dims - NOPE // 2, _bf16_bits(x), mask=(dims >= NOPE) & (dims < NOPE + ROPE))
    b = tl.arange(0, x.shape[0])
    tl.store(dst + NOPE + 2 * ROPE + b, (e + 127).to(tl.uint8), mask=b < NUM_SCALES)
    pad = NOPE + 2 * ROPE + NUM_SCALES + tl.arange(0, 16)
    tl.store(dst + pad, tl.zeros([16], dtype=tl.uint8), mask=pad < WIDTH)


@triton.jit
def store_fp4_tile(lo, hi, pairs, dst, N: tl.constexpr, NUM_SCALES: tl.constexpr):
    """One key's fp32 values in pairs (lo = values 2j, hi = values 2j + 1, [blocks, 16]: a block of 32 values, or
    the whole key where it is shorter; `pairs` the byte numbers j; values past the key zero) stored as `FP4Keys`
    bytes at `dst`: a byte a pair, low nibble first, then a scale byte per 32 values."""
    e = _pow2_exponent(tl.maximum(tl.max(tl.abs(lo), axis=1), tl.max(tl.abs(hi), axis=1)), 2, 0x400000)
    inverse = _inverse_pow2(e)[:, None]
    packed = _e2m1_nibbles(lo * inverse) | (_e2m1_nibbles(hi * inverse) << 4)
    tl.store(dst + pairs, packed.to(tl.uint8), mask=2 * pairs < N)
    b = tl.arange(0, lo.shape[0])
    tl.store(dst + (N + 1) // 2 + b, (e + 127).to(tl.uint8), mask=b < NUM_SCALES)


@triton.jit
def _store_fp8_rows_kernel(x_ptr, dest_ptr, out_ptr, out16_ptr, base, stride_x, stride_out,
                           D: tl.constexpr, NOPE: tl.constexpr, NUM_SCALES: tl.constexpr, WIDTH: tl.constexpr,
                           BLOCKS: tl.constexpr, HAS_DEST: tl.constexpr, BF16_BITS: tl.constexpr):
    """Row i of x into storage row `dest[i]` (`base + i` without dest): the codes, the RoPE dims, the scale bytes,
    the padding, every byte of the row."""
    i = tl.program_id(0)
    row = _destination(dest_ptr, base, i, HAS_DEST)
    dims = tl.arange(0, BLOCKS)[:, None] * 64 + tl.arange(0, 64)[None, :]
    x = _load_fp32(x_ptr + i.to(tl.int64) * stride_x + dims, dims < D, BF16_BITS)
    store_fp8_tile(x, dims, out_ptr + row * stride_out, out16_ptr + row * (stride_out // 2), NOPE, D - NOPE,
                   NUM_SCALES, WIDTH)


@triton.jit
def _store_fp4_keys_kernel(x_ptr, dest_ptr, out_ptr, base, stride_x, stride_out,
                           N: tl.constexpr, NUM_SCALES: tl.constexpr, BLOCKS: tl.constexpr, HAS_DEST: tl.constexpr,
                           BF16_BITS: tl.constexpr):
    """Key i of x into storage row `dest[i]` (`base + i` without dest)."""
    i = tl.program_id(0)
    row = _destination(dest_ptr, base, i, HAS_DEST)
    src = x_ptr + i.to(tl.int64) * stride_x
    pairs = tl.arange(0, BLOCKS)[:, None] * 16 + tl.arange(0, 16)[None, :]
    lo = _load_fp32(src + 2 * pairs, 2 * pairs < N, BF16_BITS)
    hi = _load_fp32(src + 2 * pairs + 1, 2 * pairs + 1 < N, BF16_BITS)
    store_fp4_tile(lo, hi, pairs, out_ptr + row * stride_out, N, NUM_SCALES)


def _launch_args(x: torch.Tensor, storage: torch.Tensor, dest: torch.Tensor | None, base: int):
    if storage.dtype != torch.uint8 or storage.dim() != 2 or storage.stride(1) != 1:
        raise ValueError("a packed storage is [rows, bytes] of uint8 with contiguous rows")
    x = x if x.stride(-1) == 1 else x.contiguous()
    dest_arg = dest.contiguous() if dest is not None else x  # (unused without dest)
    bf16 = x.dtype == torch.bfloat16
    return (x.view(torch.int16) if bf16 else x), dest_arg, bf16


def store_fp8_rows(x: torch.Tensor, storage: torch.Tensor, nope: int, dest: torch.Tensor | None = None,
                   base: int = 0) -> None:
    """Rows x [n, d] (any float dtype; the last d - nope dims RoPE) encoded as `FP8Rows` into storage rows `dest`
    [n] (or base .. base + n) of storage [N, row bytes] uint8."""
    n, d = x.shape
    rope, num_scales = d - nope, -(-nope // FP8_BLOCK)
    if nope % 2 or storage.shape[1] < nope + 2 * rope + num_scales or storage.stride(0) % 2:
        raise ValueError(f"FP8 rows of {d} dims ({nope} FP8) do not fit rows of {storage.shape[1]} bytes")
    if n == 0:
        return
    x, dest_arg, bf16 = _launch_args(x, storage, dest, base)
    _store_fp8_rows_kernel[(n,)](
        x, dest_arg, storage, storage.view(torch.int16), base, x.stride(0), storage.stride(0),
        D=d, NOPE=nope, NUM_SCALES=num_scales, WIDTH=storage.shape[1], BLOCKS=triton.next_power_of_2(-(-d // 64)),
        HAS_DEST=dest is not None, BF16_BITS=bf16, num_warps=4,
    )


def store_fp4_keys(x: torch.Tensor, storage: torch.Tensor, dest: torch.Tensor | None = None, base: int = 0) -> None:
    """Keys x [n, width] (already turned) encoded as `FP4Keys` into storage rows `dest` [n] (or base .. base + n)
    of storage [N, key bytes] uint8."""
    n, width = x.shape
    num_scales = -(-width // FP4_BLOCK)
    if storage.shape[1] != -(-width // 2) + num_scales:
        raise ValueError(f"FP4 keys of {width} values do not fit rows of {storage.shape[1]} bytes")
    if n == 0:
        return
    x, dest_arg, bf16 = _launch_args(x, storage, dest, base)
    _store_fp4_keys_kernel[(n,)](
        x, dest_arg, storage, base, x.stride(0), storage.stride(0), N=width, NUM_SCALES=num_scales,
        BLOCKS=triton.next_power_of_2(num_scales), HAS_DEST=dest is not None, BF16_BITS=bf16, num_warps=1,
    )
