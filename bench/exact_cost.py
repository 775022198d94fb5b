"""What batch invariance by construction costs on the CPU: the reference backend's exact ops (`exact=True`, the
default) against the same formulas on torch's kernels (`exact=False`), through the whole engine, in one run.

For each mode: a prefill of `--prompt` tokens and `--tokens` greedy decode steps, one request alone and
`--batch` requests together, on the embedded model (or `--model`), best of `--repeats`. Prints a table and
writes exact_cost.json into --out.

    .venv/bin/python bench/exact_cost.py --out bench/results
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from deepserve.backends.reference import ReferenceBackend
from deepserve.build import build_engine, resolve_config
from deepserve.core.hookspecs import hookimpl
from deepserve.core.plugins import make_plugin_manager
from deepserve.core.sampling_params import SamplingParams


class Mode:
    """A plugin that answers the backend hook first with the reference backend in one mode."""

    def __init__(self, exact: bool) -> None:
        self.exact = exact

    @hookimpl(tryfirst=True)
    def deepserve_select_backend(self, config):
        return ReferenceBackend("cpu", exact=self.exact)


def run(engine, prompts: list[list[int]], tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    began = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}-{began}", ids, params, final_only=True)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - began


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    torch.set_num_threads(1)
    results = {}
    for exact in (False, True):
        config = resolve_config(args.model, accelerator="cpu", block_size=128, kv_cache_bytes=2**26,
                                max_num_seqs=args.batch, async_scheduling=False)
        parts = build_engine(config, make_plugin_manager(load_entrypoints=False, plugins=[Mode(exact)]))
        vocab = parts.model.cfg.vocab_size
        prompts = [[(7 * i + 13 * j) % (vocab - 2) + 2 for j in range(args.prompt)] for i in range(args.batch)]
        row = {}
        for name, batch in (("alone", prompts[:1]), (f"batch {args.batch}", prompts)):
            row[name] = min(run(parts.engine, batch, args.tokens) for _ in range(args.repeats))
        results["exact" if exact else "torch"] = row
        parts.engine.shutdown()
    print(f"{'case':>12} {'torch s':>9} {'exact s':>9} {'ratio':>6}")
    for case in results["torch"]:
        t, e = results["torch"][case], results["exact"][case]
        print(f"{case:>12} {t:9.3f} {e:9.3f} {e / t:6.2f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "exact_cost.json").write_text(json.dumps({"args": vars(args), "seconds": results}, indent=1))


if __name__ == "__main__":
    main()
