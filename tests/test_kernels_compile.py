"""The NVIDIA kernels whose tiles vary compile for Hopper (sm_90a), on the CPU: Triton ships its compiler.

An autotuned kernel compiles each of its configurations at its first call on the GPU, and a configuration the
compiler rejects with anything but a resource error (Triton 3.6 failed the FP4 experts' word decode at 128
columns on 4 warps: "Illegal shared layout", a RuntimeError) is not skipped by the autotuner: the call fails, on a
user's first long prefill; a tile that asks more shared memory than a multiprocessor has fails at launch.
So every configuration of the FP4 expert kernels is compiled here at the block rows
the engine gives them (16: mma, 64 and 128: wgmma; one block a pair), with the fixed tiles of the fused
pairs-and-shared-expert kernels, of the packed-row attention and indexer scores, and of the FP4 dequantization.
Compiling only, in a child process (the CPU
suite's other Triton checks run under the interpreter, chosen before triton is first imported).
"""

from __future__ import annotations

import json
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

I32, FP32 = "i32", "fp32"
# the index tensors as the engine passes them: the router's top-k ids and `moe._align`'s layout are int64
FP4_GATE_UP = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*u8", "slot_pair_ptr": "*i64", "block_expert_ptr": "*i64",
               "h_ptr": "*bf16", "D": I32, "I": I32, "top_k": I32, "limit": FP32, "stride_xt": I32,
               "stride_we": I32, "stride_wn": I32, "stride_se": I32, "stride_sn": I32, "stride_hm": I32}
FP4_DOWN = {"h_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*u8", "slot_pair_ptr": "*i64", "block_expert_ptr": "*i64",
            "pair_weight_ptr": "*fp32", "y_ptr": "*bf16", "D": I32, "I": I32, "stride_hm": I32, "stride_we": I32,
            "stride_wn": I32, "stride_se": I32, "stride_sn": I32, "stride_yp": I32}
SHARED_GATE_UP = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*u8", "ids_ptr": "*i64", "sw_ptr": "*fp8e4nv",
                  "ss_ptr": "*u8", "h_ptr": "*bf16", "D": I32, "I": I32, "top_k": I32, "limit": FP32, "pairs": I32,
                  "stride_xt": I32, "stride_we": I32, "stride_wn": I32, "stride_se": I32, "stride_sn": I32,
                  "stride_swn": I32, "stride_ssn": I32, "stride_ssk": I32, "stride_hm": I32}
SHARED_DOWN = {"h_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*u8", "ids_ptr": "*i64", "pair_weight_ptr": "*fp32",
               "sw_ptr": "*fp8e4nv", "ss_ptr": "*u8", "y_ptr": "*bf16", "D": I32, "I": I32, "top_k": I32,
               "pairs": I32, "stride_hm": I32, "stride_we": I32, "stride_wn": I32, "stride_se": I32, "stride_sn": I32,
               "stride_swn": I32, "stride_ssn": I32, "stride_ssk": I32, "stride_yr": I32}


