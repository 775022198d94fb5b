"""mHC mixing: the streams' mix through `fn` (fp32 partial sums over column chunks for a few tokens, cuBLAS for
many), then the per-token RMS division, Sinkhorn projection and stream collapse in one launch, and the
expand-and-mix in another (the reference spends ~80 small launches per site on the 4x4 Sinkhorn loop alone).
The model's final collapse (`hc_head`) is the first two without post, comb or Sinkhorn."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import SMS


@triton.jit
def _hc_mix_kernel(streams_ptr, fn_ptr, part_ptr, T, K, NOUT, stride_st, stride_fn, stride_split, chunk,
                   BLOCK_T: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
    """Partial sums of the flattened streams through `fn` ([T, n*D] x [NOUT, n*D]^T, fp32 products and sums) over
    one chunk of the n*D columns: part[chunk, t, o], and in column NOUT the chunk's sum of squares (for the RMS
    norm, so `_hc_pre_kernel` need not read the streams twice). Many chunks keep every multiprocessor busy at
    any T.

    SPLIT: bf16 streams, and `fn` given as three bf16 terms [3, NOUT, n*D] whose sum is the fp32 `fn`
    (`split_bf16`): each term's products with a bf16 value are exact in fp32, so three bf16 tensor-core dots with
    fp32 accumulation give the fp32 products, where an fp32 dot would run on FMA units at a fraction of the rate."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ks = tl.program_id(1)
    o = tl.arange(0, BLOCK_O)
    acc = tl.zeros((BLOCK_T, BLOCK_O), tl.float32)
    squares = tl.zeros((BLOCK_T,), tl.float32)
    for k0 in range(ks * chunk, ks * chunk + chunk, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(streams_ptr + t[:, None] * stride_st + k[None, :], mask=(t < T)[:, None] & (k < K)[None, :],
                    other=0.0)
        xf = x.to(tl.float32)
        squares += tl.sum(xf * xf, axis=1)
        w_at = fn_ptr + o[None, :] * stride_fn + k[:, None]
        w_ok = (o < NOUT)[None, :] & (k < K)[:, None]
        if SPLIT:
            for term in tl.static_range(3):
                acc = tl.dot(x, tl.load(w_at + term * stride_split, mask=w_ok, other=0.0), acc)
        else:
            acc += tl.dot(xf, tl.load(w_at, mask=w_ok, other=0.0).to(tl.float32), input_precision="ieee")
    acc += tl.where(o[None, :] == NOUT, squares[:, None], 0.0)
    tl.store(part_ptr + (ks * T + t)[:, None] * BLOCK_O + o[None, :], acc, mask=(t < T)[:, None])


_SPLITS: dict[int, tuple] = {}  # id(fn) -> (weak reference, data pointer, version, split)


def split_bf16(fn: torch.Tensor) -> torch.Tensor:
    """fp32 `fn` as three bf16 terms [3, *fn.shape] (hi, the rounding error of hi, the error of both) whose sum
    carries fn's 24 significant bits. Made once per weight (rebuilt if it is written in place)."""
    entry = _SPLITS.get(id(fn))
    if entry is not None and entry[0]() is fn and entry[1:3] == (fn.data_ptr(), fn._version):
        return entry[3]
    rest, terms = fn.float(), []
    for _ in range(3):
        terms.append(rest.to(torch.bfloat16))
        rest = rest - terms[-1].float()
    split = torch.stack(terms).contiguous()
    for key in [k for k, e in _SPLITS.items() if e[0]() is None]:  # weights that are gone
        del _SPLITS[key]
    _SPLITS[id(fn)] = (weakref.ref(fn), fn.data_ptr(), fn._version, split)
    return split


@triton.jit
def _hc_pre_kernel(
    mix_ptr, base_ptr, scale_ptr, streams_ptr, x_ptr, post_ptr, comb_ptr, norm_w_ptr,
    D, iters, hc_eps, norm_eps, chunk, rms_eps,
    stride_part, stride_mt, stride_st, stride_sn, stride_xt,
    N: tl.constexpr, BLOCK_D: tl.constexpr, PARTS: tl.constexpr, BLOCK_O: tl.constexpr, NOUT: tl.constexpr,
    MIX_SQUARES: tl.constexpr, HEAD: tl.constexpr, NORM: tl.constexpr,
):
    """One token's mix -> pre (each program of the token forms it: a few flops), then the collapse of a `chunk`
    of the D columns. Unless HEAD, the token's first program instead forms post and comb (the Sinkhorn loop's
    forty dependent reductions, microseconds of latency) and stores them, and program c + 1 collapses chunk c:
    the step waits for the longer of the two, not their sum (bench/decode_trace.py, run 38).
    MIX_SQUARES: the mix's column NOUT holds the token's sum of squares (`_hc_mix_kernel`), else it is summed
    here first. HEAD: the model's final collapse (`hc_head`): the mix is pre's alone, no post, comb or Sinkhorn.
    NORM: one program holds a token's whole collapsed row (BLOCK_D >= D) and RMS-norms it with `norm_w` before
    the store (`hc_pre_norm`), rounding it first as a separate `rms_norm` would read it."""
    t = tl.program_id(0)
    role = tl.program_id(1)
    d_first = (role if HEAD else role - 1) * chunk
    j = tl.arange(0, N)
    rows = tl.arange(0, N)[:, None]
    cols = tl.arange(0, N)[None, :]
    o = tl.arange(0, BLOCK_O)
    parts = tl.arange(0, PARTS)
    # the mix: its partial sums added up (one part when cuBLAS made it)
    mix = tl.sum(tl.load(mix_ptr + parts[:, None] * stride_part + t * stride_mt + o[None, :],
                         mask=(o < NOUT + MIX_SQUARES)[None, :], other=0.0), axis=0)  # [BLOCK_O]
    # the RMS norm of the flattened streams, a per-token scalar applied to the (unnormed) mix
    if MIX_SQUARES:
        total = tl.sum(tl.where(o == NOUT, mix, 0.0), axis=0)
    else:
        squares = tl.zeros((BLOCK_D,), tl.float32)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            xs = tl.load(streams_ptr + t * stride_st + j[:, None] * stride_sn + d[None, :], mask=d[None, :] < D,
                         other=0.0).to(tl.float32)
            squares += tl.sum(xs * xs, axis=0)
        total = tl.sum(squares, axis=0)
    r = tl.rsqrt(total / (N * D) + norm_eps)
    s_pre = tl.load(scale_ptr)
    pre_w = tl.sum(tl.where(o[None, :] == j[:, None], mix[None, :], 0.0), axis=1)
    pre = tl.sigmoid(pre_w * r * s_pre + tl.load(base_ptr + j)) + hc_eps
    if HEAD:
        _collapse(streams_ptr, x_ptr, norm_w_ptr, pre, t, d_first, chunk, D, rms_eps, stride_st, stride_sn,
                  stride_xt, N, BLOCK_D, NORM)
    elif role == 0:
        s_post = tl.load(scale_ptr + 1)
        s_comb = tl.load(scale_ptr + 2)
        post_w = tl.sum(tl.where(o[None, :] == N + j[:, None], mix[None, :], 0.0), axis=1)
        flat = 2 * N + rows * N + cols  # [N, N]
        comb_w = tl.sum(tl.where(o[None, None, :] == flat[:, :, None], mix[None, None, :], 0.0), axis=2)
        post = 2.0 * tl.sigmoid(post_w * r * s_post + tl.load(base_ptr + N + j))
        logits = comb_w * r * s_comb + tl.load(base_ptr + 2 * N + rows * N + cols)
        e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        comb = e / tl.sum(e, axis=1)[:, None] + hc_eps
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
        for _ in range(iters - 1):  # Sinkhorn: rows, then columns
            comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)
            comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
        tl.store(post_ptr + t * N + j, post)
        tl.store(comb_ptr + t * N * N + rows * N + cols, comb)
    else:
        _collapse(streams_ptr, x_ptr, norm_w_ptr, pre, t, d_first, chunk, D, rms_eps, stride_st, stride_sn,
                  stride_xt, N, BLOCK_D, NORM)


