"""Where does the NVIDIA backend's run-to-run difference come from (issue 23, item 4)? One GPU call.

    python3 bench/investigations/determinism.py [--out DIR] [--repeats 200]

bench/batch_invariance_gpu.py found request A's greedy tokens different when it ran "alone again" after a batch
of 64, with CUDA graphs on, which is more than batch dependence: the same batch gave other bits. Three probes:

1. Kernels that reduce across programs (an arrival counter, the last program sums the parts in a fixed order):
   split-K `gemv`, `moe_small`, `route_hidden`, each called `--repeats` times on the same inputs at V4-Flash
   shapes; the count of calls whose bits differ from the first. A memory-ordering race shows up here.
2. The engine, CUDA graphs on and off (`enforce_eager`): request A alone three times, beside 3 others twice,
   beside 63 others twice, alone twice more; per run, whether A's tokens and logprob bits equal its first alone
   run and its earlier run of the same batch (the run-to-run question, separated from the batch question), and
   the first differing token position.
3. The same after the KV pools are filled with NaN between runs (`poison`): output that then turns NaN or
   changes reads KV rows it never wrote (stale pages), which would explain "alone again" without any race.

Writes determinism.json into --out ($OUT when set).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def kernel_repeats(repeats: int) -> dict:
    from deepserve.backends.nvidia.triton_ops.gemv import gemv
    from deepserve.backends.nvidia.triton_ops.moe import moe_small, route_hidden

    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)

    def randn(shape, std=1.0):
        return (torch.randn(shape, generator=g, device=dev) * std).to(torch.bfloat16)

    def count_diffs(call) -> dict:
        first = call()
        first = [t.clone() for t in (first if isinstance(first, tuple) else (first,))]
        bad = 0
        for _ in range(repeats):
            out = call()
            out = out if isinstance(out, tuple) else (out,)
            bad += any(not torch.equal(a, b) for a, b in zip(first, out))
        torch.cuda.synchronize()
        return {"repeats": repeats, "differing": bad}

    results = {}
    counters = torch.zeros(8192, dtype=torch.int32, device=dev)
    for M, N, K in ((1, 4096, 4096), (4, 1536, 4096), (1, 4096, 8192), (16, 4160, 4096)):
        x, w = randn((M, K)), randn((N, K), K**-0.5)
        results[f"gemv M={M} N={N} K={K}"] = count_diffs(lambda: gemv(x, w, None, counters))
    D, I, E, k = 4096, 2048, 32, 6
    w13, w2 = randn((E, 2 * I, D), D**-0.5), randn((E, D, I), I**-0.5)
    s13, s2 = randn((2 * I, D), D**-0.5), randn((D, I), I**-0.5)
    for T in (1, 4, 16):
        x = randn((T, D))
        weights, ids = torch.topk(torch.rand((T, E), generator=g, device=dev), k, dim=1)
        results[f"moe_small T={T}"] = count_diffs(lambda: moe_small(x, ids, weights, w13, w2, 10.0, s13, s2, counters))
    w_r, bias = randn((E, D), D**-0.5), torch.randn(E, generator=g, device=dev) * 0.1
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    for T in (1, 16):
        x, tokens = randn((T, D)), torch.randint(0, 50, (T,), generator=g, device=dev)
        results[f"route_hidden T={T}"] = count_diffs(lambda: route_hidden(x, w_r, bias, None, tokens, k, 1.5, counter))
    return results


def engine_runs(ckpt: Path, eager: bool, poison: bool, tokens: int) -> dict:
    from deepserve import LLM, SamplingParams

    llm = LLM(model=str(ckpt), dtype="bfloat16", accelerator="nvidia", max_num_seqs=64, max_model_len=2048,
              enable_prefix_caching=False, enforce_eager=eager, cuda_graph_sizes=[1, 4, 64])
    vocab = llm.model.cfg.vocab_size
    greedy = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, logprobs=1)

    def prompt(i: int) -> dict:
        return {"prompt_token_ids": [(13 * i + 7 * j) % (vocab - 2) + 2 for j in range(128)]}

    def fill_nan() -> None:
        for pools in llm.cache.pools.values():
            for p in pools:
                for t in vars(p).values():
                    if isinstance(t, torch.Tensor) and t.is_floating_point():
                        t.fill_(float("nan"))

    def run_a(others: int):
        if poison:
            fill_nan()
        outs = llm.generate([prompt(0)] + [prompt(i + 1) for i in range(others)], greedy, use_tqdm=False)
        a = outs[0].outputs[0]
        return list(a.token_ids), [lp[t].logprob for lp, t in zip(a.logprobs, a.token_ids)]

    plan = [("alone", 0)] * 3 + [("with 3", 3)] * 2 + [("with 63", 63)] * 2 + [("alone", 0)] * 2
    seen: dict[str, tuple] = {}
    rows = []
    base = None
    for label, others in plan:
        ids, lps = run_a(others)
        base = base or (ids, lps)
        same_label = seen.setdefault(label, (ids, lps))

        def first_diff(ref):
            return next((i for i, (a, b) in enumerate(zip(ids, ref[0])) if a != b), None)

        rows.append({"run": label, "tokens_equal_first_alone": ids == base[0], "bits_equal_first_alone": lps == base[1],
                     "tokens_equal_first_same_batch": ids == same_label[0],
                     "bits_equal_first_same_batch": lps == same_label[1],
                     "first_token_diff_vs_alone": first_diff(base),
                     "nan": any(x != x for x in lps)})
        print(("eager" if eager else "graphs") + (" poisoned" if poison else ""), json.dumps(rows[-1]), flush=True)
    del llm
    torch.cuda.empty_cache()
    return {"eager": eager, "poison": poison, "runs": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "."))
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=24)
    args = ap.parse_args()
    from bench.startup import write_checkpoint

    result = {"kernels": kernel_repeats(args.repeats)}
    print(json.dumps(result["kernels"], indent=1), flush=True)
    ckpt = write_checkpoint(Path(tempfile.mkdtemp(prefix="deepserve_det_")) / "ckpt", args.experts, False)
    result["engine"] = [engine_runs(ckpt, eager, poison, args.tokens)
                        for eager, poison in ((False, False), (True, False), (False, True))]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "determinism.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