def cases() -> dict:
    """name -> (kernel, signature, constexprs, num_warps, num_stages)."""
    from deepserve.backends.nvidia.triton_ops import fp4_moe, fp8_linear, packed_kv

    out = {}
    for config in fp4_moe.FP4_CONFIGS:
        tiles = dict(config.kwargs)
        label = f"{tiles['BLOCK_N']}x{tiles['BLOCK_K']}-w{config.num_warps}"
        for rows, per_pair in ((16, True), (16, False), (64, False), (128, False)):
            for name, kernel, sig in (("gate-up", fp4_moe._fp4_gate_up_swiglu_kernel, FP4_GATE_UP),
                                      ("down", fp4_moe._fp4_down_kernel, FP4_DOWN)):
                const = dict(tiles, BLOCK_M=rows, PRECISION="ieee", PER_PAIR=per_pair, EVEN=True)
                out[f"fp4-{name}-{label}-m{rows}{'-pairs' if per_pair else ''}"] = (
                    kernel, sig, const, config.num_warps, config.num_stages)
    from deepserve.backends.nvidia.triton_ops.moe import INVARIANT_TILES  # the batch-invariant mode's, fixed

    tiles = {k: v for k, v in INVARIANT_TILES.items() if k.isupper()}
    for name, kernel, sig in (("gate-up", fp4_moe._fp4_gate_up_swiglu_kernel, FP4_GATE_UP),
                              ("down", fp4_moe._fp4_down_kernel, FP4_DOWN)):
        const = dict(tiles, BLOCK_M=INVARIANT_TILES["block_m"], PRECISION="ieee", PER_PAIR=False, EVEN=True)
        out[f"fp4-{name}-invariant"] = (kernel, sig, const, INVARIANT_TILES["num_warps"],
                                        INVARIANT_TILES["num_stages"])
    tiles = fp4_moe._SHARED_TILES
    for bk, even in ((128, True), (64, False), (32, True)):  # V4's 128-column scale blocks; V4.1's 32
        for name, kernel, sig in (("gate-up", fp4_moe._pairs_shared_gate_up_kernel, SHARED_GATE_UP),
                                  ("down", fp4_moe._pairs_shared_down_kernel, SHARED_DOWN)):
            const = dict(BR=bk, BC=bk, BLOCK_N=tiles["BLOCK_N"], BLOCK_K=bk, PRECISION="ieee", EVEN=even)
            out[f"shared-{name}-k{bk}"] = (kernel, sig, const, tiles["num_warps"], tiles["num_stages"])
    attention = {"q_ptr": "*bf16", "codes_ptr": "*fp8e4nv", "bytes_ptr": "*u8", "rope_ptr": "*bf16", "idx_ptr": "*i64",
                 "sink_ptr": "*fp32", "out_ptr": "*bf16", "part_ptr": "*fp32", "stat_ptr": "*fp32", "pos_ptr": "*i64",
                 "freq_ptr": "*fp32", "K": I32, "H": I32, "scale_log2": FP32, "per_split": I32, "half": I32,
                 "stride_qt": I32, "stride_qh": I32, "stride_row": I32, "stride_it": I32, "stride_ot": I32,
                 "stride_oh": I32, "stride_pos": I32}
    for heads in (16, 64):  # a few queries' 16 heads a program; a full step's 64
        const = dict(D=512, NOPE=448, SCALES_AT=576, BLOCK_H=heads, BLOCK_N=64, PRECISION="ieee", SPLITS=1,
                     ROPE=True, BLOCKS=True)
        out[f"fp8kv-attention-h{heads}"] = (packed_kv._sparse_mqa_packed_kernel, attention, const, 8, 1)
    index = {"q_ptr": "*bf16", "w_ptr": "*fp32", "keys_ptr": "*u8", "keys_words_ptr": "*i32", "count_ptr": "*i32",
             "table_ptr": "*i64", "qrow_ptr": "*i64", "out_ptr": "*fp32", "Hi": I32, "width": I32, "stride_qt": I32,
             "stride_qh": I32, "stride_wt": I32, "stride_key": I32, "stride_tt": I32, "stride_ot": I32}
    const = dict(DI=128, BLOCK_HI=64, BLOCK_N=64, PRECISION="ieee", RPP=64, QROWS=True, WORDS=True)
    out["fp4-index-scores-words"] = (packed_kv._packed_index_scores_kernel, index, const, 4, 2)
    dequantize = {"w_ptr": "*i32", "s_ptr": "*u8", "out_ptr": "*bf16", "N": I32, "K": I32, "stride_wn": I32,
                  "stride_sn": I32, "stride_on": I32}
    out["fp4-dequantize"] = (fp4_moe._dequantize_kernel, dequantize, dict(BLOCK_N=32, BLOCK_K=64), 4, 3)
    fp8 = {"x_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "s_ptr": "*u8", "y_ptr": "*fp32",
           "out_ptr": "*bf16", "count_ptr": "*i32", "M": I32, "N": I32, "K": I32, "chunk": I32, "stride_xm": I32,
           "stride_xg": I32, "stride_xsm": I32, "stride_wn": I32, "stride_sn": I32, "stride_sk": I32,
           "stride_yp": I32, "stride_yg": I32, "stride_ym": I32, "stride_og": I32, "stride_om": I32}
    for rows, warps, stages in ((64, 4, 4), (128, 8, 3)):  # FP8 activations split over K, summed on arrival
        const = dict(BR=128, BC=128, E8M0=True, ACT_FP8=True, SPLIT=4, REDUCE=True, PRECISION="ieee",
                     BLOCK_M=rows, BLOCK_N=128, BLOCK_K=128)
        out[f"fp8-act-split-m{rows}"] = (fp8_linear._fp8_linear_kernel, fp8, const, warps, stages)
    return out


#: a Hopper multiprocessor's shared memory for one program (227 KB): more fails at launch (OutOfResources)
SHARED_MEMORY = 232448


def run_cases() -> dict[str, str]:
    from deepserve.backends.nvidia.cpu_compile import compile_for_gpu

    results = {}
    for name, (kernel, sig, const, warps, stages) in cases().items():
        try:
            shared = compile_for_gpu(kernel, sig, const, warps, stages).metadata.shared
            results[name] = "ok" if shared <= SHARED_MEMORY else f"{shared} bytes of shared memory"
        except Exception:  # noqa: BLE001 - reported to the parent test by name
            results[name] = traceback.format_exc()[-2000:]
    return results


@pytest.fixture(scope="module")
def compiled() -> dict:
    if torch.cuda.is_available():
        pytest.skip("with a GPU the kernels compile as they run (tests/gpu/)")
    done = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=900,
                          cwd=Path(__file__).parent)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _names() -> list[str]:
    # the case names without importing triton here (the suite's interpreter children choose it first)
    names = []
    for bn, bk, warps in ((64, 128, 4), (64, 64, 4), (128, 64, 8), (128, 128, 8)):
        for suffix in ("m16-pairs", "m16", "m64", "m128"):
            names += [f"fp4-gate-up-{bn}x{bk}-w{warps}-{suffix}", f"fp4-down-{bn}x{bk}-w{warps}-{suffix}"]
    names += ["fp4-gate-up-invariant", "fp4-down-invariant"]
    names += [f"shared-{k}-k{bk}" for bk in (128, 64, 32) for k in ("gate-up", "down")]
    return names + ["fp8kv-attention-h16", "fp8kv-attention-h64", "fp4-index-scores-words", "fp4-dequantize",
                    "fp8-act-split-m64", "fp8-act-split-m128"]


def test_every_case_is_named(compiled):
    assert sorted(compiled) == sorted(_names()), "FP4_CONFIGS changed: update _names"


@pytest.mark.parametrize("case", _names())
def test_kernel_compiles_for_hopper(compiled, case):
    assert compiled.get(case) == "ok", compiled.get(case)


if __name__ == "__main__":
    print(json.dumps(run_cases()))
