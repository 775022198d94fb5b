"""The KV cache's precision: `kv_cache_dtype` (vLLM's `--kv-cache-dtype`: `auto`, `bf16`, `fp8`; docs/quantization.md).

`fp8` is the precision DeepSeek's reference inference code (`inference/model.py`) and FlashMLA's V4 KV format keep
(spec 3.10 and 4.3):
* a KV row (the window rows and the compressed CSA / HCA rows alike, post-norm, post-RoPE): the non-RoPE dims
  [0, d - rope) as FP8 e4m3 in blocks of 64 dims, each block one power-of-two (UE8M0) scale, the smallest 2^e with
  amax / 2^e <= 448; the RoPE dims [d - rope, d) as bf16. V4-Flash: 448 + 128 + 7 scale bytes, padded to 584 B
  per row instead of 1,024.
* an indexer key (CSA layers): turned by the orthonormal Hadamard matrix of its width, then FP4 e2m1 in blocks of
  32 values with power-of-two scales (the smallest 2^e with amax / 2^e <= 6). V4-Flash: 64 + 4 scale bytes
  instead of 256. The query side is turned by the same matrix (`rotate_index_queries`), which leaves every
  score q . k as it was (H H^T = I); only the keys' rounding changes it.
The window rows take the same FP8 form as the compressed rows because the reference rounds a token's kv once,
right after RoPE, before it goes to the window and to attention: so a token attends to its own rounded row too.

Where the rounding happens: every value reaches the cache through two places, `Attention.forward` (a token's kv
row, after `qk_norm_rope`) and `_Pooler.rows` (a closed block's compressed row or indexer key), whatever the
layout (contiguous, paged, CUDA-graph static). In `fp8` mode both pass their rows through `KVPrecision.round_*`
(quantize, then dequantize). Each rounded value is an e4m3 (or e2m1) code times a power of two, which bf16 and
fp32 hold exactly: the cache's pools, in the model dtype, hold the dequantized values without further loss,
and a storage that keeps the codes and scales themselves (fewer bytes) reads back the same values bit for bit.
`kv_row_bytes` / `index_key_bytes` give the bytes of that stored form (`kv_cache.bytes_per_page(precision=..)`).
`bf16` rounds every row to bf16 (a no-op on a bf16 model); `auto` keeps the model dtype (no rounding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from deepserve.core.config import CSA, KV_CACHE_DTYPES

FP8_BLOCK = 64  # non-RoPE dims per FP8 scale (the reference's KV block)
FP4_BLOCK = 32  # indexer-key values per FP4 scale
E4M3_MAX = 448.0
E2M1_MAX = 6.0
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_E2M1_MIDPOINTS = (_E2M1[1:] + _E2M1[:-1]) / 2  # a magnitude on a midpoint goes to the smaller code


def check_kv_cache_dtype(value) -> str:
    """`value` if it is one of `KV_CACHE_DTYPES`, else a ValueError naming the choices."""
    if value not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {value!r}")
    return value


def _pow2_scale(amax: torch.Tensor, limit: float) -> torch.Tensor:
    """Per block, the smallest power of two 2^e with amax / 2^e <= limit (1 for an all-zero block), fp32."""
    safe = torch.where(amax > 0, amax, torch.full_like(amax, limit))
    exponent = torch.ceil(torch.log2(safe.double() / limit)).clamp(-126, 127)
    return torch.pow(2.0, exponent).float()


def _blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, int]:
    """fp32 x [..., n] zero-padded to whole blocks, as [..., n / block, block]; and n."""
    n = x.shape[-1]
    pad = -n % block
    if pad:
        x = torch.cat([x, x.new_zeros(*x.shape[:-1], pad)], dim=-1)
    return x.view(*x.shape[:-1], -1, block), n


def fp8_roundtrip(x: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """x [..., n] through FP8 e4m3 with one power-of-two scale per `block` values of the last dim (the last block
    may be shorter), back to fp32."""
    blocks, n = _blocks(x.float(), block)
    scale = _pow2_scale(blocks.abs().amax(dim=-1, keepdim=True), E4M3_MAX)
    codes = (blocks / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return (codes.float() * scale).flatten(-2)[..., :n]


def fp4_roundtrip(x: torch.Tensor, block: int = FP4_BLOCK) -> torch.Tensor:
    """x [..., n] through FP4 e2m1 (round to nearest, a tie to the smaller magnitude) with one power-of-two scale
    per `block` values of the last dim, back to fp32."""
    blocks, n = _blocks(x.float(), block)
    scale = _pow2_scale(blocks.abs().amax(dim=-1, keepdim=True), E2M1_MAX)
    scaled = blocks / scale
    codes, midpoints = _e2m1_tables(str(x.device))
    magnitude = codes[torch.bucketize(scaled.abs(), midpoints)]
    return (torch.copysign(magnitude, scaled) * scale).flatten(-2)[..., :n]


@lru_cache(maxsize=8)
def _e2m1_tables(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The e2m1 magnitudes and their midpoints on `device`, made once (no host copy inside a CUDA-graph step)."""
    return _E2M1.to(device), _E2M1_MIDPOINTS.to(device)


