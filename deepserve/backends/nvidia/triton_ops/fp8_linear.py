"""Projections with FP8 e4m3 weights in UE8M0 block scales, read as stored (`deepserve.model.quant`).

Two modes of one kernel, by rows:

* Prefill and batches past GEMV_ROWS (`ACT_FP8`): each row of x is quantized to FP8 per group of BLOCK_K inputs
  on the fly (`act_quant`, one launch: a power-of-two scale per group, `2^ceil(log2(amax / 448))`, as
  DeepSeek's `act_quant` with `scale_fmt: ue8m0`; quantized once, not once per column tile), the FP8 tiles
  multiply on Hopper's FP8 tensor cores, and each K step's product is promoted to fp32 times the row's
  activation scale and the weight block's. BLOCK_K divides the weight block's columns (128 for V4, 32 for
  V4.1), so one weight scale serves a K step.
* Decode (`gemv`, a few rows): the weight tile is dequantized in registers to x's dtype (exact: an e4m3 value
  times a power of two is a bf16 value) and multiplied with x as it is (W8A16), the rows padded to the 16 a
  tensor-core dot needs; K is split so that narrow projections still fill the GPU, the fp32 parts summed in
  split order. The result is then the product with the dequantized weight, up to fp32 summation order.

A grouped projection (`grouped`, V4's o_a: x [T, G, K], weight rows split into G groups) is the same with a group
per grid row; a group's weight rows need not align with the scale blocks (each row finds its own scale row).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import SMS, dot_precision, ue8m0
from .gemv import add_parts_on_arrival

FP8_MAX = 448.0
#: rows up to which the decode path (W8A16, split K) is taken
GEMV_ROWS = 16


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_xg, stride_qm, stride_sm, G,
                      BLOCK_M: tl.constexpr, GROUP: tl.constexpr):
    """One [BLOCK_M, GROUP] tile of x (group g of a grouped x along program axis 2) -> e4m3 and its rows'
    power-of-two scales."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    k = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    g = tl.program_id(2)
    ok = (m < M)[:, None] & (k < K)[None, :]
    x = tl.load(x_ptr + m.to(tl.int64)[:, None] * stride_xm + g * stride_xg + k[None, :], mask=ok, other=0.0)
    x = x.to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4)
    scale = tl.exp2(tl.ceil(tl.log2(amax / 448.0)))
    q = (x / scale[:, None]).to(tl.float8e4nv)
    tl.store(q_ptr + (g * M + m).to(tl.int64)[:, None] * stride_qm + k[None, :], q, mask=ok)
    tl.store(s_ptr + (g * M + m).to(tl.int64) * stride_sm + tl.program_id(1), scale, mask=m < M)


