"""Tile sweeps for the NVIDIA backend's two largest kernels, and where an 8K prefill copies tensors or waits.

    python bench/investigations/kernel_sweep.py [--out DIR] [--only attention,moe,moe_small,mhc,rope,gemv,copies,syncs]
    (default: all but moe_small and syncs)

1. `sparse_mqa` (V4 attention) at the shapes the benchmark runs: prefill of 8K tokens on a CSA layer (window 128
   + top-512 compressed keys), an HCA layer (window + 64 rows) and a window-only layer; decode steps of 1 and 64
   queries with 640 keys each. Every tile choice (heads per program, keys per block, warps, stages) is checked
   against the default choice's output, then timed with CUDA events (median of 10; the default's of 20).
2. `moe_experts` (the two grouped GEMMs) at 8,192, 64 and 1 tokens (top-6 of 32 experts, hidden 4096,
   intermediate 2048) for fixed tiles against the autotuned pick; `--only moe_small`: one token's routed and
   shared experts (`moe_small`) in CUDA graphs, its gate/up and down tiles.
3. `hc_pre` (mHC mix and collapse) with the mix on FMA units against the bf16 split on tensor cores.
4. `apply_rope` in place at an 8K prefill's and a decode step's shapes: tokens and rows per program, warps.
5. The decode step's projections at 1 and 4 rows: cuBLAS against `gemv`'s tiles.
6. An 8K prefill of the benchmark's model under torch's profiler, grouped by input shape: which copies,
   casts and concatenations the step makes and what they cost.
7. Where an 8K prefill waits for the GPU (`--only syncs`: torch's sync debug mode).

Prints a table per part; writes kernel_sweep.json into --out ($OUT when set).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.gpu import events as gpu_events  # noqa: E402


def events(fn, repeats=20, warmup=3) -> float:
    """Median milliseconds of `fn()` between CUDA events (`bench/gpu.py`'s timer)."""
    return 1e3 * gpu_events(fn, repeats=repeats, warmup=warmup)


def sweep_tiles(name: str, run, grid: list[dict], check=None, graph: bool = False) -> dict:
    """`run(tiles)` for every tile choice in `grid` against `run(None)` (the kernel's own choice): each output's
    relative error to the default's (a choice 1e-2 or further off counts as wrong), then its median time. A choice
    that does not compile (shared memory, registers) is counted as failed. The five fastest right ones. `check`:
    what gives the outputs to compare, when `run` works in place (and so cannot be run twice on one input).
    `graph`: time each choice inside a CUDA graph (`graphed`: decode-sized calls, whose launch is most of them)."""
    check = check or run
    ref = check(None)
    timer = (lambda fn, repeats=20: graphed(fn)) if graph else events
    base = timer(lambda: run(None))
    results = []
    for tiles in grid:
        try:
            out = check(tiles)
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            ms = timer(lambda: run(tiles), repeats=10)
        except Exception as e:  # noqa: BLE001 - a tile that does not compile is skipped
            results.append(dict(tiles=tiles, error=str(e)[:120]))
            continue
        results.append(dict(tiles=tiles, ms=ms, rel_err=err))
    ok = sorted((r for r in results if "ms" in r and r["rel_err"] < 1e-2), key=lambda r: r["ms"])
    best = ok[0] if ok else None
    print(f"  {name:<34} default {base:8.3f} ms   best {best['ms'] if best else float('nan'):8.3f} ms "
          f"{best['tiles'] if best else ''}", flush=True)
    return dict(default_ms=base, best=ok[:5], failed=sum("error" in r for r in results),
                wrong=sum(1 for r in results if r.get("rel_err", 0) >= 1e-2))


def attention_case(name: str, T: int, window: int, compressed: int, pool_extra: int, device, g):
    """q [T, 64, 512], a pool and each query's index list as the model builds them: its window (the rows of the
    positions before it, -1 before position 0) then `compressed` picks among the compressed rows it can see."""
    H, d = 64, 512
    prefill = T > 64
    q = torch.randn(T, H, d, device=device, dtype=torch.bfloat16, generator=g)
    if prefill:
        n_comp = T // 4 if compressed == 512 else max(T // 128, 1)
        pool = torch.randn(T + n_comp, d, device=device, dtype=torch.bfloat16, generator=g)
        t = torch.arange(T, device=device)
        win = t[:, None] - window + 1 + torch.arange(window, device=device)[None, :]
        idx = [torch.where(win >= 0, win, -1)]
        if compressed:
            visible = (t // (4 if compressed == 512 else 128))[:, None]  # rows closed before each token
            rows = torch.arange(n_comp, device=device)[None, :]
            score = torch.rand(T, n_comp, device=device, generator=g).masked_fill(rows >= visible, -1.0)
            k = min(compressed, n_comp)
            top = torch.topk(score, k, dim=1)
            idx.append(torch.where(top.values >= 0, T + top.indices, -1))
        indices = torch.cat(idx, 1)
    else:
        pool = torch.randn(pool_extra, d, device=device, dtype=torch.bfloat16, generator=g)
        indices = torch.randint(0, pool_extra, (T, window + compressed), device=device, generator=g)
    sinks = torch.randn(H, device=device, generator=g)
    return dict(name=name, q=q, pool=pool, indices=indices, sinks=sinks)


def sweep_attention(device, g, only: str = "") -> list[dict]:
    from deepserve.backends.nvidia.triton_ops import attention

    cases = [
        attention_case("prefill 8K CSA (128 + 512 keys)", 8192, 128, 512, 0, device, g),
        attention_case("prefill 8K HCA (128 + 64 keys)", 8192, 128, 64, 0, device, g),
        attention_case("prefill 8K window (128 keys)", 8192, 128, 0, 0, device, g),
        attention_case("decode b64 (640 keys)", 64, 128, 512, 64 * 4096, device, g),
        attention_case("decode b1 (640 keys)", 1, 128, 512, 4096, device, g),
    ]
    grid = [dict(block_h=h, block_n=n, num_warps=w, num_stages=s)
            for (h, w), n, s in itertools.product(((32, 4), (32, 8), (64, 8), (64, 16)), (16, 32, 64), (1, 2, 3))]
    cases = [c for c in cases if only in c["name"]]
    # decode: the key range split over programs (then merged) as well, timed inside CUDA graphs
    decode_grid = [dict(block_h=h, block_n=n, num_warps=w, num_stages=2, splits=p)
                   for h, n, w, p in itertools.product((16, 32, 64), (32, 64), (4, 8), (1, 2, 4, 8, 16))]
    rows = []
    for case in cases:
        q, pool, idx, sinks = case["q"], case["pool"], case["indices"], case["sinks"]
        decode = q.shape[0] <= 64
        rows.append(dict(case=case["name"], **sweep_tiles(
            case["name"], lambda tiles: attention.sparse_mqa(q, pool, idx, sinks, 512**-0.5, tiles=tiles),
            decode_grid if decode else grid, graph=decode)))
        del case
        torch.cuda.empty_cache()
    return rows


def sweep_moe(device, g) -> list[dict]:
    from deepserve.backends.nvidia.triton_ops import moe

    E, D, I, k = 32, 4096, 2048, 6
    w13 = torch.randn(E, 2 * I, D, device=device, dtype=torch.bfloat16, generator=g) / 64
    w2 = torch.randn(E, D, I, device=device, dtype=torch.bfloat16, generator=g) / 45
    tile_grid = [dict(BLOCK_N=n, BLOCK_K=kk, num_warps=w, num_stages=s)
                 for n, kk, w, s in [(64, 128, 4, 3), (128, 64, 4, 4), (64, 64, 4, 5), (128, 64, 8, 3),
                                     (128, 128, 8, 3), (256, 64, 8, 3), (128, 64, 8, 4), (256, 64, 8, 4),
                                     (128, 128, 8, 4), (64, 128, 8, 4), (32, 128, 4, 4), (32, 256, 4, 3)]]
    rows = []
    for T, block_ms in ((8192, (64, 128)), (64, (16, 32)), (1, (16,))):
        x = torch.randn(T, D, device=device, dtype=torch.bfloat16, generator=g)
        ids = torch.rand(T, E, device=device, generator=g).argsort(1)[:, :k].contiguous()
        wts = torch.rand(T, k, device=device, generator=g)
        grid = [dict(tiles, block_m=bm) for bm, tiles in itertools.product(block_ms, tile_grid)]
        rows.append(dict(tokens=T, **sweep_tiles(
            f"moe T={T}", lambda tiles: moe.moe_experts(x, ids, wts, w13, w2, 10.0, tiles=tiles), grid,
            graph=T <= 64)))
    return rows


def sweep_moe_small(device, g) -> list[dict]:
    """`moe_small` (one token's routed experts plus the shared one) inside CUDA graphs: gate/up and down tiles,
    with the weights' bytes over the time."""
    from deepserve.backends.nvidia.triton_ops import moe

    E, D, I, k = 32, 4096, 2048, 6
    w13 = torch.randn(E, 2 * I, D, device=device, dtype=torch.bfloat16, generator=g) / 64
    w2 = torch.randn(E, D, I, device=device, dtype=torch.bfloat16, generator=g) / 45
    s13, s2 = w13[0].clone(), w2[0].clone()
    x = torch.randn(1, D, device=device, dtype=torch.bfloat16, generator=g)
    ids = torch.randperm(E, device=device, generator=g)[:k][None]
    wts = torch.rand(1, k, device=device, generator=g)
    counters = torch.zeros(4096, dtype=torch.int32, device=device)
    grid = [dict(gate_up_n=gn, gate_up_k=gk, down_n=dn, down_k=dk, num_warps=w, num_stages=st)
            for gn, gk, dn, dk, w, st in itertools.product((16, 32), (256, 512), (32, 64), (128, 256), (2, 4), (3,))]
    res = sweep_tiles("moe_small T=1", lambda tiles: moe.moe_small(x, ids, wts, w13, w2, 10.0, s13, s2, counters,
                                                                   tiles=tiles), grid, graph=True)
    gb = (k + 1) * 3 * I * D * 2 / 1e6
    print(f"    default {gb / res['default_ms']:.0f} GB/s, best {gb / res['best'][0]['ms']:.0f} GB/s", flush=True)
    return [dict(tokens=1, **res)]


def sweep_rope(device, g) -> list[dict]:
    """apply_rope in place at the model's shapes (an 8K prefill's queries and attention outputs [8192, 64, 512],
    its indexer queries [8192, 64, 128], its keys [8192, 1, 512]; a decode step's queries at 1 and 64 tokens):
    tokens and rows per program, and warps."""
    from deepserve.backends.nvidia.triton_ops.elementwise import apply_rope

    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2, device=device).float() / 64))
    grid = [dict(block_t=t, block_m=m, num_warps=w)
            for t, m, w in itertools.product((1, 4, 16, 32), (1, 4, 16, 64), (1, 2, 4)) if t * m <= 256]
    rows = []
    for T, M, d in ((8192, 64, 512), (8192, 64, 128), (8192, 1, 512), (64, 64, 512), (1, 64, 512)):
        x = torch.randn(T, M, d, device=device, generator=g).to(torch.bfloat16)
        work = x.clone()
        positions = torch.randint(0, 8192, (T,), device=device, generator=g)

        def check(tiles):
            work.copy_(x)
            return apply_rope(work, positions, inv_freq, inplace=True, tiles=tiles).clone()

        rows.append(dict(shape=[T, M, d], **sweep_tiles(
            f"rope [{T}, {M}, {d}] in place",
            lambda tiles: apply_rope(work, positions, inv_freq, inplace=True, tiles=tiles), grid, check,
            graph=T <= 64)))
    return rows


