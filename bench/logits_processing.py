"""What the penalties, logit_bias and bad_words cost (deepserve/model/logits_processors.py), and that requests
which set none of them pay nothing.

    python bench/logits_processing.py [--device cpu|cuda] [--batches 1,64] [--out FILE]

Part 1: `process_logits` on one step's sampled rows at DeepSeek-V4's vocabulary (129,280), with no row, one row
and every row using them (presence + frequency + repetition penalty over 512 output and 2,048 prompt tokens, 8
logit_bias entries, 4 bad words of 1-3 tokens), beside `sampling.sample` of the same rows (what a sampled step
costs anyway). Part 2: the embedded model through `LLM.generate` on the reference backend, greedy, the same
requests plain and penalized (tokens per CPU second; plain requests' tokens must not change when a penalized
one shares their batch). On CPU the times are this process's CPU time (one torch thread), not wall time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deepserve.core.interfaces import PLACEHOLDER, ChunkInput  # noqa: E402
from deepserve.core.sampling_params import SamplingParams  # noqa: E402
from deepserve.model.logits_processors import process_logits  # noqa: E402
from deepserve.sampling import sample  # noqa: E402

VOCAB = 129_280
PENALIZED = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1,
                 logit_bias={t: -5.0 for t in range(100, 108)}, bad_words_token_ids=[[7], [8, 9], [10, 11, 12], [13]])


def clock(device: torch.device) -> float:
    """Wall time on CUDA (after the device's work); on CPU this process's CPU time, one thread: a shared machine's
    other load does not count."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return time.perf_counter()
    return time.process_time()


def timed(fn, repeat: int, device: torch.device) -> float:
    """Median milliseconds of `fn()` over `repeat` runs (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeat):
        began = clock(device)
        fn()
        times.append((clock(device) - began) * 1e3)
    return statistics.median(times)


def part1(device: torch.device, batches: list[int], repeat: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    rows = []
    for batch in batches:
        logits = torch.randn(batch, VOCAB, generator=g).to(device)
        history = torch.randint(0, VOCAB, (512,), generator=g).tolist()
        prompt = torch.randint(0, VOCAB, (2048,), generator=g).tolist()
        token_ids = torch.randint(0, VOCAB, (batch,), generator=g).to(device)
        plain, penalized = SamplingParams(temperature=0.8), SamplingParams(temperature=0.8, **PENALIZED)

        def chunks(num_penalized: int) -> list[ChunkInput]:
            return [ChunkInput(f"r{i}", 4096, (PLACEHOLDER,), True, (0,), penalized if i < num_penalized else plain,
                               i, output_token_ids=tuple(history) if i < num_penalized else (),
                               prompt_token_ids=prompt if i < num_penalized else ()) for i in range(batch)]

        args = [torch.full((batch,), v, dtype=dt, device=device) for v, dt in
                ((0.8, torch.float32), (0, torch.long), (1.0, torch.float32), (0.0, torch.float32))]
        seeds = torch.arange(batch, device=device)
        positions = torch.full((batch,), 4096, device=device)
        row = {"batch": batch, "sample_ms": timed(lambda: sample(logits, *args, seeds, positions), repeat, device)}
        for label, n in (("none", 0), ("one", 1), ("all", batch)):
            cs = chunks(n)
            offsets = list(range(batch))
            row[f"process_{label}_ms"] = timed(lambda: process_logits(logits.clone(), cs, token_ids, offsets),
                                               repeat, device)
        row["clone_ms"] = timed(lambda: logits.clone(), repeat, device)  # the bench's own copy, inside each run
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def part2(num_requests: int, max_tokens: int) -> dict:
    from deepserve import LLM

    llm = LLM(ROOT / "deepserve" / "assets" / "deepserve-tiny-v4", dtype="float32", accelerator="cpu",
              load_plugins=False, block_size=128)
    prompts = [{"prompt_token_ids": list(range(40 + i, 200 + i))} for i in range(num_requests)]
    plain = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    penalized = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **PENALIZED)
    result = {}
    outputs = {}
    cases = (("plain", [plain] * num_requests), ("one_penalized", [penalized] + [plain] * (num_requests - 1)),
             ("all_penalized", [penalized] * num_requests))
    llm.generate(prompts[:1], [penalized], use_tqdm=False)  # warm-up
    for label, params in cases + cases[:1]:  # plain again last: the spread between two runs of the same work
        began = time.process_time()  # the runner's thread included; one torch thread
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.process_time() - began
        label = label if f"{label}_tokens_per_s" not in result else f"{label}_again"
        outputs[label] = [o.outputs[0].token_ids for o in outs]
        result[f"{label}_tokens_per_s"] = round(num_requests * max_tokens / seconds, 1)
    result["plain_rows_unchanged_beside_a_penalized_one"] = outputs["plain"][1:] == outputs["one_penalized"][1:]
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    record = {"device": args.device, "vocab": VOCAB, "threads": 1,
              "process_logits": part1(device, [int(b) for b in args.batches.split(",")], args.repeat),
              "engine": part2(args.requests, args.max_tokens)}
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
