"""The KV cache's precision: `kv_cache_dtype` (vLLM's `--kv-cache-dtype`: `auto`, `bf16`, `fp8`; docs/quantization.md).

`fp8` is the precision DeepSeek's reference inference code (`inference/model.py`) and FlashMLA's V4 KV format keep
(spec 3.10 and 4.3):
* a KV row (the window rows and the compressed CSA / HCA rows alike, post-norm, post-RoPE): the non-RoPE dims
  [0, d - rope) as FP8 e4m3 in blocks of 64 dims, each block one power-of-two (UE8M0) scale, the smallest 2^e with
  amax / 2^e <= 448; the RoPE dims [d - rope, d) as bf16. V4-Flash: 448 + 128 + 7 scale bytes, padded to 592 B
  per row instead of 1,024 (16-byte rows: a row is then FlashMLA's one-token MODEL1 block, read in place).
* an indexer key (CSA layers): turned by the orthonormal Hadamard matrix of its width, then FP4 e2m1 in blocks of
  32 values with power-of-two scales (the smallest 2^e with amax / 2^e <= 6). V4-Flash: 64 + 4 scale bytes
  instead of 256. The query side is turned by the same matrix (`rotate_index_queries`), which leaves every
  score q . k as it was (H H^T = I); only the keys' rounding changes it.
The window rows take the same FP8 form as the compressed rows because the reference rounds a token's kv once,
right after RoPE, before it goes to the window and to attention: so a token attends to its own rounded row too.

Where the rounding happens: every value reaches the cache through two places, `Attention.forward` (a token's kv
row, after `qk_norm_rope`) and `_Pooler.rows` (a closed block's compressed row or indexer key), whatever the
layout (contiguous, paged, CUDA-graph static). In `fp8` mode both pass their rows through `KVPrecision.round_*`
(quantize, then dequantize), so the activations see the rounded rows whatever holds them.

What the paged cache's pools hold is the stored form itself (`RowCodec`, per pool: `kv_codec`, `index_key_codec`):
`FP8Rows` keeps a KV row as its e4m3 code bytes, its RoPE dims as bf16 and one scale byte per 64 dims
(`kv_row_bytes`), `FP4Keys` an indexer key as e2m1 nibbles and one scale byte per 32 (`index_key_bytes`). Each
rounded value is a code times a power of two, so encoding a rounded row again gives back the same values, and a
read decodes to exactly the values the rounding made, at the model dtype (bit for bit the emulated cache's, which
kept them unpacked: tests/test_kv_fp8_packed.py). The layouts hand the attention and the indexer the stored rows
and their codec (`Backend.sparse_attention_packed`, `indexer_topk_packed`): a backend's kernels read them packed
(`stored_format`), the defaults decode what a step reads (`RowCodec.gather`, `gather_pages`). `bf16` keeps bf16
rows (`PlainRows`; a no-op on a bf16 model); `auto` keeps the model dtype (no rounding; the stored rows are the
values, `holds_values`).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
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


def _pow2_exponent(amax: torch.Tensor, limit: float) -> torch.Tensor:
    """Per block, the e of the smallest power of two 2^e with amax / 2^e <= limit (0 for an all-zero block), in
    [-126, 127], as float64."""
    safe = torch.where(amax > 0, amax, torch.full_like(amax, limit))
    return torch.ceil(torch.log2(safe.double() / limit)).clamp(-126, 127)


def _pow2_scale(amax: torch.Tensor, limit: float) -> torch.Tensor:
    """Per block, the smallest power of two 2^e with amax / 2^e <= limit (1 for an all-zero block), fp32."""
    return torch.pow(2.0, _pow2_exponent(amax, limit)).float()


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


def hadamard_matrix(n: int, device) -> torch.Tensor:
    """The orthonormal Hadamard matrix of order n [n, n] fp32 on `device` (made once): `hadamard(x)` is x @ it."""
    if n & (n - 1):
        raise ValueError(f"the indexer's Hadamard rotation needs a power-of-two width, got {n}")
    return _hadamard(n, str(torch.device(device)))


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
        return fp4_roundtrip(self.turn_index_keys(keys)).to(keys.dtype)

    def turn_index_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """Indexer keys [..., n] in the frame the cache keeps them in, not rounded: Hadamard-turned (fp32) in fp8
        mode, else as given."""
        return hadamard(keys) if self.fp8 else keys

    def rotate_index_queries(self, q: torch.Tensor) -> torch.Tensor:
        """Indexer queries [..., n] in the keys' frame: turned by the Hadamard matrix in fp8 mode, else as given."""
        return hadamard(q).to(q.dtype) if self.fp8 else q

    # -- the bytes of the stored form (memory accounting) -----------------------------------------------------
    def kv_row_bytes(self, width: int, model_itemsize: int) -> int:
        """Bytes of one stored KV row of `width` dims: fp8 = e4m3 non-RoPE dims + bf16 RoPE dims + one scale
        byte per 64 non-RoPE dims, padded to 16 bytes (V4-Flash: 448 + 128 + 7 -> 592). 16, not 8: FlashMLA's
        sparse decode reads a row's values with 16-byte loads, so every row must start 16-byte aligned for it to
        read the pools in place as one-token blocks (`backends/nvidia/vendor.py`, `FlashMlaDecode`)."""
        if self.kv_cache_dtype == "auto":
            return width * model_itemsize
        if self.kv_cache_dtype == "bf16":
            return width * 2
        nope = width - self.rope_dims
        return _pad16(nope + 2 * self.rope_dims + -(-nope // FP8_BLOCK))

    # -- the stored form itself (the paged pools) --------------------------------------------------------------
    def kv_codec(self, width: int, dtype: torch.dtype) -> RowCodec:
        """How the cache's pools keep KV rows of `width` dims for a model of `dtype`: `kv_row_bytes` a row."""
        if self.fp8:
            return FP8Rows(width, self.rope_dims, dtype)
        return PlainRows(width, dtype, torch.bfloat16 if self.kv_cache_dtype == "bf16" else dtype)

    def index_key_codec(self, width: int, dtype: torch.dtype) -> RowCodec:
        """How the cache's pools keep indexer keys of `width` values: `index_key_bytes` a key."""
        return FP4Keys(width, dtype) if self.fp8 else self.kv_codec(width, dtype)

    def index_key_bytes(self, width: int, model_itemsize: int) -> int:
        """Bytes of one stored indexer key: fp8 mode packs two e2m1 codes a byte plus a scale byte per 32
        (V4-Flash: 64 + 4 = 68)."""
        if not self.fp8:
            return self.kv_row_bytes(width, model_itemsize)
        return -(-width // 2) + -(-width // FP4_BLOCK)


def _pad16(n: int) -> int:
    return -(-n // 16) * 16


# -- the stored form: what the paged pools hold ------------------------------------------------------------------
class RowCodec(ABC):
    """How a pool keeps rows of `width` values at `dtype`: `encode(rows [..., width])` gives the stored rows
    [..., stored_width] of `storage_dtype`, `decode(stored)` the values at `dtype` again, bit for bit the ones
    `KVPrecision` rounds a row to (so a rounded row survives the trip unchanged). `holds_values`: the stored rows
    are the values themselves, so kernels may read and write the pool in place."""

    width: int
    dtype: torch.dtype
    storage_dtype: torch.dtype
    stored_width: int
    holds_values = False
    #: the stored form's name, which backends' kernels that read it match on (they import nothing from the model)
    stored_format = "plain"

    @abstractmethod
    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows [..., width] (any float dtype) -> stored rows [..., stored_width] of `storage_dtype`."""

    @abstractmethod
    def decode(self, stored: torch.Tensor) -> torch.Tensor:
        """Stored rows [..., stored_width] -> their values [..., width] at `dtype`."""

    def gather(self, stored: torch.Tensor, rows: torch.Tensor, fixed_shape: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(pool, indices) standing for the stored rows `rows` [T, K] (-1 = none) of `stored` [N, stored_width],
        for `Backend.sparse_attention`: the storage itself where it holds the values; else only the rows named,
        decoded. `fixed_shape` (a CUDA graph's step) decodes one row per entry, so that nothing is sized from
        values; otherwise each distinct row is decoded once (a prompt chunk's queries share most of their keys)."""
        if self.holds_values:
            return stored, rows
        if fixed_shape:
            entry = torch.arange(rows.numel(), device=rows.device).view_as(rows)
            return self.decode(stored[rows.clamp(min=0).flatten()]), torch.where(rows >= 0, entry, rows)
        distinct, entry = torch.unique(rows.clamp(min=0), return_inverse=True)
        return self.decode(stored[distinct]), torch.where(rows >= 0, entry, rows)

    def gather_pages(self, pages: torch.Tensor, tables: torch.Tensor, query_rows: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(pages, tables) for `Backend.indexer_topk_paged` standing for the stored pages [num_pages, rpp,
        stored_width] read through `tables` [B, P], query t reading row `query_rows[t]` (row t when None): the
        pages of each table row decoded, [B * P, rpp, width], and per query its row's numbers of them, [T, P].
        Shapes from B, P and T only (a CUDA graph's step takes it)."""
        numbered = torch.arange(tables.numel(), device=tables.device).view_as(tables)
        decoded = self.decode(pages[tables]).flatten(0, 1)
        return decoded, numbered if query_rows is None else numbered[query_rows]


class PlainRows(RowCodec):
    """Rows kept as floats of `storage_dtype` (`auto`: the model dtype; `bf16`: bfloat16)."""

    def __init__(self, width: int, dtype: torch.dtype, storage_dtype: torch.dtype) -> None:
        self.width, self.dtype, self.storage_dtype, self.stored_width = width, dtype, storage_dtype, width
        self.holds_values = storage_dtype == dtype

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.to(self.storage_dtype)

    def decode(self, stored: torch.Tensor) -> torch.Tensor:
        return stored if self.holds_values else stored.to(self.dtype)


class FP8Rows(RowCodec):
    """A KV row as bytes (FlashMLA's V4 order): the non-RoPE dims' e4m3 codes, the RoPE dims as bf16, one UE8M0
    scale byte (exponent + 127) per 64 non-RoPE dims, zero padding to `KVPrecision.kv_row_bytes`."""

    storage_dtype = torch.uint8
    stored_format = "fp8"

    def __init__(self, width: int, rope_dims: int, dtype: torch.dtype) -> None:
        self.width, self.dtype = width, dtype
        self.nope, self.rope = width - rope_dims, rope_dims
        self.num_scales = -(-self.nope // FP8_BLOCK)
        self.stored_width = _pad16(self.nope + 2 * self.rope + self.num_scales)

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        blocks, n = _blocks(rows[..., : self.nope].float(), FP8_BLOCK)
        exponent = _pow2_exponent(blocks.abs().amax(dim=-1, keepdim=True), E4M3_MAX)
        scaled = blocks / torch.pow(2.0, exponent).float()  # as `fp8_roundtrip` divides
        codes = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).flatten(-2)[..., :n].view(torch.uint8)
        rope = rows[..., self.nope :].to(torch.bfloat16).contiguous().view(torch.uint8)
        scales = (exponent[..., 0] + 127).to(torch.uint8)
        pad = codes.new_zeros(*codes.shape[:-1], self.stored_width - n - 2 * self.rope - self.num_scales)
        return torch.cat([codes, rope, scales, pad], dim=-1)

    def decode(self, stored: torch.Tensor) -> torch.Tensor:
        nope, end = self.nope, self.nope + 2 * self.rope
        codes, _ = _blocks(stored[..., :nope].view(torch.float8_e4m3fn).float(), FP8_BLOCK)
        values = (codes * _ue8m0(stored[..., end : end + self.num_scales])[..., None]).flatten(-2)[..., :nope]
        rope = stored[..., nope:end].contiguous().view(torch.bfloat16).float()
        return torch.cat([values, rope], dim=-1).to(self.dtype)


class FP4Keys(RowCodec):
    """An indexer key (already turned by the Hadamard matrix) as bytes: its e2m1 codes two a byte, low nibble
    first (bit 3 the sign, bits 0-2 the magnitude's index in 0, .5, 1, 1.5, 2, 3, 4, 6), then one UE8M0 scale
    byte per 32 values."""

    storage_dtype = torch.uint8
    stored_format = "fp4"

    def __init__(self, width: int, dtype: torch.dtype) -> None:
        self.width, self.dtype = width, dtype
        self.num_scales = -(-width // FP4_BLOCK)
        self.stored_width = -(-width // 2) + self.num_scales

    def encode(self, keys: torch.Tensor) -> torch.Tensor:
        blocks, n = _blocks(keys.float(), FP4_BLOCK)
        exponent = _pow2_exponent(blocks.abs().amax(dim=-1, keepdim=True), E2M1_MAX)
        scaled = blocks / torch.pow(2.0, exponent).float()  # as `fp4_roundtrip` divides
        _, midpoints = _e2m1_tables(str(keys.device))
        sign = torch.signbit(scaled).to(torch.uint8) << 3  # kept for a zero too: -0.0 reads back as -0.0
        nibbles = torch.bucketize(scaled.abs(), midpoints).to(torch.uint8) | sign
        nibbles = nibbles.flatten(-2)[..., : n + n % 2]  # an odd width: one zero nibble more
        return torch.cat([nibbles[..., 0::2] | (nibbles[..., 1::2] << 4), (exponent[..., 0] + 127).to(torch.uint8)],
                         dim=-1)

    def decode(self, stored: torch.Tensor) -> torch.Tensor:
        n, half = self.width, -(-self.width // 2)
        packed = stored[..., :half]
        nibbles = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)[..., :n]
        codes, _ = _e2m1_tables(str(stored.device))
        magnitude = codes[(nibbles & 7).long()]
        signed, _ = _blocks(torch.where((nibbles & 8) > 0, -magnitude, magnitude), FP4_BLOCK)
        return (signed * _ue8m0(stored[..., half:])[..., None]).flatten(-2)[..., :n].to(self.dtype)


def _ue8m0(scales: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes (exponent + 127) as the fp32 powers of two they stand for: the byte is the float's exponent
    field, so this is exact (no exp2 rounding)."""
    return (scales.to(torch.int32) << 23).view(torch.float32)


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
