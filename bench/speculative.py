"""Speculative decoding on the embedded model: no speculation vs fixed-k MTP vs DSpark, at several concurrencies.

    python bench/speculative.py --device cpu  --output-len 16            # the CPU comparison (short)
    python bench/speculative.py --device cuda --output-len 128           # the H200 run

For each method (none, `mtp` = verify all k drafts, `dspark` = confidence-planned verify lengths) one engine is
built; for each concurrency (default 1, 16, 60, 96) one run generates `--output-len` tokens for that many
requests at once (prompts: the embedded model's held-out code prompts, cycled), after a warm-up run. Reported
per run: verified drafts per sequence-step, accepted drafts per sequence-step, tokens per sequence-step
(accepted + 1), and throughput (output tokens / wall seconds of the run). DSpark's step-time curve keeps what
it learned in earlier runs, as it would in a server. Writes `bench_speculative_<device>.json` and
`speculative_<device>.png` into `--out` (default docs/).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "deepserve" / "assets" / "deepserve-tiny-v4"
METHODS = ("none", "mtp", "dspark")


def prompts(n: int, input_len: int) -> list[list[int]]:
    heldout = json.loads((MODEL / "heldout.json").read_text())["completion"]
    return [heldout[i % len(heldout)]["prompt"][:input_len] for i in range(n)]


def make_llm(method: str, args):
    from deepserve import LLM

    spec = None if method == "none" else {"method": method, "num_speculative_tokens": args.k}
    accelerator = args.accelerator or ("nvidia" if args.device == "cuda" else "cpu")
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    return LLM(MODEL, dtype=dtype, accelerator=accelerator, max_num_seqs=max(args.concurrency),
               max_model_len=args.input_len + args.output_len + 64, block_size=256, load_plugins=False,
               speculative_config=spec, max_num_batched_tokens=args.max_num_batched_tokens)


def run(llm, n: int, args) -> dict:
    from deepserve import SamplingParams
    from deepserve.core.engine import SpecDecodeStats

    params = SamplingParams(temperature=args.temperature, seed=0 if args.temperature else None,
                            max_tokens=args.output_len, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts(n, args.input_len)]
    llm.generate(batch[: min(n, 4)], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)  # warm-up
    stats = llm.engine.stats
    stats.spec = SpecDecodeStats()
    steps_before = stats.num_steps
    if args.device == "cuda":
        torch.cuda.synchronize()
    began = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    if args.device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - began
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    spec = stats.spec
    seq_steps = spec.num_seq_steps
    return {
        "concurrency": n, "seconds": seconds, "output_tokens": num_tokens, "throughput_tok_s": num_tokens / seconds,
        "engine_steps": stats.num_steps - steps_before,
        "sequence_steps": seq_steps,
        "verified_per_step": spec.num_verified_tokens / seq_steps if seq_steps else 0.0,
        "accepted_per_step": spec.num_accepted_tokens / seq_steps if seq_steps else 0.0,
        "tokens_per_step": (spec.num_accepted_tokens + seq_steps) / seq_steps if seq_steps else 1.0,
        "acceptance_by_position": [a / v if v else 0.0 for a, v in zip(spec.accepted_by_position,
                                                                      spec.verified_by_position)],
        "token_ids_head": outs[0].outputs[0].token_ids[:8],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--accelerator", default=None, help="default: nvidia on cuda, cpu on cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 60, 96])
    ap.add_argument("--methods", type=lambda s: s.split(","), default=list(METHODS))
    ap.add_argument("--input-len", type=int, default=96)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--k", type=int, default=5, help="num_speculative_tokens")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "docs")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    results: dict[str, list[dict]] = {}
    for method in args.methods:
        llm = make_llm(method, args)
        results[method] = []
        for n in args.concurrency:
            r = run(llm, n, args)
            results[method].append(r)
            print(f"{method:>6} x{n:<3} {r['throughput_tok_s']:9.1f} tok/s  verified/step {r['verified_per_step']:.2f}"
                  f"  accepted/step {r['accepted_per_step']:.2f}  ({r['seconds']:.1f} s)", flush=True)
        llm.engine.shutdown()
        del llm
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    mismatches = []  # greedy: every method should give the same tokens (exact on the batch-invariant reference)
    for i, n in enumerate(args.concurrency):
        heads = {m: results[m][i]["token_ids_head"] for m in results}
        if args.temperature == 0 and len(set(map(tuple, heads.values()))) > 1:
            mismatches.append(n)
            print(f"warning: greedy outputs differ between methods at concurrency {n}: {heads}", flush=True)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else (platform.processor() or
                                                                               platform.machine())
    record = {"command": "python " + " ".join(sys.argv), "device": args.device,
              "machine": f"{device_name}, {torch.get_num_threads()} torch threads, torch {torch.__version__}",
              "model": "deepserve-tiny-v4 (embedded)", "input_len": args.input_len, "output_len": args.output_len,
              "num_speculative_tokens": args.k, "temperature": args.temperature,
              "greedy_mismatch_at_concurrency": mismatches, "results": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"bench_speculative_{args.device}.json").write_text(json.dumps(record, indent=2) + "\n")
    print(table(record))
    plot(record, args.out / f"speculative_{args.device}.png")


def table(record: dict) -> str:
    rows = ["| concurrency | method | tok/s | vs none | verified/step | accepted/step | tokens/step |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    results = record["results"]
    for i, n in enumerate(r["concurrency"] for r in next(iter(results.values()))):
        base = results.get("none", [None] * (i + 1))[i]
        for method, runs in results.items():
            r = runs[i]
            ratio = f"{r['throughput_tok_s'] / base['throughput_tok_s']:.2f}x" if base else "-"
            rows.append(f"| {n} | {method} | {r['throughput_tok_s']:.1f} | {ratio} | {r['verified_per_step']:.2f} | "
                        f"{r['accepted_per_step']:.2f} | {r['tokens_per_step']:.2f} |")
    return "\n".join(rows)


def plot(record: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    results = record["results"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"none": "tab:gray", "mtp": "tab:blue", "dspark": "tab:orange"}
    for method, runs in results.items():
        xs = [r["concurrency"] for r in runs]
        color = colors.get(method)
        ax1.plot(xs, [r["throughput_tok_s"] for r in runs], marker="o", label=method, color=color)
        if method != "none":
            ax2.plot(xs, [r["verified_per_step"] for r in runs], marker="o", linestyle="--", color=color,
                     label=f"{method}: verified")
            ax2.plot(xs, [r["accepted_per_step"] for r in runs], marker="s", color=color,
                     label=f"{method}: accepted")
    ax1.set(xlabel="concurrent sequences", ylabel="output tokens / s", title="throughput")
    ax2.set(xlabel="concurrent sequences", ylabel="drafts per sequence-step", title="verified and accepted drafts")
    for ax in (ax1, ax2):
        ax.set_xscale("log")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(f"speculative decoding, embedded model, {record['device']}: {record['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def replot(json_path: Path) -> None:
    """Redraw the plot of a saved run (`python bench/speculative.py --replot docs/bench_speculative_cpu.json`)."""
    record = json.loads(json_path.read_text())
    plot(record, json_path.parent / f"speculative_{record['device']}.png")
    print(table(record))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--replot":
        replot(Path(sys.argv[2]))
    else:
        main()