@lru_cache(maxsize=8)
def _hadamard(dim: int, device: str) -> torch.Tensor:
    """The orthonormal Sylvester-Hadamard matrix of order `dim` (a power of two), fp32, symmetric."""
    h = torch.ones(1, 1)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(dim)).to(device)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] times the orthonormal Hadamard matrix of order n (its own inverse), fp32."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"the indexer's Hadamard rotation needs a power-of-two width, got {n}")
    return x.float() @ _hadamard(n, str(x.device))


@dataclass(frozen=True)
class KVPrecision:
    """How the KV rows of one model are rounded on their way into the cache (see the module docstring).
    `kv_cache_dtype`: `auto`, `bf16` or `fp8`; `rope_dims`: the RoPE dims at the end of every KV row."""

    kv_cache_dtype: str = "auto"
    rope_dims: int = 0

    def __post_init__(self) -> None:
        check_kv_cache_dtype(self.kv_cache_dtype)

    @property
    def fp8(self) -> bool:
        return self.kv_cache_dtype == "fp8"

    def round_kv(self, rows: torch.Tensor) -> torch.Tensor:
        """KV rows [..., d] (window or compressed) as the cache keeps them, in the rows' dtype."""
        if self.kv_cache_dtype == "auto":
            return rows
        if self.kv_cache_dtype == "bf16":
            return rows.to(torch.bfloat16).to(rows.dtype)
        nope = rows.shape[-1] - self.rope_dims
        out = torch.cat([fp8_roundtrip(rows[..., :nope]), rows[..., nope:].to(torch.bfloat16).float()], dim=-1)
        return out.to(rows.dtype)

    def round_index_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """Indexer keys [..., n] as the cache keeps them: fp8 mode keeps them turned by the Hadamard matrix (the
        queries are turned the same way: `rotate_index_queries`), FP4-rounded."""
        if not self.fp8:
            return self.round_kv(keys) if self.kv_cache_dtype == "bf16" else keys
        return fp4_roundtrip(hadamard(keys)).to(keys.dtype)

    def rotate_index_queries(self, q: torch.Tensor) -> torch.Tensor:
        """Indexer queries [..., n] in the keys' frame: turned by the Hadamard matrix in fp8 mode, else as given."""
        return hadamard(q).to(q.dtype) if self.fp8 else q

    # -- the bytes of the stored form (memory accounting) -----------------------------------------------------
    def kv_row_bytes(self, width: int, model_itemsize: int) -> int:
        """Bytes of one stored KV row of `width` dims: fp8 = e4m3 non-RoPE dims + bf16 RoPE dims + one scale
        byte per 64 non-RoPE dims, padded to 8 bytes (V4-Flash: 448 + 128 + 7 -> 584)."""
        if self.kv_cache_dtype == "auto":
            return width * model_itemsize
        if self.kv_cache_dtype == "bf16":
            return width * 2
        nope = width - self.rope_dims
        return _pad8(nope + 2 * self.rope_dims + -(-nope // FP8_BLOCK))

    def index_key_bytes(self, width: int, model_itemsize: int) -> int:
        """Bytes of one stored indexer key: fp8 mode packs two e2m1 codes a byte plus a scale byte per 32
        (V4-Flash: 64 + 4 = 68)."""
        if not self.fp8:
            return self.kv_row_bytes(width, model_itemsize)
        return -(-width // 2) + -(-width // FP4_BLOCK)


def _pad8(n: int) -> int:
    return -(-n // 8) * 8


def use_kv_cache_dtype(model: torch.nn.Module, kv_cache_dtype: str) -> KVPrecision:
    """Give every attention layer and compressor of `model` (main layers and MTP blocks) the rounding of
    `kv_cache_dtype`, and the model its `kv_precision` (which the cache's byte accounting reads)."""
    precision = KVPrecision(check_kv_cache_dtype(kv_cache_dtype), model.cfg.qk_rope_head_dim)
    if precision.fp8:  # the constant tables on the model's device now, not first inside a CUDA-graph capture
        device = model.lm_head.weight.device
        _e2m1_tables(str(device))
        if CSA in model.cfg.layer_types:  # also checks that the indexer's width is a power of two
            hadamard(torch.zeros(1, model.cfg.index_head_dim, device=device))
    for module in model.modules():
        if isinstance(getattr(type(module), "kv_precision", None), KVPrecision):
            module.kv_precision = precision
    model.kv_precision = precision
    return precision
