"""What SWA bounded replay costs in quality and saves in compute, against exact (issue 21 item 5).

    .venv/bin/python bench/swa_replay.py                 # CPU; writes bench/results/swa_replay_cpu.json
    .venv/bin/python bench/swa_replay.py --lengths 256,512 --prompts 2

For each model and prefix length B (a multiple of the 128-token page), random prompts of B + 8 tokens: the exact
run computes the prompt cold (its pages store the exact boundary snapshots, and a hit on them is bit-identical to
it on the batch-invariant reference ops); then the last prefix page's snapshot is rebuilt by a bounded replay of
the 128 tokens before B (`deepserve.model.swa_replay`: the segment's window attends within itself, its
compressed rows are the prefix's exact ones), and the same prompt runs again, hitting the B cached tokens with
that snapshot (and again after replays of 64 and 32 tokens, to show the trend). Both generate `--tokens` greedy
tokens with their logprobs. Reported per length: the greedy agreement (the share of the generated tokens before
the two first differ) and the sampled tokens' logprob differences over that agreed prefix (mean and max of
|exact - bounded|); and the tokens computed to get the window state at B: bounded 128, exact replay window x
depth, and recomputing the whole prefix (B) without one.

Models: the embedded one (window 32 x 6 layers = 192 > 128: bounded is approximate) and the tiny test model of
tests/tiny.py (window 16 x 6 = 96 <= 128: bounded replays more than exactness needs, so it is exact) where
transformers is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deepserve import LLM, SamplingParams  # noqa: E402
from deepserve.core.kv.prefix_hash import block_hashes  # noqa: E402
from deepserve.model.swa_replay import BOUNDED_LENGTH, exact_length, replay_snapshot  # noqa: E402

MODEL = ROOT / "deepserve" / "assets" / "deepserve-tiny-v4"
OUT = ROOT / "bench" / "results" / "swa_replay_cpu.json"
P = 128


def tiny_model_dir() -> Path | None:
    try:
        sys.path.insert(0, str(ROOT / "tests"))
        import tiny
    except ImportError:
        return None
    return tiny.save_hf_checkpoint(tiny.make_hf_model(seed=0), Path(tempfile.mkdtemp(prefix="tiny_v4_")))


def compare(exact, bounded) -> dict:
    a, b = exact.outputs[0], bounded.outputs[0]
    agreed = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
    diffs = [abs(a.logprobs[i][a.token_ids[i]].logprob - b.logprobs[i][b.token_ids[i]].logprob)
             for i in range(agreed)]
    return {"agreed": agreed, "tokens": len(a.token_ids), "diffs": diffs}


def measure(name: str, model_dir, args, dtype: str) -> dict:
    llm = LLM(str(model_dir), accelerator="cpu", dtype=dtype, block_size=P)
    cache, kv = llm.runner.cache, llm.engine.scheduler.kv
    vocab = llm.model.cfg.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True, logprobs=0)
    rng = random.Random(args.seed)
    rows = []
    for length in args.lengths:
        runs: dict[int, list[dict]] = {n: [] for n in args.replay_lengths}
        for _ in range(args.prompts):
            prompt = [rng.randrange(10, vocab - 10) for _ in range(length + 8)]
            exact = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
            table = [kv.pool.get_cached(h) for h in block_hashes(prompt[:length], P, None)]
            for n in args.replay_lengths:
                computed = replay_snapshot(cache, table, length, prompt, n)
                bounded = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
                if bounded.num_cached_tokens != length:
                    raise RuntimeError(f"the bounded run hit {bounded.num_cached_tokens} tokens, not {length}")
                runs[n].append({**compare(exact, bounded), "replayed": computed})
        for n, done in runs.items():
            diffs = [d for r in done for d in r["diffs"]]
            row = {
                "prefix_tokens": length, "replay_tokens": n, "prompts": len(done),
                "greedy_agreement": sum(r["agreed"] for r in done) / sum(r["tokens"] for r in done),
                "logprob_diff_mean": statistics.fmean(diffs) if diffs else None,
                "logprob_diff_max": max(diffs) if diffs else None,
                "tokens_computed": {"replay": done[0]["replayed"], "exact_replay": min(exact_length(cache), length),
                                    "full_recompute": length},
            }
            rows.append(row)
            print(f"{name:9s} B={length:5d} replay {n:4d}: greedy agreement {row['greedy_agreement']:.3f}, "
                  f"|dlogprob| mean {row['logprob_diff_mean'] or 0:.2e} max {row['logprob_diff_max'] or 0:.2e}; "
                  f"tokens: replay {row['tokens_computed']['replay']}, exact replay "
                  f"{row['tokens_computed']['exact_replay']}, recompute {length}", flush=True)
    llm.engine.shutdown()
    return {"model": name, "window": cache.layers[0].spec.window, "layers": len(cache.layers),
            "exact_length": exact_length(cache), "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="256,512,1024,2048")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--replay-lengths", default=f"{BOUNDED_LENGTH},64,32",
                    help="tokens a bounded replay recomputes: DeepInfer's 128 first, shorter ones show the trend")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.replay_lengths = [int(x) for x in args.replay_lengths.split(",")]
    if any(n <= 0 or n % P for n in args.lengths):
        raise SystemExit(f"--lengths must be positive multiples of {P}, got {args.lengths}")
    models = [measure("embedded", MODEL, args, "auto")]
    tiny = tiny_model_dir()
    if tiny is not None:
        models.append(measure("tiny-test", tiny, args, "float32"))
    import torch

    result = {
        "command": "python bench/swa_replay.py " + " ".join(sys.argv[1:]),
        "machine": {"cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
                    "torch": torch.__version__, "torch_threads": torch.get_num_threads()},
        "bounded_length": BOUNDED_LENGTH, "generated_tokens": args.tokens, "models": models,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
