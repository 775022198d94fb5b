"""The NVIDIA backend's FP8 / FP4 Triton kernels (`fp8_linear`, `fp4_moe`) against the dequantized reference, on
the CPU under Triton's interpreter at small shapes. Skipped where triton is not installed (CPU CI by default) and
where a GPU is: tests/gpu/test_quant_kernels.py runs the same `check_*` functions there at V4-Flash shapes.

The interpreter must be chosen before triton is first imported (its own helpers, `tl.zeros`, are kernels made at
import), so the checks run in one child process started with TRITON_INTERPRET=1 (`python test_quant_triton.py`),
and each test reads its case's result.

Outputs are NaN-poisoned first (an element not written shows). The prefill path's activations are drawn so that
their FP8 quantization is exact (e4m3 values times a power of two, one 448 per group): Triton's interpreter
rounds some float-to-e4m3 conversions wrongly (a carry into the next binade is lost: 31.0 -> 16), which the GPU
does not, so here the check is of the scales, the layout and the products, and the GPU test adds random inputs.
"""

from __future__ import annotations

import os
import traceback
from types import SimpleNamespace

import pytest
import torch

from interpreted import child_main, run_child

from deepserve.backends.reference import ReferenceBackend
from deepserve.model import quant

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.importorskip("triton")  # only where it is installed; the child process imports it itself


# -- the checks (shared with tests/gpu/test_quant_kernels.py) ----------------------------------------------------

