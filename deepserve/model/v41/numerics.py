"""V4.1's stored and simulated precisions, as the released kernels define them (v41-architecture.md §3, §8).

V4.1 fake-quantizes activations everywhere (FP8 before every FP8/FP4 GEMM, FP8 window keys, FP4 compressed keys
and index q/k) and its outputs move by whole quantization steps under one-ulp changes, so deepserve's V4.1 path
keeps the reference's dataflow: bf16 activations, fp32 accumulation per 32-wide K block, UE8M0 power-of-two scales
rounded up, round-to-nearest-even casts that saturate, and attention's online softmax over blocks of 64 keys with
bf16 probabilities. These are plain torch ops (CPU or CUDA).
"""

from __future__ import annotations

import math
import weakref

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
BLOCK = 32  # FP8 weight tiles are 32x32; activations and FP4 weights are scaled per 32 along K
ATTN_BLOCK = 64  # attention walks its key list 64 entries at a time (online softmax)
_INV_FP8 = torch.tensor(1.0 / FP8_MAX, dtype=torch.float32)
_INV_FP4 = torch.tensor(1.0 / FP4_MAX, dtype=torch.float32)
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float32)


def pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """2**ceil(log2(x)) for positive normal fp32 x, exactly (the UE8M0 scale rule)."""
    mant, exp = torch.frexp(x.float())
    exp = torch.where(mant == 0.5, exp - 1, exp)
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), exp)


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> e4m3 (as fp32 values), round-to-nearest-even, saturating at ±448."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()


def round_e2m1(v: torch.Tensor) -> torch.Tensor:
    """fp32 in [-6, 6] -> the nearest e2m1 value (ties to even), sign (and -0) kept. Each binade of e2m1 has
    a fixed step (0.5 below 2, 1 below 4, 2 up to 6), so rounding in that step is the format's RNE."""
    a = v.abs()
    r = torch.where(a < 2, torch.round(a * 2) / 2, torch.where(a < 4, torch.round(a), torch.round(a / 2) * 2))
    return torch.copysign(r, v)


def fp8_fake_quant(x: torch.Tensor) -> torch.Tensor:
    """bf16 [..., K] -> the bf16 values of its FP8 e4m3 form with one UE8M0 scale per 32 (window keys)."""
    q, s = fp8_quant(x)
    return (q * s.unsqueeze(-1)).flatten(-2).to(x.dtype)


def fp8_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 [..., K] -> (e4m3 values as fp32 [..., K/32, 32], fp32 scales [..., K/32])."""
    g = x.float().unflatten(-1, (-1, BLOCK))
    s = pow2_ceil(g.abs().amax(-1).clamp_min(1e-4) * _INV_FP8)
    return to_e4m3(g / s.unsqueeze(-1)), s


def fp4_fake_quant(x: torch.Tensor, group: int, e4m3_scale: bool) -> torch.Tensor:
    """bf16 [..., K] -> the bf16 values of its e2m1 form: groups of `group`, with E4M3 scales (amax/6, floored
    at 6*2^-9: compressed KV) or UE8M0 scales (index q and keys)."""
    g = x.float().unflatten(-1, (-1, group))
    amax = g.abs().amax(-1)
    if e4m3_scale:
        s = to_e4m3(amax.clamp_min(6 * 2.0**-9) / FP4_MAX)
    else:
        s = pow2_ceil(amax.clamp_min(6 * 2.0**-126) * _INV_FP4)
    v = (g / s.unsqueeze(-1)).clamp(-FP4_MAX, FP4_MAX)
    return (round_e2m1(v) * s.unsqueeze(-1)).flatten(-2).to(x.dtype)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """int8/uint8 [N, K/2], two e2m1 codes a byte (low nibble = even element) -> fp32 [N, K]."""
    b = packed.view(torch.uint8).long()
    table = torch.cat([_E2M1, -_E2M1]).to(packed.device)
    return torch.stack([table[b & 0xF], table[b >> 4]], dim=-1).flatten(-2)


def dequant_fp8_tiles(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 [N, K] with UE8M0 [ceil(N/32), ceil(K/32)] -> fp32 [N, K]."""
    n, k = w.shape
    s = scale.float().repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
    return w.float() * s


