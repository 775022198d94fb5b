"""Python's garbage collector during `LLM.generate` at many sequences: its collections by generation, their count
and time, with the engine's heap frozen (`DEEPSERVE_GC_FREEZE`, the default) and without.

    python bench/investigations/gc_pauses.py [--batch 256] [--tokens 64] [--prompt-len 32] [--out FILE]

A full (generation 2) collection walks every tracked object of the process: the modules, the model's Python
objects, tokenizer tables, the graphs' bookkeeping. It runs on whichever thread allocates when the thresholds
trip, so its pause lands on one engine step: the step-to-step jitter of bench/investigations/step_timeline.py
on the H100 at 256 sequences (5-12 ms steps around a 6.7 ms graph replay). Each mode runs in a child process of
its own (one engine, as a server holds it), over the embedded model on the CPU (or `--model`), one warm-up call
and one timed call of `--batch` prompts, greedy, `ignore_eos`.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def child(args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(ROOT))
    from deepserve import LLM, SamplingParams

    llm = LLM(args.model, accelerator="cpu", max_num_seqs=args.batch, max_model_len=args.prompt_len + args.tokens + 16)
    rng = random.Random(0)

    def batch() -> list[dict]:  # (ids below 250: inside any deepserve checkpoint's vocabulary)
        return [{"prompt_token_ids": [rng.randrange(3, 250) for _ in range(args.prompt_len)]}
                for _ in range(args.batch)]

    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate(batch(), params, use_tqdm=False)
    stats = collections.defaultdict(lambda: {"collections": 0, "seconds": 0.0, "longest": 0.0})
    began: list[float] = []

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            began.append(time.perf_counter())
            return
        seconds = time.perf_counter() - began.pop()
        s = stats[str(info["generation"])]
        s["collections"] += 1
        s["seconds"] += seconds
        s["longest"] = max(s["longest"], seconds)

    tracked, frozen = len(gc.get_objects()), gc.get_freeze_count()
    gc.callbacks.append(callback)
    start = time.perf_counter()
    llm.generate(batch(), params, use_tqdm=False)
    seconds = time.perf_counter() - start
    gc.callbacks.remove(callback)
    llm.engine.shutdown()
    return {"frozen_objects": frozen, "tracked_objects": tracked, "generate_seconds": seconds,
            "by_generation": dict(stats)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--model", default=None, help="a checkpoint directory (default: the embedded model)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    res = {"batch": args.batch, "tokens": args.tokens, "prompt_len": args.prompt_len, "modes": {}}
    for mode in ("0", "1"):
        cmd = [sys.executable, __file__, "--child", "--batch", str(args.batch), "--tokens", str(args.tokens),
               "--prompt-len", str(args.prompt_len)] + (["--model", args.model] if args.model else [])
        env = dict(os.environ, DEEPSERVE_GC_FREEZE=mode)
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, check=True).stdout
        row = res["modes"]["frozen" if mode == "1" else "not frozen"] = json.loads(out.strip().splitlines()[-1])
        full = row["by_generation"].get("2", {"collections": 0, "seconds": 0.0, "longest": 0.0})
        print(f"{'frozen' if mode == '1' else 'not frozen':>10}: {row['tracked_objects']:,} objects tracked, "
              f"{row['frozen_objects']:,} frozen; "
              f"generate {row['generate_seconds']:.2f} s; full collections {full['collections']} "
              f"({1e3 * full['seconds']:.1f} ms, longest {1e3 * full['longest']:.1f} ms); "
              + ", ".join(f"gen {g}: {s['collections']} in {1e3 * s['seconds']:.1f} ms"
                          for g, s in sorted(row["by_generation"].items()) if g != "2"), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
