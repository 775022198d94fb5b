"""What a Triton kernel's hot loop costs in instructions on Hopper, without a GPU: compile it for sm_90a here (Triton
ships ptxas and nvdisasm), find its loops in the SASS, and count each loop's instructions by the pipe that runs
them, per byte of weights the loop streams.

    python bench/investigations/sass_mix.py [--cases fp4_pair,fp4_grouped,...] [--out FILE]
    PYTHONPATH=/tmp/old python bench/investigations/sass_mix.py ...    # another tree's kernels

Why: a decode step's projections should be bound by the bytes they read (3.35 TB/s on an H100 SXM: about 15 bytes
a clock per multiprocessor at 1.755 GHz). A kernel that decodes stored weights in registers spends instructions
per byte; if its loop needs more issue slots (or more slots of one pipe) than the bytes allow, it is bound by
the instructions, not the memory. The stored model's FP4 experts ran at about a tenth of their bytes on an H100
(bench/investigations/stored_profile.py), which this shows before and after a change, on a CPU.

The model (a bound, not a timing): each of the 4 sub-partitions of a multiprocessor issues one warp instruction a
clock; per sub-partition the FMA pipe takes one warp instruction a clock (FADD, FMUL, FFMA, HMUL2, ...), the integer
ALU and IMAD half of that (16 lanes), conversions and special functions an eighth (4 lanes), loads and shuffles
a quarter. A loop's clocks per iteration on one sub-partition are at least its instructions, and at least each
pipe's instructions over that pipe's rate. Bytes per clock per multiprocessor = bytes a CTA's iteration streams
/ (the busiest bound x the CTA's warps / 4). Latency, occupancy and the memory system are left out: the
bound says whether the instructions alone can keep up with the bytes, not how fast the kernel runs.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT))  # after PYTHONPATH: `PYTHONPATH=/tmp/old` counts that tree's kernels

SMS, CLOCK_GHZ = 132, 1.755  # an H100 SXM's multiprocessors and its clock under load
HBM_TB_S = 3.35
FP8_PEAK_TFLOP_S = 1979  # dense, the data sheet's (bench/gpu.py measured 1,285 on an H100 in stop 37)

#: warp instructions a clock per sub-partition, by pipe; an opcode not listed counts against issue only
RATES = {"fp32": 1.0, "alu": 0.5, "imad": 0.5, "conv": 0.125, "mufu": 0.125, "lsu": 0.25, "tensor": None}
PIPES = {
    "fp32": {"FADD", "FMUL", "FFMA", "FMNMX", "FSETP", "FSEL", "FCHK", "HADD2", "HMUL2", "HFMA2", "HMNMX2"},
    "alu": {"LOP3", "SHF", "IADD3", "ISETP", "SEL", "PRMT", "LEA", "SGXT", "VIADD", "IMNMX", "LOP", "BFE", "BFI",
            "FLO", "POPC", "PLOP3", "VIMNMX", "IABS", "F2FP"},
    "imad": {"IMAD", "IMUL"},
    "conv": {"F2F", "F2I", "I2F", "I2FP", "F2IP", "FRND"},
    "mufu": {"MUFU"},
    "lsu": {"LDG", "LDS", "STS", "STG", "LDL", "STL", "SHFL", "LDSM", "ATOM", "ATOMS", "RED", "LD", "ST"},
    "tensor": {"HMMA", "HGMMA", "IMMA", "QGMMA"},
}
OPCODE = re.compile(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")
LABEL = re.compile(r"^(\.L_x_\d+):")
BRANCH = re.compile(r"BRA\s+`?\(?(\.L_x_\d+)")


def compile_sass(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int,
                 odd: tuple = ("M", "top_k")) -> str:
    """The kernel's SASS for sm_90a (`deepserve.backends.nvidia.cpu_compile`: pointers 16-byte aligned and
    integers multiples of 16 as the JIT specializes them, but those in `odd`)."""
    import importlib.util

    # this tree's helper by its path (under PYTHONPATH=/tmp/old the package is another tree's, maybe without it)
    spec = importlib.util.spec_from_file_location("cpu_compile", ROOT / "deepserve/backends/nvidia/cpu_compile.py")
    helper = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helper)
    return helper.sass(helper.compile_for_gpu(fn, signature, constexprs, num_warps, num_stages, odd))


def loops(sass: str) -> list[collections.Counter]:
    """Each loop (a label with a backward branch to it) as its opcode counts, innermost bodies included."""
    lines = sass.splitlines()
    at: dict[str, int] = {}
    found = []
    for i, line in enumerate(lines):
        m = LABEL.match(line.strip())
        if m:
            at[m.group(1)] = i
        b = BRANCH.search(line)
        if b and b.group(1) in at and at[b.group(1)] < i:
            found.append(collections.Counter(
                m.group(1) for m in map(OPCODE.search, lines[at[b.group(1)]:i + 1]) if m))
    return found


def pipe_counts(ops: collections.Counter) -> dict[str, int]:
    out = {p: 0 for p in PIPES}
    for op, n in ops.items():
        for pipe, names in PIPES.items():
            if op in names:
                out[pipe] += n
                break
    return out


def bound(ops: collections.Counter, bytes_per_iteration: int, num_warps: int, flops_per_iteration: int = 0) -> dict:
    """Clocks a sub-partition needs per iteration of one warp (issue and each pipe) and the bytes per clock per
    multiprocessor the busiest allows, with the H100's HBM rate for scale; with `flops_per_iteration` (a CTA's
    tensor-core work an iteration) also the FLOP rate the instructions allow, against FP8's dense peak."""
    pipes = pipe_counts(ops)
    clocks = {"issue": sum(ops.values())}
    clocks.update({p: n / RATES[p] for p, n in pipes.items() if RATES[p]})
    worst = max(clocks, key=clocks.get)
    sm_clocks = clocks[worst] * num_warps / 4  # a CTA's iteration on one multiprocessor
    per_clock = bytes_per_iteration / sm_clocks
    out = {"instructions": sum(ops.values()), "pipes": pipes, "bound_by": worst,
           "instructions_per_byte": round(sum(ops.values()) * num_warps / bytes_per_iteration, 3),
           "bytes_per_clock_per_sm": round(per_clock, 2),
           "bound_TB_s": round(per_clock * SMS * CLOCK_GHZ / 1e3, 2), "hbm_TB_s": HBM_TB_S,
           "top": dict(ops.most_common(12))}
    if flops_per_iteration:
        out["bound_TFLOP_s"] = round(flops_per_iteration / sm_clocks * SMS * CLOCK_GHZ / 1e3, 0)
        out["fp8_peak_TFLOP_s"] = FP8_PEAK_TFLOP_S
    return out


