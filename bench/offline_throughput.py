"""Offline throughput: deepserve's engine against transformers' `generate` on the same checkpoint, same run.

    python bench/offline_throughput.py --num-prompts 32 --input-len 256 --output-len 32 [--threads 2]

Builds (or reuses) a random DeepSeek-V4 checkpoint with transformers' `DeepseekV4ForCausalLM` (every layer
type; `--size small` is hidden 256, 6 layers), then measures:
1. N prompts of `input-len` random tokens, `output-len` greedy tokens each: deepserve (all requests together,
   continuous batching) vs transformers (`generate`, one prompt at a time: its batched generation left-pads, which
   is wrong for V4's compressed layers). Output tokens/s and requests/s, and the ratio.
2. Prefix-cache TTFT: requests sharing a `--prefix-len` prefix, served one at a time; time to the first token
   with prefix caching on vs off.
3. The host-side gap between device steps (asynchronous scheduling on).
Writes a JSON record, a markdown table row set, and a plot into `--out` (default docs/).
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
sys.path.insert(0, str(ROOT / "tests"))

SIZES = {
    "tiny": dict(hidden_size=64, moe_intermediate_size=32, num_attention_heads=4, head_dim=32, q_lora_rank=32,
                 o_lora_rank=16),
    "small": dict(hidden_size=256, moe_intermediate_size=128, num_attention_heads=8, head_dim=64, q_lora_rank=128,
                  o_lora_rank=64, vocab_size=4096, index_head_dim=64),
}


def build_checkpoint(size: str, path: Path) -> Path:
    import tiny

    if (path / "config.json").is_file():
        return path
    model = tiny.make_hf_model(seed=0, **SIZES[size])
    return tiny.save_hf_checkpoint(model, path)


def random_prompts(n: int, length: int, vocab: int, seed: int, prefix: list[int] | None = None) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [(prefix or []) + torch.randint(2, vocab, (length,), generator=g).tolist() for _ in range(n)]


def bench_transformers(path: Path, prompts, output_len: int) -> float:
    from transformers import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    began = time.perf_counter()
    with torch.no_grad():
        for p in prompts:
            out = model.generate(torch.tensor([p]), max_new_tokens=output_len, min_new_tokens=output_len,
                                 do_sample=False, pad_token_id=0)
            assert out.shape[1] == len(p) + output_len
    return time.perf_counter() - began


def bench_deepserve(path: Path, prompts, output_len: int, **llm_kwargs):
    from deepserve import LLM, SamplingParams

    llm = LLM(path, dtype="float32", accelerator="cpu", **llm_kwargs)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate([prompts[0][:8]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    llm.engine.stats.host_gaps.clear()
    began = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - began
    assert all(len(o.outputs[0].token_ids) == output_len for o in outs)
    return seconds, llm


def ttft(path: Path, prompts, enable_prefix_caching: bool) -> list[float]:
    from deepserve import LLM, SamplingParams

    llm = LLM(path, dtype="float32", accelerator="cpu", enable_prefix_caching=enable_prefix_caching, block_size=128)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times = []
    for p in prompts:
        began = time.perf_counter()
        llm.generate([{"prompt_token_ids": p}], one, use_tqdm=False)
        times.append(time.perf_counter() - began)
    return times[1:]  # the first request fills the cache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--num-prefix-requests", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--checkpoint", type=Path, default=Path("/tmp/deepserve-bench"))
    ap.add_argument("--out", type=Path, default=ROOT / "docs")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    path = build_checkpoint(args.size, args.checkpoint / args.size)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    prompts = random_prompts(args.num_prompts, args.input_len, vocab, seed=1)
    ds_seconds, llm = bench_deepserve(path, prompts, args.output_len, block_size=128)
    gaps = llm.engine.stats.host_gaps
    hf_seconds = bench_transformers(path, prompts, args.output_len)
    n_out = args.num_prompts * args.output_len

    prefix = random_prompts(1, args.prefix_len, vocab, seed=2)[0]
    shared = random_prompts(args.num_prefix_requests, 16, vocab, seed=3, prefix=prefix)
    with_cache = ttft(path, shared, True)
    without = ttft(path, shared, False)

    record = {
        "command": "python " + " ".join(sys.argv),
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
                   f"torch {torch.__version__}",
        "size": args.size, "num_prompts": args.num_prompts, "input_len": args.input_len,
        "output_len": args.output_len,
        "deepserve_seconds": ds_seconds, "transformers_seconds": hf_seconds,
        "deepserve_output_tok_s": n_out / ds_seconds, "transformers_output_tok_s": n_out / hf_seconds,
        "deepserve_req_s": args.num_prompts / ds_seconds, "transformers_req_s": args.num_prompts / hf_seconds,
        "throughput_ratio": hf_seconds / ds_seconds,
        "prefix_len": args.prefix_len,
        "ttft_cached_median_s": statistics.median(with_cache), "ttft_uncached_median_s": statistics.median(without),
        "ttft_ratio": statistics.median(without) / statistics.median(with_cache),
        "host_gap_median_ms": 1e3 * statistics.median(gaps) if gaps else None,
        "host_gap_p90_ms": 1e3 * sorted(gaps)[int(0.9 * (len(gaps) - 1))] if gaps else None,
        "device_step_median_ms": 1e3 * statistics.median(llm.engine.stats.step_seconds),
        "num_steps": llm.engine.stats.num_steps,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_offline_throughput.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))
    plot(record, args.out / "offline_throughput.png")


def plot(r: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4))
    a.bar(["transformers\n(one at a time)", "deepserve\n(continuous batching)"],
          [r["transformers_output_tok_s"], r["deepserve_output_tok_s"]], color=["#999", "#2a6"])
    a.set_ylabel("output tokens / s")
    a.set_title(f"{r['num_prompts']} prompts, {r['input_len']} in / {r['output_len']} out")
    b.bar(["prefix cache off", "prefix cache on"], [1e3 * r["ttft_uncached_median_s"], 1e3 * r["ttft_cached_median_s"]],
          color=["#999", "#26a"])
    b.set_ylabel("TTFT, ms (median)")
    b.set_title(f"shared {r['prefix_len']}-token prefix")
    fig.suptitle(f"CPU, {r['size']} random V4 checkpoint ({r['machine']})", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
