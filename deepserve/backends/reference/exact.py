"""Batch-invariant numerics by construction: every result is a function of its own row's values alone.

Library kernels pick their reduction order from the shape they are given and the CPU they run on: BLAS switches
GEMM kernels by row count (on AVX-512 Xeons even past 4 rows), vectorised reductions split a row into vector
bodies and tails, and `exp`/`sin` evaluate the vector body and the tail with different approximations. A token's
result then depends on how many tokens share its batch. The reference backend therefore uses only two things
whose results cannot depend on order, shape or instruction set:

1. **Exact sums.** Values that are integer multiples of one power-of-two unit, with a total below 2^53 units,
   add up exactly in float64 in any order (every partial sum is representable). `matmul` splits each row of the
   left operand and each column of the right one into two slices of 16 bits on such a grid (Ozaki's scheme), so
   that the three slice products BLAS computes in float64 are exact whatever kernel it picks; `grid_sum` puts a
   row on a grid and sums it. Rounding happens once, in a fixed order, after the exact part. The grid depends
   only on the row's own largest value and a fixed bound on the number of terms (`MAX_TERMS`), so padding a row
   with zeros (a longer index list, a wider batch) changes nothing.
2. **IEEE basic operations.** `+ - * /`, `sqrt`, `round`, `floor`, comparisons and `frexp` are correctly rounded
   (or exact) in every vector lane and in scalar code alike. `exp`, `log`, `sin` and `cos` are built from them in
   float64 (range reduction and a polynomial), accurate to a few float64 ulps, so their float32 results are the
   same wherever an element sits and on any CPU or GPU.

Each helper takes any float tensor and returns float64 unless it says otherwise; callers round to their dtype.
"""

from __future__ import annotations

import math
import weakref

import torch

#: the most terms any exact reduction may have (2^21): a grid step of 2^-32 of the row's scale, two 16-bit slices
MAX_TERMS_LOG2 = 21
SLICE_BITS = (53 - MAX_TERMS_LOG2) // 2  # 16: a product of two slices has 32 bits, 2^21 of them fit in 53
SUM_BITS = 53 - MAX_TERMS_LOG2  # 32: a plain sum's slices, 2^21 terms of 32 bits fit in 53


def pow2(e: torch.Tensor) -> torch.Tensor:
    """2**e for integer-valued e in [-1022, 1023], built from the exponent bits (exact; `torch.pow` need not be)."""
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


def _slices(x: torch.Tensor, dim: int, bits: int = SLICE_BITS) -> tuple[torch.Tensor, torch.Tensor]:
    """x (float64) as hi + lo (+ a rest below 2^-2bits of the scale): hi on a grid of scale * 2^-bits, lo on one
    of scale * 2^-2bits, where the scale is the least power of two above every |x| of the row along `dim` (the
    dim the values are reduced over). Each slice is rounded to its grid by adding and subtracting 1.5 * 2^52
    grid steps (exact in float64 for |value| <= scale: round to nearest even, two IEEE adds)."""
    top = torch.linalg.vector_norm(x, ord=math.inf, dim=dim, keepdim=True)  # max |x|
    e = torch.frexp(top).exponent.clamp(-900, 900)  # top < 2^e (e = 0 for a zero row)
    big_hi = pow2(e + (52 - bits)) * 1.5
    hi = (x + big_hi) - big_hi
    big_lo = big_hi * 2.0 ** -bits
    lo = ((x - hi) + big_lo) - big_lo
    return hi, lo


class OwnerCache:
    """Values derived from a tensor, kept while the tensor lives and its version stands (weakly keyed: the value
    goes with the tensor). An inference-mode tensor counts no versions: whoever rewrites one of those in place
    calls `clear()`."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple] = {}  # id(owner) -> (weakref to it, its version, value)

    def get(self, owner: torch.Tensor, make, valid=lambda value: True):
        """The value for `owner`, made by `make(owner)` when there is none, or it is stale or not `valid`."""
        key = id(owner)
        version = -1 if owner.is_inference() else owner._version
        entry = self._entries.get(key)
        if entry is None or entry[0]() is not owner or entry[1] != version or not valid(entry[2]):
            ref = weakref.ref(owner, lambda _, key=key, entries=self._entries: entries.pop(key, None))
            entry = (ref, version, make(owner))
            self._entries[key] = entry
        return entry[2]

    def clear(self) -> None:
        self._entries.clear()


class WeightSlices(OwnerCache):
    """The two slices of each weight a backend multiplies with, made once per weight version: a decode step reads
    its weights once, so slicing them on every call would cost more than the product. Views of a weight (one
    expert of a stacked weight) are served from the slices of the tensor that owns the storage."""

    def slices(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(hi, lo) of `weight` [..., N, K], each row sliced over K, as float64 tensors of weight's shape."""
        owner = weight if weight._base is None else weight._base
        if not (owner.is_contiguous() and owner.dim() >= 1 and owner.shape[-1] == weight.shape[-1]
                and weight.stride(-1) == 1):
            return _slices(weight.double(), -1)  # an odd view: sliced for this call only
        hi, lo = self.get(owner, lambda w: _slices(w.double(), -1))
        offset = weight.storage_offset() - owner.storage_offset()
        return hi.as_strided(weight.shape, weight.stride(), offset), lo.as_strided(weight.shape, weight.stride(), offset)


