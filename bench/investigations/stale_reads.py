"""Which op makes a request's bits depend on what ran before it (issue 23, item 4)? One GPU call, eager mode.

    python3 bench/investigations/stale_reads.py [--out DIR]

bench/investigations/determinism.py found the kernels themselves repeatable (200 calls, same bits), yet request A
alone gave other bits on a second run, and other tokens after the KV pools were filled with NaN between runs
(without any NaN in its output): some op reads KV rows this request never wrote, and a selection (a top-k, a
mask) hides the garbage from the output's NaN check but not from its bits. Here every public op of the backend is
wrapped to record a digest of each tensor it takes and returns, request A runs on fresh (zeroed) pools, then again
after the pools are filled with NaN, then again after a batch of 64 (natural stale pages); the first call whose
inputs match the first run's but whose output does not is the op that reads stale rows (or is not repeatable).
Writes stale_reads.json into --out ($OUT when set).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

BIG = 1 << 26  # tensors of more bytes than this (the KV pools themselves) are left out of the input digests


def digest(t: torch.Tensor) -> int:
    flat = t.detach().reshape(-1)
    b = flat.new_empty(flat.shape).copy_(flat).view(torch.uint8)  # a fresh 1-D tensor: stride 1 even at one element
    w = torch.arange(b.numel(), device=b.device) % 65521 + 1
    return int((b.long() * w).sum())


def wrap_backend(backend, trace: list) -> None:
    for name in dir(backend):
        if name.startswith("_"):
            continue
        fn = getattr(backend, name)
        if not callable(fn) or isinstance(fn, type):
            continue

        def wrapped(*args, _fn=fn, _name=name, **kw):
            ins = [digest(a) if isinstance(a, torch.Tensor) and a.numel() * a.element_size() < BIG else None
                   for a in args]
            out = _fn(*args, **kw)
            outs = out if isinstance(out, tuple) else (out,)
            shapes = [list(a.shape) for a in args if isinstance(a, torch.Tensor)]
            trace.append((_name, ins, [digest(o) for o in outs if isinstance(o, torch.Tensor)], shapes))
            return out

        setattr(backend, name, functools.wraps(fn)(wrapped))


def first_divergence(a: list, b: list) -> dict | None:
    for i, ((na, ia, oa, sa), (nb, ib, ob, sb)) in enumerate(zip(a, b)):
        if na != nb:
            return {"call": i, "op": na, "other_op": nb, "what": "different op sequence"}
        if oa != ob:
            return {"call": i, "op": na, "inputs_equal": ia == ib,
                    "differing_inputs": [k for k, (x, y) in enumerate(zip(ia, ib)) if x != y],
                    "shapes": sa, "other_shapes": sb, "ops_before": [n for n, *_ in a[max(0, i - 6):i]]}
    return None if len(a) == len(b) else {"call": min(len(a), len(b)), "what": "different lengths"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "."))
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=6)
    ap.add_argument("--quick", action="store_true", help="tiny shapes on the CPU: checks the harness only")
    ap.add_argument("--interpret", action="store_true",
                    help="tiny shapes, the NVIDIA backend's kernels on the CPU under Triton's interpreter (needs "
                         "TRITON_INTERPRET=1 in the environment): finds a kernel's stale reads without a GPU")
    ap.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True,
                    help="--no-eager: decode steps through the static (CUDA-graph) layout")
    args = ap.parse_args()
    if args.interpret and os.environ.get("TRITON_INTERPRET") != "1":
        ap.error("--interpret needs TRITON_INTERPRET=1 in the environment (set before triton is imported)")
    args.quick = args.quick or args.interpret
    from bench.startup import write_checkpoint
    from deepserve import LLM, SamplingParams

    ckpt = write_checkpoint(Path(tempfile.mkdtemp(prefix="deepserve_stale_")) / "ckpt", args.experts, args.quick)
    on = {"accelerator": "nvidia", "device": "cpu", "dtype": "bfloat16"} if args.interpret else \
        {"accelerator": "cpu", "dtype": "float32"} if args.quick else {"accelerator": "nvidia", "dtype": "bfloat16"}
    llm = LLM(model=str(ckpt), max_num_seqs=64, max_model_len=2048, enable_prefix_caching=False,
              enforce_eager=args.eager, **on)
    vocab = llm.model.cfg.vocab_size
    greedy = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True, logprobs=1)
    trace: list = []
    wrap_backend(llm.backend, trace)

    def prompt(i: int) -> dict:
        return {"prompt_token_ids": [(13 * i + 7 * j) % (vocab - 2) + 2 for j in range(128)]}

    def run(others: int = 0) -> tuple[list, list]:
        trace.clear()
        out = llm.generate([prompt(0)] + [prompt(i + 1) for i in range(others)], greedy, use_tqdm=False)[0].outputs[0]
        return list(trace), [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)]

    def poison() -> list[str]:
        """Every floating tensor the KV pools hold (pages, rings, frontiers, snapshots), filled with NaN."""
        names, seen = set(), set()

        def visit(value, name: str) -> None:
            if id(value) in seen:
                return
            seen.add(id(value))
            if isinstance(value, torch.Tensor):
                if value.is_floating_point():
                    value.fill_(float("nan"))
                    names.add(name)
            elif isinstance(value, dict):
                for k, v in value.items():
                    visit(v, f"{name}.{k}")
            elif isinstance(value, (list, tuple)):
                for v in value:
                    visit(v, name)
            elif type(value).__module__.startswith("deepserve.model") and hasattr(value, "__dict__"):
                for k, v in vars(value).items():
                    visit(v, f"{name}.{k}" if name else k)

        visit(llm.cache.pools, "")
        return sorted(names)

    first, lp1 = run()
    again, lp2 = run()
    poisoned_fields = poison()
    after_nan, lp3 = run()
    run(3 if args.quick else 63)  # (the key "after_batch_64" names the GPU run's batch)
    after_batch, lp4 = run()
    result = {"poisoned_fields": poisoned_fields, "calls_per_run": len(first),
              "again": {"logprobs_equal": lp1 == lp2, "divergence": first_divergence(first, again)},
              "after_nan": {"logprobs_equal": lp1 == lp3, "divergence": first_divergence(first, after_nan)},
              "after_batch_64": {"logprobs_equal": lp1 == lp4, "divergence": first_divergence(first, after_batch)}}
    print(json.dumps(result, indent=1), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "stale_reads.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
