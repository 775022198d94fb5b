"""Can a batch-1 decode step read part of a projection's weight from the L2 instead of memory?

Between the big projections of a decode step run small kernels (norms, RoPE, the attention, the mHC mixing) that
leave the memory bus mostly idle: ~30 us a layer. A second stream could spend that time bringing the next
projection's weight (or its first part: the H200's L2 is 50 MB) into the L2, so that the projection then reads
that part from the L2. This measures it, in CUDA graphs, on weights rotated past the L2 as in a step:

- `cold`: a chain of small kernels, then the projection (`gemv`) of a weight nothing has read lately;
- `hot`: the same with the weight read just before (the best a prefetch can do);
- `prefetch P MB, mode`: a side stream brings the weight's first P MB into the L2 while the main stream runs the
  small kernels, then the projection; the streams join at the end of the iteration. Modes: `load` (L2-only
  loads, discarded), `line` (`prefetch.global.L2::evict_last` per 128-byte line), `bulk`
  (`cp.async.bulk.prefetch.L2.global`, 4 KB an instruction).

    python bench/investigations/l2_prefetch.py [--out DIR]

Writes l2_prefetch.json into --out ($OUT when set).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.gpu import events  # noqa: E402


@triton.jit
def _prefetch_kernel(w_ptr, sink_ptr, words, per_program, flag, MODE: tl.constexpr, BLOCK: tl.constexpr):
    """Words [pid * per_program, +per_program) of the int32 view of a weight into the L2. MODE 0: loads that stop
    at the L2 (.cg); 1: one line prefetch per 32 words; 2: one 4 KB bulk prefetch per 1024 words. `flag` is
    never set: the store that keeps the compiler from dropping the loads never happens."""
    first = tl.program_id(0) * per_program
    acc = tl.zeros((BLOCK,), tl.int32)
    step: tl.constexpr = BLOCK * (1 if MODE == 0 else (32 if MODE == 1 else 1024))
    for w0 in range(first, first + per_program, step):
        if MODE == 0:
            at = w0 + tl.arange(0, BLOCK)
            acc ^= tl.load(w_ptr + at, mask=at < words, other=0, cache_modifier=".cg")
        elif MODE == 1:
            at = w0 + tl.arange(0, BLOCK) * 32
            acc |= tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l",
                                             [w_ptr + tl.minimum(at, words - 1)], dtype=tl.int32, is_pure=False,
                                             pack=1)
        else:
            at = w0 + tl.arange(0, BLOCK) * 1024
            acc |= tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], 4096; mov.u32 $0, 0;", "=r,l",
                                             [w_ptr + tl.minimum(at, words - 1024)], dtype=tl.int32, is_pure=False,
                                             pack=1)
    tl.store(sink_ptr + tl.program_id(0), tl.sum(acc, axis=0), mask=flag != 0)


def prefetch(w: torch.Tensor, nbytes: int, mode: int, sink: torch.Tensor, programs: int = 32) -> None:
    words = w.view(-1).view(torch.int32)
    n = min(nbytes // 4, words.numel())
    per = triton.cdiv(triton.cdiv(n, programs), 32768) * 32768
    _prefetch_kernel[(triton.cdiv(n, per),)](words, sink, n, per, 0, MODE=mode, BLOCK=256, num_warps=4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "."))
    args = ap.parse_args()
    from deepserve.backends.nvidia.triton_ops import elementwise, gemv

    device = "cuda"
    g = torch.Generator(device=device).manual_seed(0)
    counters = torch.zeros(4096, dtype=torch.int32, device=device)
    sink = torch.zeros(1024, dtype=torch.int32, device=device)
    small_x = torch.randn((1, 4096), device=device, generator=g).bfloat16()
    side = torch.cuda.Stream()
    res = {"device": torch.cuda.get_device_name(0), "rows": []}

    def small_chain():  # six small launches, ~12 us: the attention side of a layer
        for _ in range(6):
            elementwise.rms_norm(small_x, None, 1e-6)

    shapes = [("o_a (8 groups)", (8, 1024, 4096)), ("q_b", (32768, 1024)), ("input projections, CSA", (4160, 4096))]
    for name, shape in shapes:
        copies = 8
        ws = [(torch.randn(shape, device=device, generator=g) * 0.02).bfloat16() for _ in range(copies)]
        x = torch.randn((1, 8, shape[-1]) if len(shape) == 3 else (1, shape[-1]), device=device,
                        generator=g).bfloat16()
        mb = ws[0].numel() * 2 / 2**20

        def project(w):
            return gemv.grouped_gemv(x, w, None, counters) if w.dim() == 3 else gemv.gemv(x, w, None, counters)

        def graphed(body, calls=16) -> float:
            turn = itertools.count()
            body(ws[next(turn) % copies])
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            turn = itertools.count()
            with torch.cuda.graph(graph):
                for _ in range(calls):
                    body(ws[next(turn) % copies])
            return 1e6 * events(graph.replay, repeats=10) / calls

        def cold(w):
            small_chain()
            project(w)

        def hot(w):
            project(w)
            small_chain()
            project(w)

        def with_prefetch(nbytes, mode):
            def body(w):
                main = torch.cuda.current_stream()
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    prefetch(w, nbytes, mode, sink)
                small_chain()
                project(w)
                main.wait_stream(side)
            return body

        base = graphed(cold)
        row = {"name": name, "MB": mb, "cold_us": base, "hot_extra_us": graphed(hot) - base, "prefetch": []}
        alone = graphed(project)
        row["projection_alone_us"] = alone
        print(f"{name} ({mb:.0f} MB): small chain + projection {base:.1f} us (projection alone {alone:.1f}); "
              f"hot projection {row['hot_extra_us']:.1f} us", flush=True)
        for mode, label in ((0, "load"), (1, "line"), (2, "bulk")):
            for p in (8, 16, 24, 32, 48):
                if p > mb:
                    continue
                try:
                    us = graphed(with_prefetch(p << 20, mode))
                except Exception as e:  # noqa: BLE001 - a mode this GPU or triton rejects is reported, not fatal
                    print(f"  {label}: failed ({str(e)[:200]})", flush=True)
                    break
                row["prefetch"].append({"mode": label, "MB": p, "us": us})
                print(f"  prefetch {p:3d} MB {label:<5}: {us:6.1f} us ({us - base:+.1f})", flush=True)
        res["rows"].append(row)
        ws.clear()
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "l2_prefetch.json").write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
