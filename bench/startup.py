"""Start-up on a GPU: how long `LLM(...)` takes to be ready and what the first requests then cost, on a fresh
cache directory and on a restart over the same one (issue 23, item 2: warm start).

    python3 bench/startup.py [--experts 8] [--max-num-seqs 64] [--max-model-len 4096] [--out DIR]
    python3 bench/startup.py --quick   # the harness on a CPU, tiny shapes: not a measurement

Writes a V4-Flash-shaped random checkpoint (bench/gpu.py's `V4_FLASH_LAYER` shapes: 6 layers, `--experts`
routed experts so that it loads in seconds) once,
then runs five fresh processes, each timing `LLM(...)` (of it, the decode graphs' capture and the step warm-up,
`deepserve.model.warm_up`, separately) and then, per batch size, its first generate of 32 greedy tokens and a
second one (warm) of the same shape:
- `cold`: an empty `DEEPSERVE_CACHE_DIR` (so an empty Triton cache): kernels compile at start-up, every decode
  bucket is captured and every other step kind warmed up before `LLM` returns;
- `restart`: the same cache directory again: compiled kernels are reused, graphs are captured again (a CUDA graph
  cannot be saved across processes), the warm-up runs again (loading the cached kernels, the MoE autotuner
  timing its tiles again);
- `restart_no_warm_up`: the restart with `warm_up=False`: what the first requests pay for the autotuner and
  loading the cached kernels;
- `cold_no_warm_up`: another empty cache directory with `warm_up=False`: what the first prompts of each size
  paid for their compiles before the warm-up;
- `lazy`: the restart's cache with `cuda_graph_sizes=[1]` and no warm-up, the nearest to the oldest behaviour (one
  bucket at start-up, batch 64 steps without a graph): what the first request of another size paid then.
The first generate against the warm one is what a request still pays after start-up. Writes startup.json.
(DeepGEMM's JIT cache is its own, `DG_JIT_CACHE_DIR` or ~/.deep_gemm, not under `DEEPSERVE_CACHE_DIR`: a second
cold run on one machine finds its grouped GEMMs compiled.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_CHILD = """
import json, sys, time
t0 = time.perf_counter()
import torch
from deepserve import LLM, SamplingParams
kw = json.loads(sys.argv[2])
sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
llm = LLM(model=sys.argv[1], **kw)
ready = time.perf_counter() - t0
report = llm.runner.warm_up_report
out = {"ready_s": ready, "capture_s": llm.graphs.capture_seconds if llm.graphs else 0.0,
       "warm_up_s": report.seconds if report else 0.0, "warm_up_steps": dict(report.steps) if report else {},
       "first": {}, "warm": {}}
params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
for batch in json.loads(sys.argv[3]):
    prompts = [{"prompt_token_ids": [(7 * i + j) % 400 + 2 for j in range(512)]} for i in range(batch)]
    for label in ("first", "warm"):
        sync(); t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        sync(); out[label][batch] = time.perf_counter() - t
print("RESULT", json.dumps(out), flush=True)
"""


def write_checkpoint(path: Path, experts: int, quick: bool) -> Path:
    sys.path.insert(0, str(ROOT))
    import torch

    import bench.gpu as g
    from deepserve.backends.reference import ReferenceBackend
    from deepserve.model.writer import save_checkpoint

    shapes = dict(g.QUICK if quick else g.V4_FLASH_LAYER, n_routed_experts=experts)
    device, dtype = ("cpu", torch.float32) if quick else ("cuda", torch.bfloat16)
    model = g.build(shapes, ReferenceBackend(device), dtype)
    return save_checkpoint(model, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="tiny shapes on the CPU: checks the harness only")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "."))
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="deepserve_startup_"))
    ckpt = write_checkpoint(work / "ckpt", args.experts, args.quick)
    batches = [int(b) for b in args.batches.split(",")]
    base = dict(max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                dtype="float32" if args.quick else "bfloat16", accelerator="cpu" if args.quick else "nvidia")
    cache = work / "cache"
    results = {}
    on = {"warm_up": True} if args.quick else {}  # (the CPU's default is off: --quick checks the harness with it)
    runs = (("cold", cache, on), ("restart", cache, on), ("restart_no_warm_up", cache, {"warm_up": False}),
            ("cold_no_warm_up", work / "cache_no_warm_up", {"warm_up": False}),
            ("lazy", cache, {"cuda_graph_sizes": [1], "warm_up": False}))
    for label, cache_dir, extra in runs:
        env = {**os.environ, "DEEPSERVE_CACHE_DIR": str(cache_dir), "PYTHONPATH": str(ROOT)}
        env.pop("TRITON_CACHE_DIR", None)
        proc = subprocess.run([sys.executable, "-c", _CHILD, str(ckpt), json.dumps({**base, **extra}),
                               json.dumps(batches)], capture_output=True, text=True, env=env, cwd=ROOT)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not lines:
            print(f"{label}: failed\n{proc.stderr[-3000:]}", flush=True)
            continue
        results[label] = json.loads(lines[-1][len("RESULT "):])
        r = results[label]
        firsts = "; ".join(f"batch {b}: first {r['first'][str(b)]:.2f} s, warm {r['warm'][str(b)]:.2f} s"
                           for b in batches)
        print(f"{label}: ready {r['ready_s']:.1f} s (captures {r['capture_s']:.1f} s, warm-up {r['warm_up_s']:.1f} s); "
              f"{firsts}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "startup.json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                                       "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