def matmul(a: torch.Tensor, b: torch.Tensor, b_slices: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """`a @ b` in float64 for a [..., M, K], b [..., K, N] (batch dims broadcast as in torch.matmul), independent
    of the kernel BLAS picks: the slice products hi@hi, hi@lo and lo@hi are exact, then added in that fixed
    order. The error is below 2^-32 of |a|'s row scale times |b|'s column scale per term, far under float32's.
    `b_slices`: b's (hi, lo) when the caller holds them already (`WeightSlices`)."""
    if a.shape[-1] > 1 << MAX_TERMS_LOG2:
        raise ValueError(f"an exact product reduces at most 2^{MAX_TERMS_LOG2} terms, not {a.shape[-1]}")
    if a.shape[-1] == 0:
        return torch.matmul(a.double(), b.double())  # zeros
    a_hi, a_lo = _slices(a.double(), -1)
    b_hi, b_lo = b_slices if b_slices is not None else _slices(b.double(), -2)
    return torch.matmul(a_hi, b_hi) + (torch.matmul(a_hi, b_lo) + torch.matmul(a_lo, b_hi))


def grid_sum(x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    """Sum along `dim` in float64, the terms in two slices on the row's grid (scale * 2^-32, 2^-64): each slice
    sums exactly, so in any order and with any number of extra zeros; the two sums are added once. For sums
    whose terms are not products (norms, softmax denominators)."""
    if x.shape[dim] > 1 << MAX_TERMS_LOG2:
        raise ValueError(f"an exact sum reduces at most 2^{MAX_TERMS_LOG2} terms, not {x.shape[dim]}")
    if x.shape[dim] == 0:
        return x.double().sum(dim=dim, keepdim=keepdim)
    hi, lo = _slices(x.double(), dim, SUM_BITS)
    total = hi.sum(dim=dim, keepdim=True) + lo.sum(dim=dim, keepdim=True)
    return total if keepdim else total.squeeze(dim)


def ordered_sum(x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    """Sum along a short `dim` (mHC streams, top-k weights) in index order, one elementwise add at a time."""
    parts = x.unbind(dim)
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total.unsqueeze(dim) if keepdim else total


def _horner(r: torch.Tensor, coeffs: list[float]) -> torch.Tensor:
    """sum_i coeffs[i] * r**i, highest power first, as separate multiplies and adds (never a fused multiply-add,
    which the scalar and vector paths of one kernel might use differently)."""
    acc = r * coeffs[-1] + coeffs[-2]
    for c in reversed(coeffs[:-2]):
        acc = acc * r + c
    return acc


_LN2_HI = 6.93147180369123816490e-01  # ln 2 to 32 bits: n * _LN2_HI is exact for |n| < 2^21
_LN2_LO = 1.90821492927058770002e-10
_EXP_STEPS = 256  # e**x = 2**n * 2**(j/256) * e**r, |r| <= ln2/512
_EXP_COEFFS = [1.0 / math.factorial(i) for i in range(5)]  # the 5th term is below 4e-17


def _series_exp(x: float) -> float:
    """e**x for |x| < 1 by 20 terms of its series, in Python floats (IEEE double: the same on every machine)."""
    term, total = 1.0, 1.0
    for i in range(1, 20):
        term = term * x / i
        total = total + term
    return total


_EXP2_TABLE = [_series_exp(j * (math.log(2.0) / _EXP_STEPS)) for j in range(_EXP_STEPS)]  # 2**(j/256)
_exp2_tables: dict[torch.device, torch.Tensor] = {}


def exp(x: torch.Tensor) -> torch.Tensor:
    """e**x in float64: x = (256 n + j) ln2/256 + r with |r| <= ln2/512 (Cody-Waite), e**x = 2**n 2**(j/256) e**r,
    e**r by its Taylor polynomial. Inputs are clamped to [-700, 700], so what is beyond float32's range comes
    out as a float64 that rounds to 0 or inf in float32 (-inf gives about 1e-304); nan gives nan."""
    x = x.double()
    table = _exp2_tables.get(x.device)
    if table is None:
        table = _exp2_tables[x.device] = torch.tensor(_EXP2_TABLE, dtype=torch.float64, device=x.device)
    xc = x.clamp(-700.0, 700.0)
    big = torch.round(xc * (_EXP_STEPS / math.log(2.0)))
    r = (xc - big * (_LN2_HI / _EXP_STEPS)) - big * (_LN2_LO / _EXP_STEPS)
    steps = big.to(torch.int64)
    return _horner(r, _EXP_COEFFS) * table[steps & (_EXP_STEPS - 1)] * pow2(steps >> 8)


_LOG_COEFFS = [2.0 / (2 * i + 1) for i in range(12)]  # log m = 2 atanh(s), s = (m-1)/(m+1), |s| <= 0.172


def log(x: torch.Tensor) -> torch.Tensor:
    """Natural log in float64 for x > 0: x = m 2**e with m in [sqrt(1/2), sqrt(2)), log m = 2 atanh((m-1)/(m+1))
    by its series. log(0) = -inf, log(x < 0) = nan, log(inf) = inf."""
    x = x.double()
    m, e = torch.frexp(x)
    low = m < math.sqrt(0.5)
    m = torch.where(low, m * 2.0, m)
    e = (e - low.to(e.dtype)).double()
    s = (m - 1.0) / (m + 1.0)
    out = e * _LN2_HI + (e * _LN2_LO + s * _horner(s * s, _LOG_COEFFS))
    out = torch.where(x == 0, torch.full_like(x, -math.inf), out)
    out = torch.where(x < 0, torch.full_like(x, math.nan), out)
    return torch.where(torch.isinf(x) | torch.isnan(x), x, out)


def log1p_exp_neg(x: torch.Tensor) -> torch.Tensor:
    """log(1 + e**-x) for x >= 0, without losing e**-x when it is small: log1p(y) = log(u) * y / (u - 1)."""
    y = exp(-x.double())
    u = 1.0 + y
    return torch.where(u == 1.0, y, log(u) * (y / (u - 1.0)))


def softplus(x: torch.Tensor) -> torch.Tensor:
    """log(1 + e**x) = max(x, 0) + log(1 + e**-|x|), in float64."""
    x = x.double()
    return x.clamp(min=0.0) + log1p_exp_neg(x.abs())


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + exp(-x.double()))


def silu(x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return x * sigmoid(x)


def rsqrt(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / torch.sqrt(x.double())


# pi/2 in three pieces of 33 bits (as fdlibm splits it): k * piece is exact for |k| < 2^20, i.e. |angle| below ~1.6e6
_PIO2 = (1.57079632673412561417e+00, 6.07710050650619224932e-11, 2.02226624871116645580e-21)
_SIN_COEFFS = [(-1.0) ** i / math.factorial(2 * i + 1) for i in range(10)]  # in r^2, times r; |r| <= pi/4
_COS_COEFFS = [(-1.0) ** i / math.factorial(2 * i) for i in range(11)]


def sincos(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sin x, cos x) in float64: x = k pi/2 + r with |r| <= pi/4, the Taylor polynomials of r, the quadrant k mod
    4 picking and signing them. Accurate for |x| < 1.6e6 (RoPE angles: position * inverse frequency)."""
    x = x.double()
    k = torch.round(x * (2.0 / math.pi))
    r = ((x - k * _PIO2[0]) - k * _PIO2[1]) - k * _PIO2[2]
    r2 = r * r
    s, c = r * _horner(r2, _SIN_COEFFS), _horner(r2, _COS_COEFFS)
    q = torch.nan_to_num(k).to(torch.int64) % 4
    sin = torch.where(q == 0, s, torch.where(q == 1, c, torch.where(q == 2, -s, -c)))
    cos = torch.where(q == 0, c, torch.where(q == 1, -s, torch.where(q == 2, -c, s)))
    return sin, cos


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """softmax along `dim` in float64: e**(x - max) over its grid sum. Entries of -inf get exactly 0, so padding
    a row with -inf changes no other entry."""
    x = x.double()
    top = x.amax(dim=dim, keepdim=True)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    e = exp(x - top)
    return e / grid_sum(e, dim, keepdim=True)