def sweep_gemv(device, g) -> list[dict]:
    """The decode step's projections at 1 and 4 rows (each [N, K] of the benchmark's model; o_a grouped 8 ways):
    cuBLAS (as the backend calls it) against `gemv`'s tiles and K splits, all inside CUDA graphs, with the
    weight's bytes over the time. Each call reads the next of several copies of the weight, 256 MB or more in
    all, so no call finds its weight in the 50 MB L2 (as in a decode step, where each weight is read once)."""
    import torch.nn.functional as F

    from deepserve.backends.nvidia.triton_ops import gemv

    shapes = [("input projections, CSA", 4160, 4096), ("input projections, HCA", 2560, 4096),
              ("input projections, window", 1536, 4096), ("q_b", 32768, 1024), ("indexer q_b", 8192, 1024),
              ("o_b", 4096, 8192), ("o_a (8 groups)", 1024, 4096)]
    grid = [dict(BLOCK_N=n, BLOCK_K=k, num_warps=2, num_stages=st, split=sp)
            for n, k, st, sp in itertools.product((32, 64), (128, 256), (3, 4), (1, 2, 4, 8))]
    counters = torch.zeros(4096, dtype=torch.int32, device=device)
    rows = []
    for name, N, K in shapes:
        groups = 8 if name.startswith("o_a") else 0
        shape = (groups, N, K) if groups else (N, K)
        copies = max(2, -(-256 * 2**20 // (N * K * max(groups, 1) * 2)))
        ws = [(torch.randn(shape, device=device, generator=g) * K**-0.5).bfloat16() for _ in range(copies)]
        for M in (1, 4):
            x = torch.randn((M, groups, K) if groups else (M, K), device=device, generator=g).bfloat16()
            turn = itertools.count()

            def weight():  # the next copy, round robin (fixed per call at capture, so the replay does the same)
                return ws[next(turn) % copies]

            if groups:
                def cublas():
                    w, out = weight(), torch.empty((M, groups, N), dtype=x.dtype, device=device)
                    torch.bmm(x.transpose(0, 1), w.transpose(1, 2), out=out.transpose(0, 1))
                    return out

                def run(tiles):
                    return gemv.grouped_gemv(x, weight(), tiles, counters)
            else:
                def cublas():
                    return F.linear(x, weight())

                def run(tiles):
                    return gemv.gemv(x, weight(), tiles, counters)
            turn = itertools.count()
            ref = cublas().float()
            turn = itertools.count()
            err = ((run(None).float() - ref).norm() / ref.norm()).item()
            base = graphed(cublas)
            turn = itertools.count()
            res = sweep_tiles(f"{name} M={M}", run, grid if M == 1 else [], graph=True)  # M=4: the default only
            assert not counters.any(), "a split gemv left its arrival counters set"
            gb = N * K * max(groups, 1) * 2 / 1e6
            best = res["best"][0]["ms"] if res["best"] else float("nan")
            print(f"    cuBLAS {base:.4f} ms ({gb / base:.0f} GB/s), gemv default {res['default_ms']:.4f} ms "
                  f"({gb / res['default_ms']:.0f} GB/s, {gemv._tiles(N, K, max(groups, 1), None)}), best "
                  f"{gb / best:.0f} GB/s, error vs cuBLAS {err:.1e}", flush=True)
            rows.append(dict(name=name, N=N, K=K, M=M, groups=groups, cublas_ms=base, rel_err_vs_cublas=err, **res))
        ws.clear()  # (the next shape's copies take their memory)
        torch.cuda.empty_cache()
    return rows


def graphed(fn, calls=20) -> float:
    """Median milliseconds of one `fn()` inside a CUDA graph of `calls` calls (no launch gaps from the host)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return events(graph.replay, repeats=10) / calls


def sweep_mhc(device, g) -> list[dict]:
    """hc_pre (the mHC mix, then the Sinkhorn collapse) at decode and prefill token counts: the mix as fp32 FMA
    products against the three-term bf16 split on tensor cores, each inside a CUDA graph."""
    from deepserve.backends.nvidia.triton_ops import mhc

    n, D = 4, 4096
    fn = torch.randn(((2 + n) * n, n * D), device=device, generator=g) * 0.5 / (n * D) ** 0.5
    base = 0.5 * torch.randn((2 + n) * n, device=device, generator=g)
    scale = 1.0 + 0.2 * torch.randn(3, device=device, generator=g)
    rows = []
    for T in (1, 4, 16, 64, 256, 8192):
        streams = torch.randn(T, n, D, device=device, generator=g).to(torch.bfloat16)
        row = dict(tokens=T)
        for split in (False, True):
            if T > 256 and not split:
                continue
            row["split" if split else "no_split"] = graphed(
                lambda: mhc.hc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6, split=split))
        if T in (1, 64, 8192):  # the split mix's column chunks and the collapse's programs per token
            grid = [dict(parts=p, d_parts=q, num_warps=w) for p in (8, 32, 64, 128) for q in (1, 4, 16) for w in (1, 4)]
            row["tiles"] = sweep_tiles(f"hc_pre T={T} tiles",
                                       lambda tiles: mhc.hc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6,
                                                                tiles=tiles)[0], grid, graph=True)
        rows.append(row)
        times = "  ".join(f"{k} {v:.4f} ms" for k, v in row.items() if k not in ("tokens", "tiles"))
        print(f"  hc_pre T={T:<5} {times}", flush=True)
    return rows


def prefill_8k(device):
    """One sequence's 8K prefill of bench/gpu.py's model, as a function (run once here, compiling the kernels)."""
    from bench.gpu import V4_FLASH_LAYER, build
    from deepserve.backends.nvidia import NvidiaBackend
    from deepserve.model.batch import make_batch

    model = build(V4_FLASH_LAYER, NvidiaBackend(device), torch.bfloat16)
    ids = torch.randint(2, 129280, (8192,)).tolist()

    def run():
        model(make_batch([ids], [0], device), [model.make_state()])
    run()
    torch.cuda.synchronize()
    return run


@torch.no_grad()
def prefill_copies(device) -> list[dict]:
    """An 8K prefill of the benchmark's model under the profiler: the ops that move memory, by input shape."""
    run = prefill_8k(device)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        run()
        torch.cuda.synchronize()
    movers = ("copy_", "to", "_to_copy", "contiguous", "cat", "clone", "index", "index_put_", "gather", "sum",
              "mul", "add", "where", "float", "reshape", "masked_fill", "scatter", "fill_", "zero_", "mean", "square")
    rows = []
    for ev in prof.key_averages(group_by_input_shape=True):
        name = ev.key.replace("aten::", "")
        cuda_us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if name in movers and cuda_us > 100:
            rows.append(dict(op=ev.key, shapes=str(ev.input_shapes)[:160], calls=ev.count, cuda_ms=cuda_us / 1e3))
    rows.sort(key=lambda r: -r["cuda_ms"])
    for r in rows[:30]:
        print(f"  {r['cuda_ms']:7.3f} ms {r['calls']:4d}x {r['op']:<18} {r['shapes']}", flush=True)
    del run
    torch.cuda.empty_cache()
    return rows[:60]


@torch.no_grad()
def prefill_syncs(device) -> list[dict]:
    """Where an 8K prefill makes the host wait for the GPU (torch's sync debug mode): each such point drains the
    launch queue, and the GPU then idles while the host issues the next kernels."""
    import traceback
    import warnings

    run = prefill_8k(device)
    sites: dict[str, int] = {}
    original = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack() if "deepserve" in f.filename and "bench" not in f.filename]
        key = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in frames[-1:-4:-1]) or f"{filename}:{lineno}"
        sites[key] = sites.get(key, 0) + 1

    torch.cuda.set_sync_debug_mode("warn")
    warnings.showwarning = record
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            run()
    finally:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = original
    rows = [dict(site=k, count=v) for k, v in sorted(sites.items(), key=lambda kv: -kv[1])]
    for r in rows[:25]:
        print(f"  {r['count']:4d}x {r['site']}", flush=True)
    del run
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_out")))
    ap.add_argument("--only", default="attention,moe,mhc,rope,gemv,copies")
    ap.add_argument("--cases", default="", help="attention: only the cases whose name holds this (e.g. decode)")
    args = ap.parse_args()
    device = "cuda:0"
    g = torch.Generator(device=device).manual_seed(0)
    res = {"device": torch.cuda.get_device_name(0)}
    parts = args.only.split(",")
    args.out.mkdir(parents=True, exist_ok=True)
    for part, fn in (("attention", sweep_attention), ("moe", sweep_moe), ("moe_small", sweep_moe_small),
                     ("mhc", sweep_mhc), ("rope", sweep_rope),
                     ("gemv", sweep_gemv), ("copies", None),
                     ("syncs", None)):
        if part not in parts:
            continue
        print(f"== {part}", flush=True)
        if part in ("copies", "syncs"):
            res[part] = (prefill_copies if part == "copies" else prefill_syncs)(device)
        else:
            res[part] = fn(device, g, args.cases) if part == "attention" else fn(device, g)
        (args.out / "kernel_sweep.json").write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