def cases() -> dict:
    """name -> (kernel, signature, constexprs, warps, stages, bytes of weights a CTA's loop iteration reads[, its
    tensor-core FLOPs])."""
    from deepserve.backends.nvidia.triton_ops import attention, fp4_moe, fp8_linear, gemv, packed_kv

    i32, fp32 = "i32", "fp32"
    pair = dict(BLOCK_N=64, BLOCK_K=128)
    grouped = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, PRECISION="ieee")
    fp8 = dict(BR=128, BC=128, E8M0=True, ACT_FP8=False, SPLIT=4, REDUCE=True, PRECISION="ieee",
               BLOCK_M=16, BLOCK_N=64, BLOCK_K=128)
    dense = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, PRECISION="ieee", SPLIT=4, NORM=False)
    fp4_sig = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*u8", "slot_pair_ptr": "*i64", "block_expert_ptr": "*i64",
               "h_ptr": "*bf16", "D": i32, "I": i32, "top_k": i32, "limit": fp32, "stride_xt": i32, "stride_we": i32,
               "stride_wn": i32, "stride_se": i32, "stride_sn": i32, "stride_hm": i32}
    fp4_bytes = 2 * grouped["BLOCK_N"] * grouped["BLOCK_K"] // 2  # a gate and an up tile an iteration
    if hasattr(fp4_moe, "_fp4_pair_gate_up_kernel"):  # (the tree before the word decode: bytes, a kernel a path)
        fp4 = {
            "fp4_pair": (fp4_moe._fp4_pair_gate_up_kernel,
                         {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*u8", "ids_ptr": "*i64", "h_ptr": "*bf16",
                          "D": i32, "I": i32, "top_k": i32, "limit": fp32, "stride_xt": i32, "stride_we": i32,
                          "stride_wn": i32, "stride_se": i32, "stride_sn": i32, "stride_hp": i32},
                         pair, 4, 3, fp4_bytes),
            "fp4_grouped": (fp4_moe._fp4_gate_up_swiglu_kernel.fn, {**fp4_sig, "w_ptr": "*u8"}, grouped, 4, 3,
                            fp4_bytes)}
    else:
        fp4 = {name: (fp4_moe._fp4_gate_up_swiglu_kernel.fn, fp4_sig, {**grouped, "PER_PAIR": per_pair, "EVEN": True},
                      4, 3, fp4_bytes) for name, per_pair in (("fp4_pair", True), ("fp4_grouped", False))}
    attn = {"sink_ptr": "*fp32", "out_ptr": "*bf16", "part_ptr": "*fp32", "stat_ptr": "*fp32", "pos_ptr": "*i64",
            "freq_ptr": "*fp32", "K": i32, "H": i32, "scale_log2": fp32, "per_split": i32, "half": i32,
            "stride_qt": i32, "stride_qh": i32}
    strides = {"stride_it": i32, "stride_ot": i32, "stride_oh": i32, "stride_pos": i32}
    # a decode step's sparse attention at V4-Flash's widths (512-dim rows, 64 heads a program), a key block an
    # iteration: the FP8 KV cache's packed rows (592 bytes a row, 583 of them read; 32 keys a block before the
    # block decode, 64 since) against bf16 rows (1,024)
    packed = {"D": 512, "NOPE": 448, "SCALES_AT": 576, "BLOCK_H": 64, "BLOCK_N": 32, "PRECISION": "ieee",
              "SPLITS": 1, "ROPE": True}
    if "BLOCKS" in packed_kv._sparse_mqa_packed_kernel.arg_names:  # (64 keys a block since the block decode)
        packed.update(BLOCKS=True, BLOCK_N=64)
    table = {
        "fp8kv_attention": (packed_kv._sparse_mqa_packed_kernel,
                            {"q_ptr": "*bf16", "codes_ptr": "*fp8e4nv", "bytes_ptr": "*u8", "rope_ptr": "*bf16",
                             "idx_ptr": "*i64", **attn, "stride_row": i32, **strides},
                            packed, 8, 1, packed["BLOCK_N"] * 583),
        "bf16_attention": (attention._sparse_mqa_kernel,
                           {"q_ptr": "*bf16", "kv_ptr": "*bf16", "idx_ptr": "*i64", **attn, "stride_kvn": i32,
                            **strides},
                           {"D": 512, "BLOCK_H": 64, "BLOCK_N": 64, "PRECISION": "ieee", "SPLITS": 1, "ROPE": True},
                           8, 2, 64 * 1024),
    }
    fp8_sig = {"x_ptr": "*bf16", "xs_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*u8", "y_ptr": "*fp32",
               "out_ptr": "*bf16", "count_ptr": "*i32", "M": i32, "N": i32, "K": i32, "chunk": i32,
               "stride_xm": i32, "stride_xg": i32, "stride_xsm": i32, "stride_wn": i32, "stride_sn": i32,
               "stride_sk": i32, "stride_yp": i32, "stride_yg": i32, "stride_ym": i32, "stride_og": i32,
               "stride_om": i32}
    return {
        **table,
        **fp4,
        "fp8_gemv": (fp8_linear._fp8_linear_kernel, fp8_sig, fp8, 4, 4, fp8["BLOCK_N"] * fp8["BLOCK_K"]),
        # the prefill path: FP8 activations on FP8 tensor cores, each K step's product promoted with both scales
        "fp8_prefill": (fp8_linear._fp8_linear_kernel, {**fp8_sig, "x_ptr": "*fp8e4nv", "xs_ptr": "*fp32"},
                        {**fp8, "ACT_FP8": True, "SPLIT": 1, "REDUCE": False, "BLOCK_M": 128, "BLOCK_N": 128},
                        8, 3, 128 * 128, 2 * 128 * 128 * 128),
        "bf16_gemv": (gemv._gemv_kernel,
                      {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32",
                       "count_ptr": "*i32", "norm_ptr": "*bf16", "M": i32, "N": i32, "K": i32, "chunk": i32,
                       "eps": fp32, "stride_xg": i32, "stride_xm": i32, "stride_wg": i32, "stride_wn": i32,
                       "stride_og": i32, "stride_om": i32},
                      dense, 2, 3, 2 * dense["BLOCK_N"] * dense["BLOCK_K"]),
    }


