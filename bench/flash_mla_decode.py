"""FlashMLA's sparse decode against deepserve's Triton packed-row kernel: the attention over the FP8 KV cache's rows
(`Backend.sparse_attention_packed`, RoPE turn included) at V4-Flash's shapes (64 heads of 512 dims, 448 FP8 + 64
bf16 RoPE dims a row), both through the NVIDIA backend, each step replayed as a CUDA graph as the decode step runs
it (issue 20, item 5).

    python3 bench/flash_mla_decode.py [--heads 64] [--out DIR]     # on a GPU with the flash_mla wheel installed

Queries T: a decode step of 1, 16, 64, 256 sequences and 512 rows (the most `FlashMlaDecode` takes; longer steps,
prompt chunks, keep the Triton kernel); rows a query reads K: the
window plus a CSA layer's top-512 (640) or an HCA layer's compressed rows at 500K tokens of context (128 + 3,906 ->
4,034). Reported per case: microseconds a call (median of graph replays between CUDA events), the bytes the rows
and queries take (each row a query names counted once per query: what a kernel without reuse reads) over that
time, and the ratio Triton / FlashMLA. Writes flash_mla.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

CASES = [(1, 640), (16, 640), (64, 640), (256, 640), (512, 640), (1, 4034), (64, 4034)]


def replayed(fn, repeats: int = 50) -> float:
    """Median seconds of one replay of a CUDA graph of `fn()` (captured after two warm-up calls)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(5):
        graph.replay()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--rows", type=int, default=200_000, help="rows in the pool the indices point into")
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args()

    from test_kv_fp8_triton import attention_case, packed_kv_rows, rel_err

    from deepserve.backends.nvidia import NvidiaBackend

    backend = NvidiaBackend("cuda")
    if backend.flash_mla is None:
        from deepserve.backends.nvidia import vendor

        module = vendor._vendor_module("flash_mla")  # say why: each condition of vendor.load_flash_mla
        why = "it does not import (logged above)" if module is None else (
            f"has flash_mla_with_kvcache {hasattr(module, 'flash_mla_with_kvcache')}, get_mla_metadata "
            f"{hasattr(module, 'get_mla_metadata')}, capability {torch.cuda.get_device_capability()}, load() -> "
            f"{vendor.FlashMlaDecode.load(torch.cuda.current_device())}")
        raise SystemExit(f"flash_mla does not load here ({why}); install the wheel of scripts/build_vendor_kernels.sh")
    flash = backend.flash_mla
    g = torch.Generator().manual_seed(0)
    codec, stored = packed_kv_rows(args.rows, 512, 64, torch.bfloat16, g, "cuda")
    rows = []
    print(f"{torch.cuda.get_device_name()}, {args.heads} heads, {args.rows} rows of {stored.shape[1]} bytes")
    print(f"{'T':>5} {'K':>5} | {'Triton us':>10} {'GB/s':>6} | {'FlashMLA us':>11} {'GB/s':>6} | Triton/FlashMLA | diff")
    for T, K in CASES:
        q, indices, sinks, positions, inv_freq = attention_case(T, args.heads, 512, 64, args.rows, K, torch.bfloat16,
                                                                g, "cuda")
        indices = torch.randint(0, args.rows, (T, K), generator=g).to("cuda")  # every index names a row
        call = lambda: backend.sparse_attention_packed(q, stored, codec, indices, sinks, 512 ** -0.5,  # noqa: E731
                                                       positions, inv_freq)
        backend.flash_mla = flash
        with_flash = call()
        assert flash.checked.get(args.heads), "FlashMLA failed its check against the Triton kernel"
        t_flash = replayed(call)
        backend.flash_mla = None
        with_triton = call()
        t_triton = replayed(call)
        backend.flash_mla = flash
        moved = T * K * stored.shape[1] + 2 * q.numel() * q.element_size()
        row = {"T": T, "K": K, "triton_s": t_triton, "flash_mla_s": t_flash, "bytes": moved,
               "triton_GBps": moved / t_triton / 1e9, "flash_mla_GBps": moved / t_flash / 1e9,
               "speedup": t_triton / t_flash, "rel_diff": rel_err(with_flash, with_triton)}
        rows.append(row)
        print(f"{T:>5} {K:>5} | {t_triton * 1e6:>10.1f} {row['triton_GBps']:>6.0f} | {t_flash * 1e6:>11.1f} "
              f"{row['flash_mla_GBps']:>6.0f} | {row['speedup']:>15.2f} | {row['rel_diff']:.1e}")
        del q, indices, with_flash, with_triton
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "heads": args.heads,
            "rows": args.rows, "row_bytes": stored.shape[1], "timing": "median CUDA-graph replay, 50 replays"}
    (args.out / "flash_mla.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
