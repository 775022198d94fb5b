"""Why is the stored-precision decode step slow (issue 20)? Kernel times of one decode step, stored against bf16.

    python3 bench/investigations/stored_profile.py [--layers 4] [--experts 16] [--batches 1,64] [--out DIR]

The first H200 run of bench/stored_precision.py (43 layers, 16 experts) measured 95.7 ms per batch-1 decode step
at stored precision (2.8% MBU), where bf16 steps of the same shapes take about 1.5 ms per 6 layers. Here a few
layers of the same config (V4-Flash shapes, window/CSA/HCA, hash-routed first layers) are built once, written as
stored (FP8 dense, FP4 experts), loaded as stored and dequantized, and one eager decode step per batch size is
profiled (bench/gpu.py's `profile_step`): GPU-busy time, wall time and the top kernels, side by side, plus the
graph-replayed step time of each. Writes stored_profile.json into --out ($OUT when set).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import gpu as base  # noqa: E402
import stored_precision as sp  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "."))
    args = ap.parse_args()
    from deepserve.backends.nvidia import NvidiaBackend
    from deepserve.model.cuda_graphs import DecodeGraphs
    from deepserve.model.factory import load_model
    from deepserve.model.writer import save_checkpoint

    device = "cuda:0"
    backend = NvidiaBackend(device)
    cfg = sp.flash_config(args.experts, False)
    cfg.update(layer_types=cfg["layer_types"][:args.layers], num_hidden_layers=args.layers,
               mlp_layer_types=cfg["mlp_layer_types"][:args.layers])
    path = Path(tempfile.mkdtemp(prefix="deepserve-stored-profile-"))
    model = base.build(cfg, backend, torch.bfloat16)
    save_checkpoint(model, path, quantization="fp8")
    del model
    gc.collect()
    torch.cuda.empty_cache()
    result = {"backend": repr(backend), "layers": args.layers, "experts": args.experts, "rows": {}}
    for quantization in ("auto", "none"):
        model = load_model(path, backend, "bfloat16", progress=False, quantization=quantization)
        g = torch.Generator().manual_seed(1)
        for b in [int(x) for x in args.batches.split(",")]:
            prompts = [torch.randint(2, model.cfg.vocab_size, (args.context,), generator=g).tolist() for _ in range(b)]
            states, cache = base.prefill_states(model, device, prompts, group=max(1, 16384 // args.context),
                                                extra_tokens=40)
            toks = torch.randint(2, model.cfg.vocab_size, (12, b), generator=g).tolist()
            pos = args.context  # tokens the states hold: each step below starts where the last ended
            base.decode_steps(model, device, states, toks[:2], pos)  # warm-up (compiles)
            pos += 2
            prof = base.profile_step(model, device, states, toks[2], pos)
            prof.pop("host", None)
            pos += 2  # (profile_step runs a second step, for its host profile)
            eager = base.decode_steps(model, device, states, toks[3:6], pos)
            pos += 3
            graphs = DecodeGraphs(model, cache, max_batch=b, max_pages=-(-(args.context + 48) // base.PAGE_SIZE))
            base.decode_steps(model, device, states, toks[6:8], pos, graphs)
            pos += 2
            replay = base.decode_steps(model, device, states, toks[8:], pos, graphs, pipelined=True)
            row = result["rows"][f"{quantization} b{b}"] = {"eager_ms": 1e3 * eager, "graph_ms": 1e3 * replay, **prof}
            print(f"== {quantization} batch {b}: eager {row['eager_ms']:.2f} ms, graphs {row['graph_ms']:.2f} ms, "
                  f"GPU busy {1e3 * row['gpu_busy_seconds']:.2f} ms in {row['num_kernels']} kernels", flush=True)
            for k in row["top"][:12]:
                print(f"   {1e6 * k['seconds']:9.1f} us  x{k['count']:<4} {k['kernel']}", flush=True)
            del states, cache, graphs
        del model
        gc.collect()
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "stored_profile.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