@triton.jit
def _collapse(streams_ptr, x_ptr, norm_w_ptr, pre, t, d_first, chunk, D, rms_eps, stride_st, stride_sn, stride_xt,
              N: tl.constexpr, BLOCK_D: tl.constexpr, NORM: tl.constexpr):
    """x[t, d] = sum_j pre[j] * streams[t, j, d] for d in [d_first, d_first + chunk); NORM: RMS-normed with
    norm_w (the chunk is the whole row)."""
    j = tl.arange(0, N)
    for d0 in range(d_first, d_first + chunk, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        xs = tl.load(streams_ptr + t * stride_st + j[:, None] * stride_sn + d[None, :], mask=d[None, :] < D, other=0.0)
        out = tl.sum(xs.to(tl.float32) * pre[:, None], axis=0)
        if NORM:
            out = out.to(x_ptr.dtype.element_ty).to(tl.float32)
            out = out * tl.rsqrt(tl.sum(out * out, axis=0) / D + rms_eps)
            out = out * tl.load(norm_w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
        tl.store(x_ptr + t * stride_xt + d, out.to(x_ptr.dtype.element_ty), mask=d < D)


@triton.jit
def _hc_post_kernel(
    streams_ptr, y_ptr, post_ptr, comb_ptr, out_ptr,
    D,
    stride_st, stride_sn, stride_yt, stride_ot, stride_on,
    N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < D
    j = tl.arange(0, N)
    xs = tl.load(streams_ptr + t * stride_st + j[:, None] * stride_sn + d[None, :], mask=d_ok[None, :], other=0.0)
    y = tl.load(y_ptr + t * stride_yt + d, mask=d_ok, other=0.0).to(tl.float32)
    post = tl.load(post_ptr + t * N + j)
    comb = tl.load(comb_ptr + t * N * N + j[:, None] * N + j[None, :])  # [source j, destination k]
    mixed = tl.sum(comb[:, :, None] * xs.to(tl.float32)[:, None, :], axis=0)  # [k, d]
    out = post[:, None] * y[None, :] + mixed
    tl.store(out_ptr + t * stride_ot + j[:, None] * stride_on + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=d_ok[None, :])


def hc_pre(streams, fn, base, scale, iters, hc_eps, norm_eps, out=None, split=None, tiles=None, norm=None,
           mix=None):
    """streams [T, n, D], fn [(2 + n) * n, n * D] fp32 -> the op's (collapsed [T, D], post [T, n], comb [T, n, n]).
    The mix (the flattened streams through `fn`, in fp32): partial sums over column chunks in one kernel
    (`_hc_mix_kernel`), summed by `_hc_pre_kernel`. bf16 streams take the three-term bf16 split of fn on tensor
    cores at every T (bench/investigations/gpu_notes.md, runs 10, 11, 15 and 16: FMA products cost an 8K prefill 28 ms,
    cuBLAS's fp32 GEMM and the cast of the streams to fp32 8 ms, and a decode step's mix 17.5 us against 9.6); fp32/fp16
    streams take fp32 FMA products up to `SMALL_MIX_TOKENS` tokens, cuBLAS above. Then one to four programs per
    token divide the mix by the streams' RMS, project, and collapse a share of the columns each. `tiles`
    (bench/investigations/kernel_sweep.py): parts (column chunks of the mix), d_parts (programs per token of the
    collapse), num_warps (of the collapse). `norm` (weight [D], eps): the collapsed rows RMS-normed in the collapse's
    launch (`Backend.hc_pre_norm`), each token's row in one program. `mix`: the mix's partial sums as
    `hc_post_mix` left them (`MixParts`), when it made the streams; else (or if they are not for `fn`) the mix
    is computed here.
    """
    return _mix_and_collapse(streams, fn, base, scale, iters, hc_eps, norm_eps, out, split, tiles, head=False,
                             norm=norm, mix=mix)


def hc_head(streams, fn, base, scale, hc_eps, norm_eps, out=None, norm=None, mix=None):
    """The model's final collapse (`Backend.hc_head`): streams [T, n, D], fn [n, n * D] fp32, base [n], scale [1]
    -> [T, D] in the streams' dtype, weights `sigmoid(mix * scale + base) + hc_eps` of the RMS-normed mix. The
    two launches of `hc_pre` (its mix, and its collapse without post, comb or Sinkhorn), where torch took ~15
    (the fp32 copy, the mix, the norm's reductions, the sigmoid, the weighted sum). `norm` and `mix` as in
    `hc_pre` (the model's final norm, `Backend.hc_head_norm`; the last layer's `hc_post_mix` parts)."""
    return _mix_and_collapse(streams, fn, base, scale, 1, hc_eps, norm_eps, out, None, None, head=True, norm=norm,
                             mix=mix)[0]


def _mix_width(nout: int) -> int:
    """Columns of a mix's partial sums: the NOUT outputs and a spare one for the sum of squares, a power of two
    (the layout `_hc_mix_kernel` and `_hc_post_mix_kernel` write and `_hc_pre_kernel` reads)."""
    return triton.next_power_of_2(max(nout + 1, 16))


def _mix_and_collapse(streams, fn, base, scale, iters, hc_eps, norm_eps, out, split, tiles, head: bool, norm=None,
                      mix=None):
    tiles = tiles or {}
    T, n, D = streams.shape
    streams = streams.contiguous()
    weight, fn = fn, fn.float().contiguous()
    x = torch.empty((T, D), dtype=streams.dtype, device=streams.device) if out is None else out
    post = torch.empty((0 if head else T, n), dtype=torch.float32, device=streams.device)
    comb = torch.empty((0 if head else T, n, n), dtype=torch.float32, device=streams.device)
    if not T:
        return x, post, comb
    K, nout = n * D, fn.shape[0]
    block_o = _mix_width(nout)
    if split is None:  # the split at every T (bench/investigations/kernel_sweep.py, run 16: 9.6 us against 17.5 at one
        # token)
        split = True
    split = split and streams.dtype == torch.bfloat16
    if mix is not None and mix.fn is weight and mix.parts.shape[1:] == (T, block_o):  # `hc_post_mix` made it
        parts, stride_part, stride_t = mix.parts.shape[0], T * block_o, block_o
        mix = mix.parts
    elif T <= SMALL_MIX_TOKENS or split:
        block_t, block_k = (64, 64) if split else (16, 64)
        t_blocks = triton.cdiv(T, block_t)
        # bench/investigations/kernel_sweep.py (run 21, H200): 128 chunks of two column blocks at decode sizes (one
        # token 10 -> 7.5 us with the collapse below), 8 at an 8K prefill (0.188 -> 0.175 ms)
        parts = 128 if T <= 128 else 8
        while parts > 1 and K // parts < 2 * block_k:
            parts //= 2
        parts = tiles.get("parts", parts)
        chunk = triton.cdiv(triton.cdiv(K, parts), block_k) * block_k
        mix = torch.empty((parts, T, block_o), dtype=torch.float32, device=streams.device)
        w = split_bf16(weight) if split else fn
        _hc_mix_kernel[(t_blocks, parts)](streams, w, mix, T, K, nout, K, w.stride(-2), w.stride(0), chunk,
                                          BLOCK_T=block_t, BLOCK_O=block_o, BLOCK_K=block_k, SPLIT=split,
                                          num_warps=4)
        stride_part, stride_t = T * block_o, block_o
    else:
        parts = 1
        mix = torch.mm(streams.flatten(1).float(), fn.t())
        stride_part, stride_t = 0, mix.stride(0)
    # few tokens: each token's columns over up to 4 programs, each forming the token's weights itself (run 21)
    d_parts = 1
    while d_parts < 4 and T * d_parts * 2 <= 2 * SMS and D // (d_parts * 2) >= 256:
        d_parts *= 2
    d_parts = tiles.get("d_parts", d_parts)
    chunk = triton.cdiv(triton.cdiv(D, d_parts), 256) * 256 if d_parts > 1 else D
    block_d = min(1024, chunk & -chunk) if d_parts > 1 else min(1024, triton.next_power_of_2(D))
    warps = 4
    if norm is not None:  # a token's row in one program's registers
        chunk, block_d, warps = D, triton.next_power_of_2(D), 8
    _hc_pre_kernel[(T, triton.cdiv(D, chunk) + (0 if head else 1))](
        mix, base.float().contiguous(), scale.float().contiguous(), streams, x, post, comb,
        norm[0] if norm is not None else x, D, int(iters), float(hc_eps), float(norm_eps), chunk,
        float(norm[1]) if norm is not None else 0.0,
        stride_part, stride_t, streams.stride(0), streams.stride(1), x.stride(0),
        N=n, BLOCK_D=block_d, PARTS=parts, BLOCK_O=block_o, NOUT=nout, MIX_SQUARES=stride_part != 0, HEAD=head,
        NORM=norm is not None, num_warps=tiles.get("num_warps", warps),
    )
    return x, post, comb


SMALL_MIX_TOKENS = 64


def hc_post(streams, block_out, post, comb, out=None):
    T, n, D = streams.shape
    streams, block_out = streams.contiguous(), block_out.contiguous()
    out = torch.empty_like(streams) if out is None else out
    if T:
        block_d = 512
        _hc_post_kernel[(T, triton.cdiv(D, block_d))](
            streams, block_out, post.float().contiguous(), comb.float().contiguous(), out, D,
            streams.stride(0), streams.stride(1), block_out.stride(0), out.stride(0), out.stride(1),
            N=n, BLOCK_D=block_d, num_warps=4,
        )
    return out


@dataclass(frozen=True, slots=True)
class MixParts:
    """The next site's mix as `hc_post_mix` left it: fp32 partial sums [parts, T, BLOCK_O] over column chunks
    (column NOUT: the chunk's sum of squares), and the `fn` they are for."""

    parts: torch.Tensor
    fn: torch.Tensor


#: columns of each stream one `hc_post_mix` program takes: 128 programs for D = 4096, as the mix kernel's chunks
POST_MIX_COLUMNS = 32


@triton.jit
def _hc_post_mix_kernel(
    streams_ptr, y_ptr, post_ptr, comb_ptr, out_ptr, fn_ptr, part_ptr,
    T, D, NOUT,
    stride_st, stride_sn, stride_yt, stride_ot, stride_on, stride_fn, stride_split,
    N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_O: tl.constexpr,
):
    """`_hc_post_kernel` for BLOCK_D columns of every stream of BLOCK_T tokens, then those new streams (rounded
    as stored) through their N * BLOCK_D columns of the next site's `fn` (its three bf16 terms, as
    `_hc_mix_kernel`) into part[column block, t]: the next site's mix without reading the streams again."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    block = tl.program_id(1)
    d = block * BLOCK_D + tl.arange(0, BLOCK_D)
    j = tl.arange(0, N)
    t_ok = (t < T)[:, None, None]
    at = t.to(tl.int64)[:, None, None]
    xs = tl.load(streams_ptr + at * stride_st + j[None, :, None] * stride_sn + d[None, None, :], mask=t_ok,
                 other=0.0).to(tl.float32)  # [T, source j, d]
    y = tl.load(y_ptr + t.to(tl.int64)[:, None] * stride_yt + d[None, :], mask=(t < T)[:, None], other=0.0)
    post = tl.load(post_ptr + t[:, None] * N + j[None, :], mask=(t < T)[:, None], other=0.0)  # [T, k]
    comb = tl.load(comb_ptr + t[:, None, None] * N * N + j[None, :, None] * N + j[None, None, :], mask=t_ok,
                   other=0.0)  # [T, source j, destination k]
    mixed = tl.sum(comb[:, :, :, None] * xs[:, :, None, :], axis=1)  # [T, k, d]
    new = (post[:, :, None] * y.to(tl.float32)[:, None, :] + mixed).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + at * stride_ot + j[None, :, None] * stride_on + d[None, None, :], new, mask=t_ok)
    flat = tl.reshape(new, (BLOCK_T, N * BLOCK_D))  # column c: stream c // BLOCK_D, column d[c % BLOCK_D]
    c = tl.arange(0, N * BLOCK_D)
    k = (c // BLOCK_D) * D + block * BLOCK_D + c % BLOCK_D  # its column of the flattened streams
    o = tl.arange(0, BLOCK_O)
    w_at = fn_ptr + o[None, :] * stride_fn + k[:, None]
    acc = tl.zeros((BLOCK_T, BLOCK_O), tl.float32)
    for term in tl.static_range(3):
        acc = tl.dot(flat, tl.load(w_at + term * stride_split, mask=(o < NOUT)[None, :], other=0.0), acc)
    f32 = flat.to(tl.float32)
    acc += tl.where(o[None, :] == NOUT, tl.sum(f32 * f32, axis=1)[:, None], 0.0)
    tl.store(part_ptr + (block * T + t)[:, None] * BLOCK_O + o[None, :], acc, mask=(t < T)[:, None])


def hc_post_mix(streams, block_out, post, comb, next_fn) -> tuple[torch.Tensor, MixParts | None]:
    """The backend op `hc_post_mix`: `hc_post`, and the next site's mix partial sums (`MixParts`, for `hc_pre`'s
    `mix`) from the new streams in the same launch, for bf16 streams of up to `SMALL_MIX_TOKENS` tokens (a
    decode step); else `hc_post` alone and None."""
    T, n, D = streams.shape
    nout = next_fn.shape[0]
    blocks = D // POST_MIX_COLUMNS
    if (streams.dtype != torch.bfloat16 or not 0 < T <= SMALL_MIX_TOKENS or D % POST_MIX_COLUMNS
            or blocks & (blocks - 1) or next_fn.shape[1] != n * D or n & (n - 1)):
        return hc_post(streams, block_out, post, comb), None
    streams, block_out = streams.contiguous(), block_out.contiguous()
    out = torch.empty_like(streams)
    block_o = _mix_width(nout)
    parts = torch.empty((blocks, T, block_o), dtype=torch.float32, device=streams.device)
    w = split_bf16(next_fn)
    block_t = 16 if T <= 16 else 64
    _hc_post_mix_kernel[(triton.cdiv(T, block_t), blocks)](
        streams, block_out, post.float().contiguous(), comb.float().contiguous(), out, w, parts, T, D, nout,
        streams.stride(0), streams.stride(1), block_out.stride(0), out.stride(0), out.stride(1), w.stride(-2),
        w.stride(0), N=n, BLOCK_T=block_t, BLOCK_D=POST_MIX_COLUMNS, BLOCK_O=block_o, num_warps=4,
    )
    return out, MixParts(parts, next_fn)