def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "output holds NaN (an element was not written)"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def poisoned(shape, dtype, device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def representable(shape, group: int, g: torch.Generator, device) -> torch.Tensor:
    """Rows whose per-`group` FP8 quantization is exact: e4m3 values times a power of two per group, each group's
    largest magnitude 448 (so its scale is that power of two)."""
    *lead, K = shape
    codes = torch.randint(0, 256, (*lead, K), generator=g, dtype=torch.int32).to(torch.uint8)
    values = codes.view(torch.float8_e4m3fn).float().nan_to_num(0.0).clamp(-448, 448)
    groups = -(-K // group)
    first = torch.arange(groups) * group
    values[..., first] = 448.0 * torch.where(torch.rand((*lead, groups), generator=g) < 0.5, -1.0, 1.0)
    powers = torch.randint(-12, -4, (*lead, groups), generator=g).float().exp2()
    return (values * powers.repeat_interleave(group, dim=-1)[..., :K]).to(device)


def stored_fp8(N: int, K: int, block, g, device, float_scales: bool = False):
    w = torch.randn(N, K, generator=g) / K**0.5
    q, s = quant.quantize_fp8(w, block=block)
    deq = quant.dequantize_fp8(q, s, block)
    if float_scales:  # fp32 multipliers (vLLM-style weight_scale_inv) instead of e8m0
        s = quant._scale_multipliers(s)
    return q.to(device), s.to(device), deq.to(device)


def check_fp8_linear(k, device, M, N, K, block=(128, 128), groups=1, act_fp8=False, dtype=torch.float32,
                     float_scales=False, seed=0, counters=False) -> None:
    """`fp8_linear` against x @ dequantized(W).T: W8A16 (decode) within the output dtype's rounding; the FP8
    prefill path on exactly quantizable x within it too (the same products, summed in another order).
    `counters`: split-K parts added in the kernel (arrival counters, left zero), the same result as the two-launch
    sum to fp32 rounding, twice in a row (the counters reset)."""
    g = torch.Generator().manual_seed(seed)
    q, s, deq = stored_fp8(groups * N, K, block, g, device, float_scales)
    shape = (M, groups, K) if groups > 1 else (M, K)
    group = min(128, block[1])
    x = (representable(shape, group, g, device) if act_fp8 else torch.randn(shape, generator=g).to(device)).to(dtype)
    out = poisoned((M, groups, N) if groups > 1 else (M, N), dtype, device)
    arrivals = torch.zeros(4096, dtype=torch.int32, device=device) if counters else None
    y = k.fp8_linear.fp8_linear(x, q, s, tuple(block), groups=groups, act_fp8=act_fp8, out=out, counters=arrivals)
    assert y.data_ptr() == out.data_ptr()
    ref = torch.einsum("mgk,gnk->mgn", x.float().view(M, groups, K), deq.view(groups, N, K)).view(out.shape)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(y, ref) < tol, (M, N, K, block, groups, act_fp8)
    if counters:
        assert not arrivals.any(), "the arrival counters were not left zero"
        again = k.fp8_linear.fp8_linear(x, q, s, tuple(block), groups=groups, act_fp8=act_fp8, counters=arrivals)
        unsplit_sum = k.fp8_linear.fp8_linear(x, q, s, tuple(block), groups=groups, act_fp8=act_fp8)
        assert torch.equal(again, y) and rel_err(unsplit_sum, y) < tol


def check_act_quant(k, device, M, K, group, seed=0, exact_rounding=False) -> None:
    """`act_quant`'s scales (exact powers of two) and codes against the torch version; `exact_rounding` (GPU):
    on random rows, every code (round to nearest even) too."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(device) * 3 if exact_rounding else representable((M, K), group, g, device)
    x = x.to(torch.bfloat16).float()
    q, s = k.fp8_linear.act_quant(x, group)
    q_ref, s_ref = k.fp8_linear.act_quant_reference(x, group)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.float(), q_ref.float())


def fp4_experts(E: int, D: int, I: int, g: torch.Generator, device) -> tuple:
    """Random routed experts as stored: FP4 w13 [E, 2I, D] and w2 [E, D, I] (`QuantizedWeight`s)."""
    return tuple(quant.QuantizedWeight(*(t.to(device) for t in quant.quantize_fp4(torch.randn(*shape, generator=g)
                                                                               / shape[-1]**0.5)), (1, 32))
                 for shape in ((E, 2 * I, D), (E, D, I)))


def check_fp4_moe(k, device, T, D, I, E, top_k, dtype=torch.float32, seed=0, per_pair=None) -> None:
    """`fp4_moe_experts` against the reference backend's dequantizing `quantized_moe_experts` (fp32, on the CPU),
    within the dtype's rounding; every (token, expert) row written. `per_pair`: one block a pair (True),
    expert-sorted blocks (False), or the kernels' own choice by pairs (None)."""
    g = torch.Generator().manual_seed(seed)
    w13, w2 = fp4_experts(E, D, I, g, device)
    x = torch.randn(T, D, generator=g).to(device, dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(T)]).to(device)
    weights = torch.rand(T, top_k, generator=g).to(device)
    ref = ReferenceBackend(device, exact=False).quantized_moe_experts(x.float(), ids, weights, w13, w2, 7.0)
    pair_out = poisoned((T * top_k, D), dtype, device)
    y = k.fp4_moe.fp4_moe_experts(x, ids, weights, w13.data, w13.scale, w2.data, w2.scale, 7.0, pair_out=pair_out,
                                  per_pair=per_pair)
    assert not torch.isnan(pair_out).any(), "a (token, expert) pair was not written"
    assert rel_err(y, ref) < (1e-5 if dtype == torch.float32 else 1e-2)


def check_fp4_moe_with_shared(k, device, T, D, I, E, top_k, block, dtype=torch.float32, seed=0) -> None:
    """`fp4_moe_with_shared` (routed FP4 experts and an FP8 shared expert in two launches) against the reference
    backend's routed experts plus the dequantized shared expert's clamped SwiGLU, in fp32 on the CPU."""
    g = torch.Generator().manual_seed(seed)
    w13, w2 = fp4_experts(E, D, I, g, device)
    s13 = quant.QuantizedWeight(*(t.to(device) for t in quant.quantize_fp8(torch.randn(2 * I, D, generator=g)
                                                                         / D**0.5, block=block)), block)
    s2 = quant.QuantizedWeight(*(t.to(device) for t in quant.quantize_fp8(torch.randn(D, I, generator=g) / I**0.5,
                                                                        block=block)), block)
    x = torch.randn(T, D, generator=g).to(device, dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(T)]).to(device)
    weights = torch.rand(T, top_k, generator=g).to(device)
    xf = x.float().cpu()
    routed = ReferenceBackend("cpu", exact=False).quantized_moe_experts(
        xf, ids.cpu(), weights.cpu(), *(quant.QuantizedWeight(w.data.cpu(), w.scale.cpu(), w.block) for w in (w13, w2)),
        7.0)
    gate, up = (xf @ s13.dequantize(torch.float32).cpu().t()).split(I, dim=1)
    swiglu = torch.nn.functional.silu(gate.clamp(max=7.0)) * up.clamp(-7.0, 7.0)
    shared = swiglu @ s2.dequantize(torch.float32).cpu().t()
    y = k.fp4_moe.fp4_moe_with_shared(x, ids, weights, w13.data, w13.scale, w2.data, w2.scale, 7.0, s13.data,
                                      s13.scale, s2.data, s2.scale, block)
    assert y.shape == (T, D) and y.dtype == dtype
    assert rel_err(y.cpu(), routed + shared) < (1e-5 if dtype == torch.float32 else 2e-2)


