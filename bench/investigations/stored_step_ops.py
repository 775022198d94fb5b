"""How many device operations a graphed decode step launches with weights kept as stored (FP8 dense, FP4 experts)
against the same checkpoint dequantized to bf16 (issue 20: the H100's profile of a stored step counted about 61
kernels a layer, where bf16's graphs launch about 17).

    python bench/investigations/stored_step_ops.py [--batch 1] [--demo-widths] [--out FILE]

The demo checkpoint, widened so that every projection's rows are whole 128-row scale blocks as V4-Flash's are
(`--widths`, default on: hidden 256, heads of 128 dims, LoRA ranks and expert width 128; then the stored
projections that read one input are stacked into one GEMM as the bf16 ones are), written as stored
(`writer.save_checkpoint(..., quantization="fp8")`), loaded on the NVIDIA backend under Triton's interpreter
(CPU) as stored and with `quantization="none"`, and one decode step through `DecodeGraphs`' static forward
counted as bench/investigations/fp8_step_ops.py counts it (torch ops that launch a kernel, Triton launches).
Prints both totals and the ops whose counts differ. Counts only, not times.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench" / "investigations"))

from fp8_step_ops import measure_static_step  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--demo-widths", action="store_true", help="the demo's own widths (below one scale block)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from deepserve import LLM
    from deepserve.backends.nvidia.interpreted import support_kernels
    from deepserve.backends.reference import ReferenceBackend
    from deepserve.model.factory import load_model
    from deepserve.model.writer import save_checkpoint
    from deepserve.tools.demo_checkpoint import build_demo_checkpoint

    support_kernels()
    work = Path(tempfile.mkdtemp())
    widths = {} if args.demo_widths else dict(hidden_size=256, head_dim=128, q_lora_rank=128, o_lora_rank=128,
                                              moe_intermediate_size=128, index_head_dim=128)
    stored = save_checkpoint(load_model(build_demo_checkpoint(work / "demo", **widths), ReferenceBackend("cpu"),
                                        "float32", progress=False), work / "stored", quantization="fp8")
    res = {"batch": args.batch, "widths": widths or "demo"}
    for name, quantization in (("stored", "auto"), ("bf16", "none")):
        llm = LLM(model=str(stored), accelerator="nvidia", device="cpu", dtype="bfloat16", quantization=quantization,
                  enforce_eager=True, block_size=128, max_num_seqs=args.batch)
        res[name] = measure_static_step(llm, args.batch)
        r = res[name]
        print(f"{name}: {r['kernel_ops']} torch ops that launch a kernel + {r['triton_launches']} Triton launches "
              f"a decode step (batch {args.batch}, {r['layers']} layers)", flush=True)
    a, b = res["stored"]["ops"], res["bf16"]["ops"]
    differ = {op: (a.get(op, 0), b.get(op, 0)) for op in sorted(set(a) | set(b)) if a.get(op, 0) != b.get(op, 0)}
    print("ops whose counts differ (stored, bf16):", differ)
    ka, kb = res["stored"]["kernels"], res["bf16"]["kernels"]
    kernels = {k: (ka.get(k, 0), kb.get(k, 0)) for k in sorted(set(ka) | set(kb)) if ka.get(k, 0) != kb.get(k, 0)}
    print("Triton kernels whose launches differ (stored, bf16):", kernels)
    res["differ"], res["differ_kernels"] = differ, kernels
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