@triton.jit
def _fp8_linear_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, y_ptr, out_ptr, count_ptr, M, N, K, chunk,
                       stride_xm, stride_xg, stride_xsm, stride_wn, stride_sn, stride_sk, stride_yp, stride_yg,
                       stride_ym, stride_og, stride_om,
                       BR: tl.constexpr, BC: tl.constexpr, E8M0: tl.constexpr, ACT_FP8: tl.constexpr,
                       SPLIT: tl.constexpr, REDUCE: tl.constexpr, PRECISION: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """ACT_FP8: x is `act_quant`'s e4m3 [G * M, K] with scales xs [G * M, K / BLOCK_K]; else x's own dtype.
    REDUCE (with SPLIT > 1): the fp32 parts in y are added here, by the last program of an output tile to arrive
    (`gemv.add_parts_on_arrival`; `count_ptr`: an arrival counter per tile), and stored once in out's dtype."""
    g = tl.program_id(2) // SPLIT
    part = tl.program_id(2) % SPLIT
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (g * N + n).to(tl.int64)  # this group's rows of the stored weight
    if ACT_FP8:
        x_rows = x_ptr + (g * M + m).to(tl.int64)[:, None] * stride_xm
        xs_rows = xs_ptr + (g * M + m).to(tl.int64) * stride_xsm
    else:
        x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm + g * stride_xg
    w_rows = w_ptr + rows[:, None] * stride_wn
    s_rows = s_ptr + (rows // BR) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    k_first = part * chunk
    for step in range(0, chunk, BLOCK_K):
        k0 = k_first + step
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_rows + k[None, :], mask=(m < M)[:, None] & (k < K)[None, :], other=0.0)
        w = tl.load(w_rows + k[None, :], mask=(n < N)[:, None] & (k < K)[None, :], other=0.0)
        sw = tl.load(s_rows + (k0 // BC) * stride_sk, mask=n < tl.where(k0 < K, N, 0), other=0)
        if E8M0:  # (exp2 of the byte cost an int-to-float conversion and a special function each)
            sw = ue8m0(sw)
        else:
            sw = sw.to(tl.float32)
        if ACT_FP8:  # each K step's FP8 product promoted to fp32 with both scales, as DeepGEMM does
            sa = tl.load(xs_rows + k0 // BLOCK_K, mask=m < tl.where(k0 < K, M, 0), other=0.0)
            acc += tl.dot(a, tl.trans(w)) * (sa[:, None] * sw[None, :])
        else:
            wd = (w.to(tl.float32) * sw[:, None]).to(x_ptr.dtype.element_ty)
            acc = tl.dot(a, tl.trans(wd), acc, input_precision=PRECISION)
    ok = (m < M)[:, None] & (n < N)[None, :]
    parts = y_ptr + g * stride_yg + m.to(tl.int64)[:, None] * stride_ym + n[None, :]
    if REDUCE:
        tile = (g * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(0) + tl.program_id(0)
        add_parts_on_arrival(acc, parts, part, stride_yp, count_ptr + tile,
                             out_ptr + g * stride_og + m.to(tl.int64)[:, None] * stride_om + n[None, :], ok, SPLIT,
                             BLOCK_M, BLOCK_N)
    else:
        tl.store(parts + part * stride_yp, acc.to(y_ptr.dtype.element_ty), mask=ok)


def act_quant(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] or [M, G, K] -> (e4m3 [G * M, K] (group-major rows), fp32 power-of-two scales
    [G * M, ceil(K / group)]): DeepSeek's `act_quant` with UE8M0 scales (`act_quant_reference`)."""
    M, K = x.shape[0], x.shape[-1]
    G = x.shape[1] if x.dim() == 3 else 1
    q = torch.empty((G * M, K), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((G * M, triton.cdiv(K, group)), dtype=torch.float32, device=x.device)
    if M:
        x_ = x if x.stride(-1) == 1 else x.contiguous()
        _act_quant_kernel[(triton.cdiv(M, 32), triton.cdiv(K, group), G)](
            x_, q, s, M, K, x_.stride(0), x_.stride(1) if G > 1 else 0, q.stride(0), s.stride(0), G,
            BLOCK_M=32, GROUP=group, num_warps=4)
    return q, s


def act_quant_reference(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefill path's activation quantization in torch (the kernel's oracle): x [M, K] -> (e4m3 [M, K],
    fp32 power-of-two scales [M, ceil(K / group)])."""
    M, K = x.shape
    groups = -(-K // group)
    padded = torch.zeros(M, groups * group, dtype=torch.float32, device=x.device)
    padded[:, :K] = x.float()
    amax = padded.view(M, groups, group).abs().amax(-1).clamp(min=1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    q = (padded.view(M, groups, group) / scale[..., None]).view(M, -1)[:, :K].to(torch.float8_e4m3fn)
    return q, scale


def _scales(scale: torch.Tensor) -> tuple[torch.Tensor, bool]:
    if scale.dtype == torch.uint8 or scale.dtype == getattr(torch, "float8_e8m0fnu", None):
        return scale.view(torch.uint8), True
    return scale.float(), False


def _tiles(M: int, block_k: int, act_fp8: bool) -> dict:
    if not act_fp8:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=block_k, num_warps=4, num_stages=4)
    if M <= 64:
        return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=block_k, num_warps=4, num_stages=4)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=block_k, num_warps=8, num_stages=3)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
               groups: int = 1, act_fp8: bool | None = None, tiles: dict | None = None,
               out: torch.Tensor | None = None, counters: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ W.T` for FP8 W [groups * N, K] with scales [ceil(rows / block[0]), ceil(K / block[1])] (e8m0 bits or
    fp32 multipliers). x [M, K] (groups 1) or [M, G, K] -> [M, N] / [M, G, N] in x's dtype.

    `act_fp8`: the prefill path (activations quantized to FP8 per group of `min(128, block[1])`); default: for
    more than GEMV_ROWS rows. `tiles` fixes BLOCK_M/N/K, num_warps, num_stages (benchmarks). `out`: the
    result's tensor (x's dtype, contiguous), else a new one. `counters`: zeroed int32 arrival counters on x's
    device (as `gemv.grouped_gemv` takes them; a call leaves them zero), at least one per output tile: the split-K
    parts are then added inside the kernel, else by two more launches (a sum and a cast)."""
    grouped = x.dim() == 3
    if grouped != (groups > 1) or (grouped and x.shape[1] != groups):
        raise ValueError(f"x {tuple(x.shape)} does not match {groups} weight groups")
    M, K = x.shape[0], x.shape[-1]
    rows, k_w = weight.shape
    if k_w != K or rows % groups:
        raise ValueError(f"weight {tuple(weight.shape)} does not fit x {tuple(x.shape)} in {groups} groups")
    N = rows // groups
    act_fp8 = M > GEMV_ROWS if act_fp8 is None else act_fp8
    block_k = min(128, block[1])
    if block[1] % block_k:
        raise ValueError(f"weight block columns {block[1]} are not a multiple of {block_k}")
    cfg = {**_tiles(M, block_k, act_fp8), **(tiles or {})}
    bm, bn, bk = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
    s, e8m0 = _scales(scale)
    grid_n, grid_m = triton.cdiv(N, bn), triton.cdiv(M, bm)
    steps = triton.cdiv(K, bk)
    # K split over programs where the output tiles are too few to fill the GPU: a decode step's W8A16 product, and
    # FP8 activations at a batch of 17-64 rows (one 64-row tile: wq_a's 1,024 columns were 8 programs, each
    # streaming an eighth of the weight); at least two K steps a part there
    programs = grid_n * grid_m * groups
    split = max(1, min(steps // 2 if act_fp8 else steps, triton.cdiv(2 * SMS, programs)))
    chunk = triton.cdiv(steps, split) * bk
    split = triton.cdiv(K, chunk)
    shape = (M, groups, N) if grouped else (M, N)
    if out is not None and (tuple(out.shape) != shape or out.dtype != x.dtype or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous {x.dtype} tensor of shape {shape}")
    reduce = split > 1 and counters is not None and counters.numel() >= grid_n * grid_m * groups
    result = out if out is not None else torch.empty(shape, dtype=x.dtype, device=x.device)
    if split == 1:
        y = result.view(1, M, groups, N)
    else:
        y = torch.empty((split, M, groups, N), dtype=torch.float32, device=x.device)
    o = result.view(M, groups, N)
    if M:
        if act_fp8:
            a, a_scale = act_quant(x, bk)
            strides = (a.stride(0), 0, a_scale.stride(0))
        else:
            a = x if x.stride(-1) == 1 else x.contiguous()
            a_scale, strides = a, (a.stride(0), a.stride(1) if grouped else 0, 0)
        _fp8_linear_kernel[(grid_n, grid_m, groups * split)](
            a, a_scale, weight, s, y, o, counters if reduce else o, M, N, K, chunk, *strides, weight.stride(0),
            s.stride(0), s.stride(1), y.stride(0), y.stride(2), y.stride(1), o.stride(1), o.stride(0),
            BR=block[0], BC=block[1], E8M0=e8m0, ACT_FP8=act_fp8, SPLIT=split, REDUCE=reduce,
            PRECISION=dot_precision(x.dtype), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **cfg)
    if split == 1 or reduce or not M:
        return result
    return result.copy_(y.sum(0).view(shape))
