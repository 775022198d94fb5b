"""World size 1 through the distributed code path against today's single-process path, same call.

    python bench/scaleout.py [--model DIR] [--accelerator auto] [--num-prompts 16] [--input-len 256]
                             [--output-len 64] [--repeat 3] [--out bench/results/scaleout.json]

The issue's target: on one H200, world size 1 through the distributed path costs at most 3% against today's
step. Four ways to run the same prompts (greedy, the same outputs each way; the script checks they agree):
- `today`: `LLM(model)` as today (asynchronous scheduling, CUDA graphs where the backend has them);
- `today-sync`: the same with `async_scheduling=False` (what a rank in lockstep runs; separates that cost);
- `rank`: a world-1 expert-parallel rank's engine in this process (a one-rank gloo or NCCL group, the
  placement, the all-to-all transport with its three collectives per MoE layer, the lockstep runner), driven
  as `LLM.generate` drives an engine: the distributed path without the front's IPC;
- `front`: `LLM(model, data_parallel_size=1, enable_expert_parallel=True)`: the front, ZMQ + msgspec, one rank
  process: everything a user of the distributed path pays.
Reported per way: the best wall time of `--repeat` runs, output tokens/s, the median engine step (ms; the
rank's own counters for `front`), and each way's cost against `today` (and `rank` against `today-sync`).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def prompts_for(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (length,), generator=g).tolist() for _ in range(n)]


def drive(engine, prompts, params) -> tuple[float, list[list[int]]]:
    """`LLM.generate`'s loop over any engine: add every prompt, step until all are done."""
    began = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(f"b{i}-{began}", ids, params, final_only=True)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    seconds = time.perf_counter() - began
    return seconds, [done[k] for k in sorted(done, key=lambda k: int(k.split("-")[0][1:]))]


def run_way(way: str, model: str, options: dict, prompts, params, repeat: int) -> dict:
    from deepserve import LLM
    from deepserve.build import build_engine, resolve_config

    group = engine = None
    if way == "today":
        llm = LLM(model, **options)
        engine, steps = llm.engine, lambda: llm.engine.stats.step_seconds
    elif way == "today-sync":
        llm = LLM(model, async_scheduling=False, **options)
        engine, steps = llm.engine, lambda: llm.engine.stats.step_seconds
    elif way == "rank":
        from deepserve.distributed.launch import RankContext, dist_backend, free_port, init_process_group

        port = free_port()
        config = resolve_config(model, enable_expert_parallel=True, **options)
        context = RankContext(0, 1, "", f"tcp://127.0.0.1:{port + 1}", dist_backend(config.device), 600.0)
        group = init_process_group(context)
        parts = build_engine(config, rank=context, group=group)
        engine, steps = parts.engine, lambda: parts.engine.stats.step_seconds
    elif way == "front":
        llm = LLM(model, data_parallel_size=1, enable_expert_parallel=True, **options)
        engine = llm.engine
        steps = None
    else:
        raise ValueError(f"unknown way {way!r}")
    try:
        drive(engine, prompts[:2], params)  # warm-up: first-use costs (graph capture, allocations) out of the timing
        best, tokens, outputs = None, 0, None
        mark = len(steps()) if steps else 0
        for _ in range(repeat):
            seconds, outputs = drive(engine, prompts, params)
            best = seconds if best is None else min(best, seconds)
            tokens = sum(map(len, outputs))
        step_ms = statistics.median(steps()[mark:]) * 1e3 if steps and len(steps()) > mark else None
        if way == "front":
            snap = engine.rank_snapshots[0]
            step_ms = None  # the rank keeps its step times; the front sees counts only
            extra = {"rank_steps": snap.num_steps}
        else:
            extra = {}
        return {"way": way, "seconds": best, "output_tokens_per_s": tokens / best, "median_step_ms": step_ms,
                "outputs": outputs, **extra}
    finally:
        if engine is not None:
            engine.shutdown()
        if group is not None:
            import torch.distributed as dist

            dist.destroy_process_group()
        del engine
        import gc

        gc.collect()  # this way's weights and KV pages go before the next way sizes its own
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def main() -> int:
    from deepserve.core.env import default_model_dir
    from deepserve.model.loader import read_config

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    ap.add_argument("--accelerator", default="auto")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--ways", default="today,today-sync,rank,front")
    ap.add_argument("--kv-cache-bytes", type=int, default=4 * 2**30,
                    help="every way's KV budget (fixed, so that no way sizes its cache from what another left)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "scaleout.json"))
    args = ap.parse_args()
    from deepserve import SamplingParams

    model = args.model or str(default_model_dir())
    cfg = read_config(model)
    prompts = prompts_for(args.num_prompts, args.input_len, cfg.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    options = dict(accelerator=args.accelerator, max_num_seqs=max(args.num_prompts, 1),
                   max_model_len=args.input_len + args.output_len + 128, kv_cache_bytes=args.kv_cache_bytes)
    results = [run_way(w, model, options, prompts, params, args.repeat) for w in args.ways.split(",")]
    base = {r["way"]: r for r in results}
    agree = len({json.dumps(r["outputs"]) for r in results}) == 1
    print(f"model {model}, {args.num_prompts} prompts x {args.input_len} tokens -> {args.output_len} greedy tokens, "
          f"best of {args.repeat}; {torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or 'cpu'}")
    print(f"{'way':<11} {'seconds':>8} {'tok/s':>9} {'step ms':>8}  cost")
    for r in results:
        cost = []
        if "today" in base and r["way"] != "today":
            cost.append(f"{r['seconds'] / base['today']['seconds'] - 1:+.1%} vs today")
        if r["way"] == "rank" and "today-sync" in base:
            cost.append(f"{r['seconds'] / base['today-sync']['seconds'] - 1:+.1%} vs today-sync")
        step = f"{r['median_step_ms']:.2f}" if r["median_step_ms"] is not None else "-"
        print(f"{r['way']:<11} {r['seconds']:>8.3f} {r['output_tokens_per_s']:>9.1f} {step:>8}  {', '.join(cost)}")
    print("outputs agree across ways:", agree)
    record = {"model": model, "args": vars(args), "device": torch.cuda.get_device_name() if torch.cuda.is_available()
              else "cpu", "agree": agree, "results": [{k: v for k, v in r.items() if k != "outputs"} for r in results]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
