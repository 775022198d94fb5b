"""RMSNorm and interleaved RoPE, one launch each (the reference takes 6 and ~15 small launches); RoPE forms
its angles and their cosines inside the kernel."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def rotate_pairs(y, first_pair, position, freq_ptr, half, INVERSE: tl.constexpr):
    """Interleaved RoPE on a register tile: y [R, C] fp32 holds C / 2 consecutive (even, odd) pairs of each row,
    pair j being the row's rotary pair `first_pair + j`; pairs 0 <= p < half turn by `position * freq[p]` (back,
    when INVERSE), the others pass. The angle as torch forms it (fp32 position times fp32 frequency), then
    libdevice's cosf/sinf, which reduce large angles exactly as torch's CUDA cos/sin do (the approximate
    instructions do not)."""
    even, odd = tl.split(tl.reshape(y, (y.shape[0], y.shape[1] // 2, 2)))
    p = first_pair + tl.arange(0, y.shape[1] // 2)
    turn = (p >= 0) & (p < half)
    angle = position * tl.load(freq_ptr + tl.where(turn, p, 0), mask=turn, other=0.0)
    cos, sin = libdevice.cos(angle)[None, :], libdevice.sin(angle)[None, :]
    if INVERSE:
        sin = -sin
    turn = turn[None, :]
    even, odd = tl.where(turn, even * cos - odd * sin, even), tl.where(turn, odd * cos + even * sin, odd)
    return tl.reshape(tl.join(even, odd), (y.shape[0], y.shape[1]))


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, R, C, eps, stride_x, stride_o, HAS_W: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.arange(0, BLOCK_C)
    ok = (r < R)[:, None] & (c < C)[None, :]
    rows = r.to(tl.int64)[:, None]
    x = tl.load(x_ptr + rows * stride_x + c[None, :], mask=ok, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, axis=1) / C + eps)[:, None]
    if HAS_W:
        y = y * tl.load(w_ptr + c, mask=c < C, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows * stride_o + c[None, :], y.to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of at most 8K columns; short rows go several to a program (an 8K prefill's per-head query norm is
    524,288 rows of 512: one program each left the GPU mostly waiting)."""
    C = x.shape[-1]
    x2 = x.reshape(-1, C)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    o2 = out.view(-1, C)
    R = x2.shape[0]
    if R:
        block = triton.next_power_of_2(C)
        block_r = max(1, 4096 // block)  # not from R: a tile per row count would compile per batch size
        _rms_norm_kernel[(triton.cdiv(R, block_r),)](
            x2, weight if weight is not None else x2, o2, R, C, float(eps), x2.stride(0), o2.stride(0),
            HAS_W=weight is not None, BLOCK_R=block_r, BLOCK_C=block,
            num_warps=min(16, max(1, block * block_r // 256)),
        )
    return out


@triton.jit
def _rope_kernel(x_ptr, pos_ptr, freq_ptr, out_ptr, T, M, d, half, stride_pos, stride_xt, stride_xm, stride_ot,
                 stride_om, INVERSE: tl.constexpr, COPY_NOPE: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_NOPE: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """BLOCK_T tokens x BLOCK_M of their M rows, rotating the last 2 * half dims of each row in interleaved pairs:
    each row's rotated dims load as one contiguous run, split into even and odd halves in registers (two strided
    loads of the halves ran an 8K prefill's query rotation 6x slower: bench/investigations/kernel_sweep.py, runs 20 and
    21)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    ok_tm = (t < T)[:, None, None] & (m < M)[None, :, None]
    nope = d - 2 * half
    t64 = t.to(tl.int64)[:, None, None]
    src = x_ptr + t64 * stride_xt + m[None, :, None] * stride_xm
    dst = out_ptr + t64 * stride_ot + m[None, :, None] * stride_om
    if COPY_NOPE:  # out of place: the unrotated dims pass through (in place they are already there)
        for c0 in range(0, nope, BLOCK_NOPE):
            c = (c0 + tl.arange(0, BLOCK_NOPE))[None, None, :]
            ok = ok_tm & (c < nope)
            tl.store(dst + c, tl.load(src + c, mask=ok, other=0.0), mask=ok)
    i = tl.arange(0, BLOCK_HALF)
    # the angle as torch forms it (fp32 position times fp32 frequency), then libdevice's cosf/sinf, which reduce
    # large angles exactly as torch's CUDA cos/sin do (the approximate instructions do not)
    pos = tl.load(pos_ptr + t * stride_pos, mask=t < T, other=0).to(tl.float32)
    angle = pos[:, None] * tl.load(freq_ptr + i, mask=i < half, other=0.0)[None, :]  # [BLOCK_T, BLOCK_HALF]
    cos = libdevice.cos(angle)[:, None, :]
    sin = libdevice.sin(angle)[:, None, :]
    if INVERSE:
        sin = -sin
    c = tl.arange(0, 2 * BLOCK_HALF)[None, None, :]
    ok = ok_tm & (c < 2 * half)
    x = tl.load(src + nope + c, mask=ok, other=0.0).to(tl.float32)
    even, odd = tl.split(tl.reshape(x, (BLOCK_T, BLOCK_M, BLOCK_HALF, 2)))
    y = tl.reshape(tl.join(even * cos - odd * sin, odd * cos + even * sin), (BLOCK_T, BLOCK_M, 2 * BLOCK_HALF))
    tl.store(dst + nope + c, y.to(out_ptr.dtype.element_ty), mask=ok)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False,
               out: torch.Tensor | None = None, inplace: bool = False, tiles: dict | None = None) -> torch.Tensor:
    """x [T, ..., d]; rotates the last 2 * len(inv_freq) dims of every row by its token's position. `inplace`:
    rotate x itself (when its rows are views it can write) and touch only those dims: an 8K prefill's queries
    are 537 MB, of which the rotated dims are an eighth. A program takes up to 64 rows of one token, its cosines
    formed once for them (bench/investigations/kernel_sweep.py, run 21 on the H200: an 8K prefill's queries 0.51 ->
    0.08 ms, its keys 0.077 -> 0.046 ms). `tiles` (the sweep): block_t (tokens a program), block_m, num_warps."""
    T, d, half = x.shape[0], x.shape[-1], inv_freq.shape[0]
    x3 = x.reshape(T, -1, d)
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    if out is None:
        out = x if inplace and x3.data_ptr() == x.data_ptr() and x.is_contiguous() else torch.empty_like(x)
    o3 = out.view(T, -1, d)
    M = x3.shape[1]
    if T == 0 or M == 0:
        return out
    block_m = min(64, triton.next_power_of_2(M))
    t = {"block_t": 1, "block_m": block_m, "num_warps": 2 if block_m >= 16 else 1, **(tiles or {})}
    freq = inv_freq if inv_freq.dtype == torch.float32 and inv_freq.is_contiguous() else inv_freq.float().contiguous()
    _rope_kernel[(triton.cdiv(T, t["block_t"]), triton.cdiv(M, t["block_m"]))](
        x3, positions, freq, o3, T, M, d, half, positions.stride(0), x3.stride(0), x3.stride(1), o3.stride(0),
        o3.stride(1), INVERSE=inverse, COPY_NOPE=out.data_ptr() != x3.data_ptr(), BLOCK_T=t["block_t"],
        BLOCK_M=t["block_m"], BLOCK_NOPE=max(16, min(512, triton.next_power_of_2(max(d - 2 * half, 1)))),
        BLOCK_HALF=max(16, triton.next_power_of_2(half)), num_warps=t["num_warps"],
    )
    return out


@triton.jit
def _norm_rope_rows(x_ptr, w_ptr, out_ptr, t, m, M, d, half, eps, position, freq_ptr, stride_xt, stride_xm,
                    stride_ot, stride_om, HAS_W: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """`_rms_norm_kernel` then `_rope_kernel` on rows m (a block of them) of token t: the rows' normed values are
    rounded to the output dtype before the rotation, as the two kernels round them."""
    nope = d - 2 * half
    src = x_ptr + t.to(tl.int64) * stride_xt + m[:, None] * stride_xm
    dst = out_ptr + t.to(tl.int64) * stride_ot + m[:, None] * stride_om
    c = tl.arange(0, BLOCK_C)[None, :]
    x = tl.load(src + c, mask=(m < M)[:, None] & (c < d), other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=1) / d + eps)[:, None]
    y = x * r
    if HAS_W:
        y = y * tl.load(w_ptr + c, mask=c < d, other=0.0).to(tl.float32)
    tl.store(dst + c, y.to(out_ptr.dtype.element_ty), mask=(m < M)[:, None] & (c < nope))
    i = tl.arange(0, 2 * BLOCK_HALF)[None, :]
    ok = (m < M)[:, None] & (i < 2 * half)
    y = tl.load(src + nope + i, mask=ok, other=0.0).to(tl.float32) * r
    if HAS_W:
        y = y * tl.load(w_ptr + nope + i, mask=i < 2 * half, other=0.0).to(tl.float32)
    y = rotate_pairs(y.to(out_ptr.dtype.element_ty).to(tl.float32), 0, position, freq_ptr, half, False)
    tl.store(dst + nope + i, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _norm_rope_kernel(x_ptr, w_ptr, pos_ptr, freq_ptr, out_ptr, M, d, half, eps, stride_pos, stride_xt, stride_xm,
                      stride_ot, stride_om, HAS_W: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
                      BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    _norm_rope_rows(x_ptr, w_ptr, out_ptr, t, m, M, d, half, eps, tl.load(pos_ptr + t * stride_pos).to(tl.float32),
                    freq_ptr, stride_xt, stride_xm, stride_ot, stride_om, HAS_W, BLOCK_C, BLOCK_HALF)


@triton.jit
def _norm_rope_pair_kernel(q_ptr, k_ptr, w_ptr, pos_ptr, freq_ptr, q_out_ptr, k_out_ptr, M, d, half, eps, q_blocks,
                           stride_pos, stride_qt, stride_qm, stride_kt, stride_qot, stride_qom, stride_kot,
                           BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """The queries' rows (no weight) in the first q_blocks programs of each token, its key row (weighted) in
    the last one."""
    t = tl.program_id(0)
    block = tl.program_id(1)
    position = tl.load(pos_ptr + t * stride_pos).to(tl.float32)
    if block < q_blocks:  # (the branches' row blocks differ in shape: the compiler wants them named apart)
        _norm_rope_rows(q_ptr, w_ptr, q_out_ptr, t, block * BLOCK_M + tl.arange(0, BLOCK_M), M, d, half, eps, position,
                        freq_ptr, stride_qt, stride_qm, stride_qot, stride_qom, False, BLOCK_C, BLOCK_HALF)
    else:
        _norm_rope_rows(k_ptr, w_ptr, k_out_ptr, t, tl.arange(0, 1), 1, d, half, eps, position, freq_ptr, stride_kt,
                        0, stride_kot, 0, True, BLOCK_C, BLOCK_HALF)


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, positions: torch.Tensor,
                  inv_freq: torch.Tensor) -> torch.Tensor:
    """The backend op `rms_norm_rope`: x [T, ..., d] (rows at most 4K wide) normed and rotated into a new tensor,
    one launch where `rms_norm` and `apply_rope` took two (a decode step's queries and keys: four a layer)."""
    T, d, half = x.shape[0], x.shape[-1], inv_freq.shape[0]
    x3 = x.reshape(T, -1, d)
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    out = torch.empty((T, x3.shape[1], d), dtype=x.dtype, device=x.device)
    M = x3.shape[1]
    if T and M:
        block_c = triton.next_power_of_2(d)
        block_m = max(1, min(triton.next_power_of_2(M), 4096 // block_c))
        freq = inv_freq.float().contiguous()
        _norm_rope_kernel[(T, triton.cdiv(M, block_m))](
            x3, weight if weight is not None else x3, positions, freq, out, M, d, half, float(eps),
            positions.stride(0), x3.stride(0), x3.stride(1), out.stride(0), out.stride(1),
            HAS_W=weight is not None, BLOCK_M=block_m, BLOCK_C=block_c,
            BLOCK_HALF=max(16, triton.next_power_of_2(half)), num_warps=4 if block_m * block_c >= 2048 else 2,
        )
    return out.view(x.shape)


def qk_norm_rope(q: torch.Tensor, kv: torch.Tensor, kv_weight: torch.Tensor, eps: float, positions: torch.Tensor,
                 inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The backend op `qk_norm_rope`: `rms_norm_rope` of the queries q [T, H, d] (no weight) and of the key kv
    [T, d] (with `kv_weight`) in one launch, where a decode step spent two a layer."""
    T, H, d = q.shape
    half = inv_freq.shape[0]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if kv.stride(-1) != 1:
        kv = kv.contiguous()
    q_out = torch.empty((T, H, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((T, d), dtype=kv.dtype, device=kv.device)
    if T:
        block_c = triton.next_power_of_2(d)
        block_m = max(1, min(triton.next_power_of_2(H), 4096 // block_c))
        q_blocks = triton.cdiv(H, block_m)
        _norm_rope_pair_kernel[(T, q_blocks + 1)](
            q, kv, kv_weight, positions, inv_freq.float().contiguous(), q_out, k_out, H, d, half, float(eps), q_blocks,
            positions.stride(0), q.stride(0), q.stride(1), kv.stride(0), q_out.stride(0), q_out.stride(1),
            k_out.stride(0), BLOCK_M=block_m, BLOCK_C=block_c, BLOCK_HALF=max(16, triton.next_power_of_2(half)),
            num_warps=4 if block_m * block_c >= 2048 else 2,
        )
    return q_out, k_out


@triton.jit
def _swiglu_kernel(gate_ptr, up_ptr, out_ptr, n, cols, stride_g, stride_u, stride_o, limit, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    r, c = i // cols, i % cols
    g = tl.minimum(tl.load(gate_ptr + r * stride_g + c, mask=ok, other=0.0).to(tl.float32), limit)
    u = tl.load(up_ptr + r * stride_u + c, mask=ok, other=0.0).to(tl.float32)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    tl.store(out_ptr + r * stride_o + c, (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty), mask=ok)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """Clamped SwiGLU of [T, I] gate and up (rows may be strided) in one launch: silu(min(g, limit)) *
    clamp(u, -limit, limit), computed in fp32."""
    T, I = gate.shape
    out = torch.empty((T, I), dtype=gate.dtype, device=gate.device)
    if gate.stride(1) != 1 or up.stride(1) != 1:
        gate, up = gate.contiguous(), up.contiguous()
    n = T * I
    if n:
        block = 1024
        _swiglu_kernel[(triton.cdiv(n, block),)](gate, up, out, n, I, gate.stride(0), up.stride(0), out.stride(0),
                                                 float(limit), BLOCK=block, num_warps=4)
    return out