def _block_gemm(a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor) -> torch.Tensor:
    """sum over 32-wide K blocks of (A_k @ B_k^T) * a_s[:, k] * b_s[:, k], added in K order in fp32."""
    m, k = a.shape
    acc = torch.zeros(m, b.shape[0], dtype=torch.float32, device=a.device)
    for blk in range(k // BLOCK):
        cols = slice(blk * BLOCK, (blk + 1) * BLOCK)
        acc += (a[:, cols] @ b[:, cols].T) * a_s[:, blk : blk + 1] * b_s[:, blk].unsqueeze(0)
    return acc


class QuantWeight:
    """A stored-precision weight the GEMM reads as the released kernels do: `fp8` (e4m3 [N, K] with 32x32
    UE8M0 tiles) or `fp4` (e2m1 codes [N, K] with a UE8M0 scale per 32 inputs). Values are kept unscaled."""

    def __init__(self, kind: str, values: torch.Tensor, row_scales: torch.Tensor | None,
                 dense: torch.Tensor | None = None):
        self.kind, self.values, self.row_scales = kind, values, row_scales  # row_scales: [N, K/32] fp32
        # the device form (`to` a CUDA device): the weight dequantized to bf16 [N, K], which is exact (an e4m3 or
        # e2m1 value times a power of two fits bf16), multiplied in one GEMM with fp32 accumulation
        self.dense = dense

    @classmethod
    def fp8(cls, w: torch.Tensor, scale: torch.Tensor) -> "QuantWeight":
        if w.dtype != torch.float8_e4m3fn:
            raise TypeError(f"FP8 weight must be float8_e4m3fn, got {w.dtype}")
        n, k = w.shape
        if tuple(scale.shape) != (math.ceil(n / BLOCK), math.ceil(k / BLOCK)):
            raise ValueError(f"FP8 weight {tuple(w.shape)} needs a {math.ceil(n / BLOCK)}x{math.ceil(k / BLOCK)} "
                             f"scale, got {tuple(scale.shape)}")
        return cls("fp8", w.float(), scale.float().repeat_interleave(BLOCK, 0)[:n].contiguous())

    @classmethod
    def fp4(cls, packed: torch.Tensor, scale: torch.Tensor) -> "QuantWeight":
        n, half = packed.shape
        if tuple(scale.shape) != (n, 2 * half // BLOCK):
            raise ValueError(f"FP4 weight {n}x{2 * half} needs a {n}x{2 * half // BLOCK} scale, "
                             f"got {tuple(scale.shape)}")
        return cls("fp4", unpack_e2m1(packed), scale.float().contiguous())

    @property
    def out_features(self) -> int:
        return (self.dense if self.dense is not None else self.values).shape[0]

    def to(self, device) -> "QuantWeight":
        """The weight on `device`: the CPU keeps the block-scaled form (the reference's order of additions, bit
        for bit); another device gets the dense bf16 form (`dense`), one GEMM instead of one per K block, whose
        fp32 sums differ from the block order only in rounding."""
        device = torch.device(device)
        if device.type == "cpu":
            if self.values is None:
                raise ValueError("a QuantWeight in its device form cannot go back to the CPU's block form")
            return QuantWeight(self.kind, self.values.to(device), self.row_scales.to(device))
        dense = self.dense if self.dense is not None else self.dequantized().to(torch.bfloat16)
        return QuantWeight(self.kind, None, None, dense.to(device))

    def dequantized(self) -> torch.Tensor:
        return self.values * self.row_scales.repeat_interleave(BLOCK, 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """bf16 [..., K] -> bf16 [..., N]: FP8 act-quant of x per 32, then the block-scaled GEMM."""
        lead, k = x.shape[:-1], x.shape[-1]
        if self.dense is not None:  # the device form: the fake-quantized activation is exact in bf16 too
            return torch.nn.functional.linear(fp8_fake_quant(x.reshape(-1, k).to(torch.bfloat16)),
                                              self.dense).view(*lead, -1)
        q, s = fp8_quant(x.reshape(-1, k))
        out = _block_gemm(q.flatten(-2), s, self.values, self.row_scales)
        return out.to(torch.bfloat16).view(*lead, -1)


#: rows a plain GEMM of a prefill or prompt chunk is computed with at least (`gemm`)
GEMM_ROWS = 16


def gemm(x: torch.Tensor, w: torch.Tensor, min_rows: int = 1) -> torch.Tensor:
    """`F.linear(x, w)` over x [..., K], computed with at least `min_rows` rows (zero rows padded, dropped after).
    CPU BLAS takes another kernel below a few rows, whose last bits differ (fp32: below 8 rows on an AMD EPYC,
    below 16 on an Intel Xeon with AVX-512 and AMX): with `min_rows` = GEMM_ROWS a row's result does not depend
    on how many rows share its call, so a prompt in chunks of any size computes what one prefill does. Decode steps keep one row (`min_rows` 1), as the reference computes them."""
    flat = x.reshape(-1, x.shape[-1])
    n = flat.shape[0]
    if n >= min_rows:
        return torch.nn.functional.linear(x, w)
    flat = torch.cat([flat, flat.new_zeros(min_rows - n, flat.shape[1])])
    return torch.nn.functional.linear(flat, w)[:n].view(*x.shape[:-1], -1)


def linear(x: torch.Tensor, w, min_rows: int = 1) -> torch.Tensor:
    """A projection in the weight's own precision: QuantWeight (whose block GEMM is the same at any row
    count), else a plain bf16/fp32 GEMM in x's dtype (`gemm`)."""
    if isinstance(w, QuantWeight):
        return w(x)
    return gemm(x, w, min_rows)


def per_row(fn, *tensors: torch.Tensor):
    """`fn(*tensors)` over rows that belong to different sequences (a batched decode step), computed so that
    each row's bits are those of `fn` on that row alone. On the CPU that means one call per row: a plain GEMM
    takes another BLAS kernel at another row count, and torch's vectorized exp/sigmoid/rsqrt differ in the last
    ulp from the scalar tail a short tensor falls in, so a row of a batch and the same row alone can differ.
    On another device the call is batched (one kernel for the rows; no bit-equality claim there). `fn` returns a
    tensor or a tuple of tensors, each with the rows first."""
    n = tensors[0].shape[0]
    if n == 1 or tensors[0].device.type != "cpu":
        return fn(*tensors)
    outs = [fn(*(t[i : i + 1] for t in tensors)) for i in range(n)]
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(parts) for parts in zip(*outs))
    return torch.cat(outs)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32, returned in x's dtype (eps 1e-20 in V4.1)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (weight * y).to(x.dtype)


# ---------------------------------------------------------------------------------------------------------- RoPE
def rope_inv_freq(dim: int, base: float, original_seq_len: int, factor: float, beta_fast: float,
                  beta_slow: float) -> torch.Tensor:
    """Per-pair frequencies, with YaRN's ramp between the beta_fast and beta_slow dims when original_seq_len > 0."""
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if original_seq_len > 0:
        def dim_for(rotations: float) -> float:
            return dim * math.log(original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(dim_for(beta_fast)), 0)
        high = min(math.ceil(dim_for(beta_slow)), dim - 1)
        keep = 1 - ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        freqs = freqs / factor * (1 - keep) + freqs * keep
    return freqs


_ROPE_TABLES: dict[tuple, torch.Tensor] = {}
_FREQ_KEYS: dict[int, tuple] = {}  # id(inv_freq) -> (a weak reference to it, its table key)


def _freq_key(inv_freq: torch.Tensor) -> tuple:
    """The table key of a frequency set (its values), read once per tensor: reading a device tensor's values
    is a host sync, which a forward would otherwise pay at every RoPE call."""
    hit = _FREQ_KEYS.get(id(inv_freq))
    if hit is not None and hit[0]() is inv_freq:
        return hit[1]
    key = (inv_freq.device, inv_freq.shape[0], tuple(inv_freq.tolist()))
    _FREQ_KEYS[id(inv_freq)] = (weakref.ref(inv_freq), key)
    return key


def rope_table(inv_freq: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """complex64 [len(positions), dim/2]: unit rotations by position * freq (angles formed in fp32).

    Rows come from one table per frequency set over a power-of-two range of positions, formed in one call as
    the reference precomputes its table: torch's vectorized sin/cos can differ in the last ulp from its scalar
    tail, so the rotation of a position must not depend on how many positions a call happens to ask for."""
    key = _freq_key(inv_freq)
    need = int(positions.max()) + 1 if positions.numel() else 1
    table = _ROPE_TABLES.get(key)
    if table is None or table.shape[0] < need:
        size = max(1024, 1 << (need - 1).bit_length())
        angles = torch.outer(torch.arange(size, device=inv_freq.device), inv_freq)
        table = _ROPE_TABLES[key] = torch.polar(torch.ones_like(angles), angles)
    return table[positions.to(table.device).long()]


def apply_rope(x: torch.Tensor, rot: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the pairs (interleaved) of x [S, ..., d] by rot [S, d/2]; returns a tensor in x's dtype."""
    z = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)).contiguous())
    r = rot.conj() if inverse else rot
    r = r.view(r.shape[0], *([1] * (z.dim() - 2)), r.shape[-1])
    return torch.view_as_real(z * r).flatten(-2).to(x.dtype)


def rope_tail(x: torch.Tensor, rot: torch.Tensor, rd: int, inverse: bool = False) -> torch.Tensor:
    """`apply_rope` on the last `rd` dims only."""
    return torch.cat([x[..., :-rd], apply_rope(x[..., -rd:], rot, inverse)], dim=-1)


# ----------------------------------------------------------------------------------------------------- attention
def sparse_attention(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """MQA over listed keys with a per-head sink. q [S, H, D] bf16, kv [N, D] bf16 (K = V), idx [S, T] int
    (-1: no key), sink [H] fp32. The list is walked 64 entries at a time with a running max; probabilities are
    rounded to bf16 before they weight the values (the released kernel's order). Returns bf16 [S, H, D]."""
    s_len, h, d = q.shape
    qf, kvf = q.float().unsqueeze(0), kv.float()
    acc = torch.zeros(1, s_len, h, d, dtype=torch.float32, device=q.device)
    denom = torch.zeros(1, s_len, h, dtype=torch.float32, device=q.device)
    run_max = torch.full((1, s_len, h), -1e30, dtype=torch.float32, device=q.device)
    scale_t = torch.tensor(scale, dtype=torch.float32)
    for start in range(0, idx.shape[-1], ATTN_BLOCK):
        cols = idx[:, start : start + ATTN_BLOCK].long().unsqueeze(0)
        valid = cols >= 0
        keys = kvf[cols.clamp_min(0)] * valid.unsqueeze(-1)  # [1, S, blk, D]
        logits = torch.einsum("bmhd,bmkd->bmhk", qf, keys)
        logits = torch.where(valid.unsqueeze(2), logits, -torch.inf) * scale_t
        new_max = torch.maximum(run_max, logits.amax(-1))
        rescale = torch.exp(run_max - new_max)
        p = torch.exp(logits - new_max.unsqueeze(-1))
        denom = denom * rescale + p.sum(-1)
        acc = acc * rescale.unsqueeze(-1) + torch.einsum("bmhk,bmkd->bmhd", p.to(torch.bfloat16).float(), keys)
        run_max = new_max
    denom = denom + torch.exp(sink.float() - run_max)
    return (acc / denom.unsqueeze(-1)).to(torch.bfloat16)[0]


# ----------------------------------------------------------------------------------------------------------- mHC
def hc_mixes(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int,
             hc_eps: float, norm_eps: float, min_rows: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The mix of one mHC site from its streams x [S, hc, D]: (pre [S, hc], post [S, hc], comb [S, hc, hc]),
    comb made doubly stochastic by Sinkhorn (softmax rows + eps, one column pass, then iters-1 row/column
    rounds). All fp32. `min_rows` > 1: the rows are computed padded to a multiple of `min_rows` (see `gemm`;
    torch's vectorized exp and sigmoid can differ in the last ulp from their scalar tail, so a row's mix must
    not depend on where the call's element count leaves the tail)."""
    s = x.shape[0]
    if min_rows > 1 and s % min_rows:
        x = torch.cat([x, x.new_zeros(min_rows - s % min_rows, *x.shape[1:])])
    flat = x.flatten(1).float().unsqueeze(0)  # [1, S, hc*D]: the batched shape the reference multiplies
    m = (gemm(flat, fn, min_rows) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps))[0]
    scale, base = scale.float(), base.float()
    pre = torch.sigmoid(m[:, :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * torch.sigmoid(m[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = (m[:, 2 * hc :] * scale[2] + base[2 * hc :]).unflatten(-1, (hc, hc))
    comb = torch.exp(comb - comb.amax(-1, keepdim=True))
    comb = comb / comb.sum(-1, keepdim=True) + hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    return pre[:s], post[:s], comb[:s]


def hc_collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """[S, hc, D] weighted by pre [S, hc] -> [S, D] in x's dtype (sum in fp32)."""
    return (pre.unsqueeze(-1) * x.float()).sum(1).to(x.dtype)


def hc_expand(out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Sublayer output [S, D] back to streams: post_k * out + sum_j comb[j, k] * residual_j."""
    y = post.unsqueeze(-1) * out.unsqueeze(-2) + (comb.unsqueeze(-1) * residual.unsqueeze(-2)).sum(1)
    return y.to(out.dtype)


def topk_low_ties(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last dim with exact ties broken toward the lower index (a stable descending sort):
    the rule the golden data pins, since bf16 index scores tie often."""
    vals, idx = torch.sort(x, dim=-1, descending=True, stable=True)
    return vals[..., :k], idx[..., :k]
