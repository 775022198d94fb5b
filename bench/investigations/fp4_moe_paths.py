"""FP4 routed experts at a decode step's few tokens: one block a pair (`per_pair=True`) against expert-sorted blocks
(`triton_ops/fp4_moe.py`, `per_pair=True/False`), at V4-Flash's expert shapes (D 4096, I 2048, top-6) with
`--experts` per layer, to place `PAIR_GEMV_PAIRS` by measurement.

    python3 bench/investigations/fp4_moe_paths.py [--experts 16] [--tokens 1,2,3,4,8] [--out DIR]
    bash bench/gpu_call.sh fp4_moe_paths                       # on the GPU machine

Each case: microseconds per call (CUDA events around 50 calls after 5 warm-up calls), the bytes of the experts
the step touches (packed codes and scales of the distinct experts chosen) over that time, and the two paths'
largest difference relative to the output's largest value. Needs CUDA; writes fp4_moe_paths.json into --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench" / "investigations"))

from vendor_probe import events  # noqa: E402  (seconds a call, CUDA events around repeated calls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--tokens", default="1,2,3,4,8")
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("fp4_moe_paths needs CUDA")
    from deepserve.backends.nvidia.triton_ops import fp4_moe
    from deepserve.model import quant

    D, I, E, k = 4096, 2048, args.experts, 6
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = quant.quantize_fp4(torch.randn(E, 2 * I, D, device="cuda", generator=g) / D**0.5)
    w2 = quant.quantize_fp4(torch.randn(E, D, I, device="cuda", generator=g) / I**0.5)
    per_expert = sum(t[0].nbytes + t[1].nbytes for t in (w13, w2)) / E
    rows = []
    for T in [int(t) for t in args.tokens.split(",")]:
        x = torch.randn(T, D, device="cuda", generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(E, device="cuda", generator=g)[:k] for _ in range(T)])
        weights = torch.rand(T, k, device="cuda", generator=g)
        touched = per_expert * ids.unique().numel()

        def run(per_pair: bool):
            return fp4_moe.fp4_moe_experts(x, ids, weights, *w13, *w2, 7.0, per_pair=per_pair)

        diff = ((run(True).float() - run(False).float()).abs().max() / run(False).float().abs().max()).item()
        row = {"tokens": T, "pairs": T * k, "touched_bytes": touched}
        for name, per_pair in (("per_pair", True), ("grouped", False)):
            us = 1e6 * events(lambda: run(per_pair), repeats=50, warmup=5)
            row[name] = {"us": us, "GB_s": touched / us / 1e3}
        row["relative_difference"] = diff
        rows.append(row)
        print(f"T {T:3d} ({T * k:3d} pairs, {touched / 2**20:6.1f} MiB touched): per-pair "
              f"{row['per_pair']['us']:8.1f} us ({row['per_pair']['GB_s']:6.0f} GB/s), grouped "
              f"{row['grouped']['us']:8.1f} us ({row['grouped']['GB_s']:6.0f} GB/s); difference {diff:.1e}",
              flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fp4_moe_paths.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "experts": E, "pair_gemv_pairs": fp4_moe.PAIR_GEMV_PAIRS,
         "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