def measure(names: list[str]) -> dict:
    table = cases()
    out = {}
    for name in names:
        fn, sig, const, warps, stages, nbytes, *flops = table[name]
        odd = ("top_k",) if flops else ("M", "top_k")
        found = loops(compile_sass(fn, sig, const, warps, stages, odd=odd))
        if not found:
            raise SystemExit(f"{name}: no loop found in its SASS")
        # the loops that stream the weights: the largest, and any within a tenth of it (fp4_pair: gate and up)
        big = max(sum(c.values()) for c in found)
        hot = [c for c in found if sum(c.values()) >= 0.9 * big]
        per_iteration = sum(hot, collections.Counter())
        out[name] = {"constexprs": const, "num_warps": warps, "loops": len(hot),
                     "bytes_per_iteration": nbytes, **bound(per_iteration, nbytes, warps, *flops)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="fp4_pair,fp4_grouped,fp8_gemv,fp8_prefill,bf16_gemv,fp8kv_attention,"
                                       "bf16_attention")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    result = measure(args.cases.split(","))
    for name, r in result.items():
        print(f"{name:12s} {r['instructions']:5d} instr/iter ({r['loops']} loop(s)), {r['instructions_per_byte']:.2f} "
              f"per byte, bound by {r['bound_by']:6s}: {r['bytes_per_clock_per_sm']:6.2f} B/clk/SM = "
              f"{r['bound_TB_s']:.2f} TB/s (HBM {HBM_TB_S})"
              + (f", {r['bound_TFLOP_s']:.0f} TFLOP/s (FP8 peak {FP8_PEAK_TFLOP_S})" if "bound_TFLOP_s" in r else "")
              + f"  pipes {r['pipes']}")
    if args.out:
        args.out.write_text(json.dumps({"model": {"sms": SMS, "clock_ghz": CLOCK_GHZ, "rates": RATES},
                                        "cases": result}, indent=1))


if __name__ == "__main__":
    main()
