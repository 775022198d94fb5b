"""Batch invariance on the GPU through the public API (issue 23, item 4): does a request's output depend on what
else is in the batch, and what does the batch-invariant mode cost?

    python3 bench/batch_invariance_gpu.py [--experts 8] [--tokens 24] [--out DIR]

On a V4-Flash-shaped random checkpoint (bench/startup.py's), for `LLM(batch_invariant=False)` (the NVIDIA
kernels, CUDA graphs) and `LLM(batch_invariant=True)` (the kernels with fixed tiles and reduction orders, no graphs), request A
(greedy, logprobs) runs alone, beside 3 others, beside 63 others, and alone again; the report says whether A's
tokens and logprob bits were the same each time, and the decode step of each mode at batch 1 and 4
((time of a `--tokens` generate - time of a 1-token generate) / (tokens - 1)). Writes batch_invariance_gpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def run_mode(ckpt: Path, invariant: bool, tokens: int, quick: bool) -> dict:
    import torch

    from deepserve import LLM, SamplingParams

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    llm = LLM(model=str(ckpt), dtype="float32" if quick else "bfloat16", accelerator="cpu" if quick else "nvidia",
              batch_invariant=invariant, max_num_seqs=64, max_model_len=2048, enable_prefix_caching=False,
              cuda_graph_sizes=[1, 4, 64])
    vocab = llm.model.cfg.vocab_size

    def prompt(i: int) -> dict:
        return {"prompt_token_ids": [(13 * i + 7 * j) % (vocab - 2) + 2 for j in range(128)]}

    greedy = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, logprobs=1)

    def request_a(others: int):
        outs = llm.generate([prompt(0)] + [prompt(i + 1) for i in range(others)], greedy, use_tqdm=False)
        a = outs[0].outputs[0]
        return a.token_ids, [lp[t].logprob for lp, t in zip(a.logprobs, a.token_ids)]

    runs = {label: request_a(n) for label, n in (("alone", 0), ("with 3", 3), ("with 63", 63), ("alone again", 0))}
    base_ids, base_lp = runs["alone"]
    same = {label: {"tokens": ids == base_ids, "logprob_bits": lp == base_lp,
                    "max_abs_dlogprob": max(abs(x - y) for x, y in zip(lp, base_lp))}
            for label, (ids, lp) in runs.items() if label != "alone"}
    steps = {}
    for batch in (1, 4):
        prompts = [prompt(i) for i in range(batch)]
        times = {}
        for n in (1, tokens):
            params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
            llm.generate(prompts, params, use_tqdm=False)  # warm
            sync()
            began = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            sync()
            times[n] = time.perf_counter() - began
        steps[batch] = 1e3 * (times[tokens] - times[1]) / (tokens - 1)
    return {"batch_invariant": invariant, "backend": repr(llm.backend), "same_as_alone": same,
            "decode_step_ms": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--quick", action="store_true", help="tiny shapes on the CPU: checks the harness only")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "."))
    args = ap.parse_args()
    from bench.startup import write_checkpoint

    ckpt = write_checkpoint(Path(tempfile.mkdtemp(prefix="deepserve_bi_")) / "ckpt", args.experts, args.quick)
    results = []
    for invariant in (False, True):
        r = run_mode(ckpt, invariant, args.tokens, args.quick)
        results.append(r)
        print(json.dumps(r), flush=True)
    fast, slow = results
    for b in (1, 4):
        print(f"batch {b}: decode step {fast['decode_step_ms'][b]:.2f} ms default, "
              f"{slow['decode_step_ms'][b]:.2f} ms batch-invariant ({slow['decode_step_ms'][b] / fast['decode_step_ms'][b]:.1f}x)")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "batch_invariance_gpu.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
