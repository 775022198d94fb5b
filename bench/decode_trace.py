"""Where a graphed decode step's time goes, kernel by kernel, and what the small-batch fused ops buy.

    python bench/decode_trace.py [--out DIR] [--batches 1,64] [--context 512]

On the benchmark model of bench/gpu.py (V4-Flash layer shapes, 6 layers, 32 experts, random bf16 weights), for
each batch size, graphs captured afresh for each of VARIANTS:
- the replay's GPU time (CUDA events, median of 50) and the pipelined step time as the runner runs it;
- the first step's logits of two captures of the same backend (bitwise equal: no race, no atomics in a sum),
  and of the fused ops (FUSED_OPS) against the Backend's defaults for them (the ops one by one, or declined);
- the replay's kernels in launch order from the profiler: each kernel's time and the idle gap before it, the
  totals by kernel name, and the whole sequence (the first layer's printed).

Writes decode_trace.json into --out ($OUT when set).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import gpu  # noqa: E402  (the benchmark model and its helpers)

from deepserve.core.interfaces import Backend  # noqa: E402


def kernel_sequence(graph) -> list[dict]:
    """The kernels of one replay in start order: name, start and duration (us), the idle gap before each."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    ks = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA and e.time_range.elapsed_us() > 0),
                key=lambda e: e.time_range.start)
    out, end = [], None
    for e in ks:
        start, dur = e.time_range.start, e.time_range.elapsed_us()
        out.append({"kernel": e.name[:80], "start_us": start, "us": dur,
                    "gap_us": 0.0 if end is None else start - end})
        end = max(end or 0, start + dur)
    return out


def summarize(seq: list[dict]) -> dict:
    by = {}
    for k in seq:
        row = by.setdefault(k["kernel"], {"us": 0.0, "gap_us": 0.0, "count": 0})
        row["us"] += k["us"]
        row["gap_us"] += k["gap_us"]
        row["count"] += 1
    span = seq[-1]["start_us"] + seq[-1]["us"] - seq[0]["start_us"] if seq else 0.0
    busy = sum(k["us"] for k in seq)
    top = sorted(by.items(), key=lambda kv: -kv[1]["us"])
    return {"kernels": len(seq), "span_us": span, "busy_us": busy, "idle_us": span - busy,
            "by_kernel": [{"kernel": n, **v} for n, v in top]}


#: captures per batch size: the default backend twice (a graph replays the same bits: the determinism check)
#: and, where the step is small enough for them, with the fused ops taken back to the Backend defaults
VARIANTS = ("fused", "fused again", "unfused")
#: the optional backend ops that fuse a decode step's small launches
FUSED_OPS = ("moe_with_shared", "route_hidden", "rms_norm_rope", "paged_window_write", "decode_key_rows",
             "sparse_attention_rope", "hc_pre_norm", "qk_norm_rope", "hc_post_mix", "hc_head_norm", "rms_norm_linear")


@torch.no_grad()
def run_batch(model, device, b: int, ctx: int, steps: int, vocab: int) -> dict:
    from deepserve.model.batch import make_batch
    from deepserve.model.cuda_graphs import DecodeGraphs

    backend = model.backend
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, vocab, (ctx,), generator=g).tolist() for _ in range(b)]
    toks = torch.randint(2, vocab, (steps + 3, b), generator=g).tolist()
    res, logits = {}, {}
    for variant in VARIANTS:
        if variant == "unfused":
            if b > backend.kernels.moe.ROUTE_HIDDEN_TOKENS:
                continue
            for name in FUSED_OPS:  # the Backend defaults: declined, or the ops they fuse run one by one
                setattr(backend, name, types.MethodType(getattr(Backend, name), backend))
        states, cache = gpu.prefill_states(model, device, prompts, group=max(1, 16384 // ctx),
                                           extra_tokens=steps + 16)
        dg = DecodeGraphs(model, cache, max_batch=b, max_pages=-(-(ctx + steps + 16) // gpu.PAGE_SIZE))
        batch = make_batch([[t] for t in toks[0]], [ctx] * b, device)
        logits[variant] = dg.forward(batch, states).logits.float().clone()  # captures; the first step's logits
        graph = next(iter(dg._buckets.values())).graph
        replay = gpu.events(graph.replay, repeats=50, warmup=5)
        step = gpu.decode_steps(model, device, states, toks[1:], ctx + 1, dg, pipelined=True)
        seq = kernel_sequence(graph)
        summary = summarize(seq)
        res[variant] = {"replay_ms": 1e3 * replay, "pipelined_ms_per_step": 1e3 * step,
                        "capture_seconds": dg.capture_seconds, **summary, "sequence": seq}
        print(f"batch {b} {variant}: replay {1e3 * replay:.3f} ms, pipelined step {1e3 * step:.3f} ms, "
              f"{summary['kernels']} kernels, busy {summary['busy_us']:.0f} us, idle {summary['idle_us']:.0f} us",
              flush=True)
        del dg, states, cache
        torch.cuda.empty_cache()
    for name in FUSED_OPS:
        backend.__dict__.pop(name, None)
    same = logits["fused"] - logits["fused again"]
    res["determinism"] = {"max_abs_logit_diff": same.abs().max().item(), "bitwise": bool((same == 0).all())}
    print(f"  two captures: {res['determinism']}", flush=True)
    if "unfused" in logits:
        d = logits["fused"] - logits["unfused"]
        res["fused_vs_unfused"] = {
            "max_abs_logit_diff": d.abs().max().item(),
            "rel_l2": (d.norm() / logits["unfused"].norm()).item(),
            "same_greedy_tokens": bool(torch.equal(logits["fused"].argmax(-1), logits["unfused"].argmax(-1))),
            "replay_speedup": res["unfused"]["replay_ms"] / res["fused"]["replay_ms"]}
        print(f"  fused against unfused: {res['fused_vs_unfused']}", flush=True)
    return res


def print_layer(seq: list[dict], first: int = 0, count: int = 60) -> None:
    for k in seq[first : first + count]:
        print(f"    {k['gap_us']:6.2f} gap {k['us']:7.2f} us  {k['kernel'][:70]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "."))
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    device = "cuda"
    from deepserve.backends.nvidia import NvidiaBackend

    t0 = time.time()
    model = gpu.build(gpu.V4_FLASH_LAYER, NvidiaBackend(device), torch.bfloat16)
    print(f"model built in {time.time() - t0:.0f} s", flush=True)
    vocab = gpu.V4_FLASH_LAYER["vocab_size"]
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "context": args.context,
           "batches": {}}
    for b in [int(x) for x in args.batches.split(",")]:
        out["batches"][b] = run_batch(model, device, b, args.context, args.steps, vocab)
        for mode in ("fused", "unfused"):
            if mode not in out["batches"][b]:
                continue
            r = out["batches"][b][mode]
            print(f"  batch {b} {mode}: top kernels (us, gap us before them, count)")
            for k in r["by_kernel"][:14]:
                print(f"    {k['us']:8.1f} {k['gap_us']:7.1f} {k['count']:4d}  {k['kernel'][:70]}")
        if b == 1:
            print("  batch 1, the first 60 kernels in order:")
            print_layer(out["batches"][b]["fused"]["sequence"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_trace.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