def check_fp4_dequantize(k, device, dtype, rows=16, cols=256) -> None:
    """`fp4_moe.dequantize` (the FP4 kernels' own decode, `_fp4_tile`) against `quant.dequantize_fp4`, bit for
    bit: every one of the 16 codes (the subnormal 0.5 among them) at scales from 2^-30 to 2^4 (past 2^1, where
    2^126 times the scale is no float: the decode multiplies by the two apart), two experts stacked."""
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (2, rows, cols), generator=g, dtype=torch.uint8)
    codes[0, 0, :16] = torch.arange(16, dtype=torch.uint8)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).view(torch.int8)
    scale = torch.randint(97, 132, (2, rows, cols // 32), generator=g, dtype=torch.uint8)
    ref = quant.dequantize_fp4(packed, scale).to(dtype)
    out = k.fp4_moe.dequantize(packed.to(device), scale.to(device), dtype).cpu()
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(out.view(bits), ref.view(bits)), (out - ref).abs().max()


# -- on the CPU, interpreted ---------------------------------------------------------------------------------------

CASES = {
    # decode (W8A16): split K; K not a multiple of the block with fp32 scale multipliers; V4.1's 32x32 blocks
    # grouped as o_a is, the groups not aligned to the blocks
    "fp8-decode-split-k": (check_fp8_linear, dict(M=3, N=96, K=256)),
    "fp8-decode-ragged-k-fp32-scales": (check_fp8_linear, dict(M=20, N=64, K=300, float_scales=True)),
    "fp8-decode-grouped-32x32": (check_fp8_linear, dict(M=5, N=40, K=96, block=(32, 32), groups=3)),
    # the split-K parts added in the kernel by the last program to arrive (as the backend calls it)
    "fp8-decode-split-k-counters": (check_fp8_linear, dict(M=3, N=96, K=512, counters=True)),
    "fp8-decode-grouped-counters": (check_fp8_linear, dict(M=2, N=64, K=384, block=(32, 32), groups=3,
                                                           counters=True)),
    "fp8-prefill": (check_fp8_linear, dict(M=40, N=64, K=300, act_fp8=True)),
    # FP8 activations at a decode batch past 16 rows: one output tile, K split over programs, parts added in
    # the kernel (and, without counters, by torch)
    "fp8-act-split-k-counters": (check_fp8_linear, dict(M=40, N=64, K=512, act_fp8=True, counters=True)),
    "fp8-act-split-k-grouped": (check_fp8_linear, dict(M=20, N=40, K=256, block=(32, 32), groups=2, act_fp8=True)),
    "fp8-prefill-grouped-32x32": (check_fp8_linear, dict(M=20, N=40, K=96, block=(32, 32), groups=2, act_fp8=True)),
    "act-quant-128": (check_act_quant, dict(M=33, K=300, group=128)),
    "act-quant-32": (check_act_quant, dict(M=5, K=64, group=32)),
    "fp4-moe": (check_fp4_moe, dict(T=5, D=96, I=64, E=6, top_k=2, per_pair=False)),
    "fp4-moe-ragged": (check_fp4_moe, dict(T=40, D=64, I=48, E=4, top_k=3)),
    # one block a pair: a decode step's few pairs (the default's choice), and ragged K and N past one tile
    "fp4-moe-pairs": (check_fp4_moe, dict(T=2, D=96, I=64, E=6, top_k=3)),
    "fp4-moe-pairs-ragged": (check_fp4_moe, dict(T=3, D=160, I=80, E=4, top_k=2, per_pair=True)),
    # a decode step's pairs and the FP8 shared expert in two launches: whole tiles (V4's 128-column scale blocks
    # shrunk to 64), and ragged dims with V4.1's 32x32 blocks
    "fp4-moe-with-shared": (check_fp4_moe_with_shared, dict(T=1, D=128, I=64, E=5, top_k=3, block=(64, 64))),
    "fp4-moe-with-shared-ragged-bf16": (check_fp4_moe_with_shared, dict(T=2, D=96, I=48, E=4, top_k=2, block=(32, 32),
                                                                       dtype=torch.bfloat16)),
    # the decode bit for bit, in fp32 (a code to a 32-bit operation) and bf16 (two codes a 32-bit operation, bf16
    # multiplications); and both paths' products in bf16
    "fp4-decode-fp32": (check_fp4_dequantize, dict(dtype=torch.float32)),
    "fp4-decode-bf16": (check_fp4_dequantize, dict(dtype=torch.bfloat16)),
    "fp4-moe-bf16-pairs": (check_fp4_moe, dict(T=2, D=96, I=64, E=6, top_k=3, dtype=torch.bfloat16)),
    "fp4-moe-bf16-grouped": (check_fp4_moe, dict(T=5, D=96, I=64, E=6, top_k=2, per_pair=False,
                                                 dtype=torch.bfloat16)),
}


def run_cases() -> dict[str, str]:
    """Every case under this process's triton (the child's entry point): name -> 'ok' or the failure."""
    from deepserve.backends.nvidia.triton_ops import fp4_moe, fp8_linear

    kernels, results = SimpleNamespace(fp8_linear=fp8_linear, fp4_moe=fp4_moe), {}
    for name, (check, kwargs) in CASES.items():
        try:
            check(kernels, "cpu", **kwargs)
            results[name] = "ok"
        except Exception:  # noqa: BLE001 - reported to the parent test by name
            results[name] = traceback.format_exc()
    return results


@pytest.fixture(scope="module")
def interpreted() -> dict[str, str]:
    return run_child(__file__, timeout=300, gpu_twin="tests/gpu/test_quant_kernels.py")


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_against_dequantized_reference(interpreted, case):
    assert interpreted[case] == "ok", interpreted[case]


if __name__ == "__main__":
    child_main(run_cases)
