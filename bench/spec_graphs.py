"""Speculative decoding at V4-Flash layer shapes with a drafter of controlled acceptance, against no speculation.

    python bench/spec_graphs.py            # one H200: batch 1, 16, 64; p = 0.5, 0.7, 0.9; fixed-5 and DSpark
    python bench/spec_graphs.py --quick    # the harness on the CPU (tiny shapes, short runs): not a measurement

Random weights make a real drafter's acceptance meaningless, so the drafter here is a `Proposer` that knows the
target's greedy continuation of every prompt (a run without speculation, made first) and proposes, for each draft
position independently, the target's own greedy token with probability p and a random other token otherwise:
draft j is accepted, given drafts < j were, with probability p. It also emits a confidence that predicts the
acceptance with stated noise, for DSpark's planner: `--conf-hit` (default 0.85) for a draft that is the target's
token, `--conf-miss` (0.15) for one that is not, plus Gaussian noise of deviation `--conf-noise` (0.1), clamped to
[0.01, 0.99]. Drafting costs the host a few microseconds a sequence and nothing on the device, so the run measures
what verification costs and gains: the target's verify steps (replayed CUDA graphs, `VerifyGraphs`, where `LLM`
captured them; `fixed_eager` runs them eagerly, the baseline of what the graphs gain) against plain decoding's
replayed CUDA graphs. (A sequence whose tokens leave the reference, a near-tie the verify
pass resolves otherwise than plain decoding, gets random drafts from there on; `diverged` counts them. In bf16 at these shapes on the H200 most sequences
leave it within 48 tokens, and acceptance falls far below p: `--dtype float32` keeps them on it.)

Model: bench/gpu.py's V4-Flash layer shapes (hidden 4096, 64 heads of 512, window 128, CSA 4 / HCA 128, vocab
129280), layers SW CSA HCA CSA, 16 routed experts top-6, random bf16 on the GPU, written to a temporary directory and
loaded through `LLM` (without speculation its decode CUDA graphs are captured at start-up). Prompts: `--input-len` random tokens, `--output-len`
greedy tokens each, `ignore_eos`. Throughput = output tokens / wall seconds of a `generate` after a warm-up.
Writes spec_graphs.json into --out ($OUT when set, else bench/results/) and prints a table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import gpu as base  # noqa: E402  bench/gpu.py: the V4-Flash layer shapes and the random-weight builder

from deepserve.core.hookspecs import hookimpl  # noqa: E402
from deepserve.model.speculative import Drafts, Proposer  # noqa: E402

LAYERS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
          "compressed_sparse_attention"]
#: fixed-k and DSpark with the target's verify steps in CUDA graphs (`VerifyGraphs`, where `LLM` captures them);
#: `fixed_eager`: fixed-k with every verify step eager (the graphs dropped), the baseline of what the graphs gain
METHODS = ("fixed", "dspark", "fixed_eager")


class ControlledDrafter(Proposer):
    """Drafts the target's greedy token with probability `p` at each position, a random other token otherwise; a
    confidence of `conf_hit` / `conf_miss` plus noise. `references` maps a prompt's first 16 tokens after its
    first to that prompt's tokens followed by its greedy continuation (set before each run)."""

    def __init__(self, k: int, vocab_size: int, device, planner=None, conf_hit=0.85, conf_miss=0.15,
                 conf_noise=0.1) -> None:
        self.num_speculative_tokens, self.vocab_size, self.device, self.planner = k, vocab_size, device, planner
        self.conf_hit, self.conf_miss, self.conf_noise = conf_hit, conf_miss, conf_noise
        self.p, self.rng = 1.0, random.Random(0)
        self.references: dict[tuple[int, ...], list[int]] = {}
        self._seqs: dict[int, tuple[list[int] | None, list[int]]] = {}  # id(state) -> (reference, tokens so far)
        self.diverged = 0

    def reset(self, p: float, seed: int) -> None:
        self.p, self.rng, self.diverged = p, random.Random(seed), 0
        self._seqs.clear()

    def propose(self, streams, chunks, sampling):
        tokens, confs = [], []
        for c in chunks:
            if c.start == 0:  # a new sequence (prefix caching is off): find its reference by its prompt
                self._seqs[id(c.state)] = (self.references.get(tuple(c.next_token_ids[:16])), [])
            ref, seen = self._seqs[id(c.state)]
            del seen[c.start:]  # a rollback drops the rejected drafts
            seen += c.next_token_ids  # the tokens at positions 1 .. start + num_committed
            end = c.start + c.num_committed  # L: the sequence's token at L is seen[-1]; drafts are at L + 1 ..
            if ref is not None and (len(ref) <= end or ref[end] != seen[-1]):
                self._seqs[id(c.state)] = (None, seen)  # left the reference: random drafts from here on
                self.diverged += 1
                ref = None
            if not c.num_drafts:
                continue
            row, conf = [], []
            for j in range(c.num_drafts):
                want = ref[end + 1 + j] if ref is not None and end + 1 + j < len(ref) else None
                hit = want is not None and self.rng.random() < self.p
                if hit:
                    token = want
                else:
                    token = self.rng.randrange(self.vocab_size - 1)
                    token += token >= want if want is not None else 0  # any token but the target's
                row.append(token)
                noisy = (self.conf_hit if hit else self.conf_miss) + self.rng.gauss(0.0, self.conf_noise)
                conf.append(min(max(noisy, 0.01), 0.99))
            tokens.append(row)
            confs.append(conf)
        if not tokens:
            return None
        return Drafts(torch.tensor(tokens, dtype=torch.long, device=self.device), None,
                      torch.tensor(confs, dtype=torch.float32, device=self.device))


class ControlledPlugin:
    """Registers the drafter as `controlled-fixed` (verify every draft) and `controlled-dspark` (DSpark's planner
    over the confidences and the measured step-time curve)."""

    def __init__(self, args) -> None:
        self.args = args

    @hookimpl
    def deepserve_register_proposers(self, register) -> None:
        from deepserve.plugins.speculative.dspark import DSparkPlanner

        a = self.args

        def factory(planned):
            def make(model, config, model_dir=None):
                return ControlledDrafter(config.num_speculative_tokens, model.cfg.vocab_size,
                                         model.lm_head.weight.device, DSparkPlanner() if planned else None,
                                         a.conf_hit, a.conf_miss, a.conf_noise)
            return make

        register("controlled-fixed", factory(False))
        register("controlled-dspark", factory(True))


def make_llm(path: Path, method: str | None, args):
    """An `LLM` over the checkpoint, with this file's drafters registered (passed to `build_engine` as a plugin:
    `LLM` takes no plugin manager)."""
    import deepserve.llm as llm_module
    from deepserve import LLM
    from deepserve.core.plugins import make_plugin_manager

    build = llm_module.build_engine
    pm = make_plugin_manager(load_entrypoints=False, plugins=[ControlledPlugin(args)])
    llm_module.build_engine = lambda config: build(config, plugin_manager=pm)
    try:
        spec = None if method is None else {"method": f"controlled-{method}", "num_speculative_tokens": args.k}
        return LLM(str(path), dtype=args.dtype, accelerator=args.accelerator, max_num_seqs=max(args.batch),
                   max_model_len=args.input_len + args.output_len + 64, enable_prefix_caching=False,
                   kv_cache_bytes=args.kv_cache_bytes, speculative_config=spec, load_plugins=False)
    finally:
        llm_module.build_engine = build


def sync(args) -> None:
    if args.accelerator == "nvidia":
        torch.cuda.synchronize()


def timed_generate(llm, prompts, args):
    from deepserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(batch, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)  # warm-up
    sync(args)
    began = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    sync(args)
    return outs, time.perf_counter() - began


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """This script's options (`argv`, else the command line's), with the defaults of the device they run on."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes on the CPU: checks the harness only")
    ap.add_argument("--batch", type=int, nargs="+", default=None, help="concurrencies (default 1 16 64)")
    ap.add_argument("--p", type=float, nargs="+", default=[0.5, 0.7, 0.9], help="draft acceptance probabilities")
    ap.add_argument("-k", type=int, default=5, help="drafts a step (fixed-k verifies all of them)")
    ap.add_argument("--input-len", type=int, default=None)
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--conf-hit", type=float, default=0.85)
    ap.add_argument("--conf-miss", type=float, default=0.15)
    ap.add_argument("--conf-noise", type=float, default=0.1)
    ap.add_argument("--dtype", default=None, help="model dtype (default bfloat16 on the GPU, float32 on the CPU); "
                    "float32 keeps the verify pass's near-ties those of plain decoding, so sequences stay on the "
                    "reference and p is the acceptance")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "bench" / "results")))
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.quick
    args.accelerator = "nvidia" if cuda else "cpu"
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.batch = args.batch or ([1, 4] if args.quick else [1, 16, 64])
    args.input_len = args.input_len or (32 if args.quick else 256)
    args.output_len = args.output_len or (12 if args.quick else 96)
    args.kv_cache_bytes = (8 << 30) if cuda else (256 << 20)
    if not all(0.0 <= p <= 1.0 for p in args.p) or args.k < 1:
        ap.error("--p values must be in [0, 1] and -k at least 1")
    return args


def run(args: argparse.Namespace) -> dict:
    """Every method at every batch and p (`parse_args`'s options); returns the record (also written to --out as
    spec_graphs.json) and prints the table."""
    cuda = args.accelerator == "nvidia"
    shapes = base.QUICK if args.quick else base.V4_FLASH_LAYER
    cfg = dict(shapes, n_routed_experts=args.experts if not args.quick else 8, layer_types=LAYERS,
               num_hidden_layers=len(LAYERS), mlp_layer_types=["hash_moe"] + ["moe"] * (len(LAYERS) - 1))
    if cuda:
        from deepserve.backends.nvidia import NvidiaBackend

        backend = NvidiaBackend("cuda:0")
    else:
        from deepserve.backends.reference import ReferenceBackend

        backend = ReferenceBackend("cpu")
    from deepserve.model.writer import save_checkpoint

    record = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "quick": args.quick, "k": args.k,
              "dtype": args.dtype,
              "input_len": args.input_len, "output_len": args.output_len, "layers": LAYERS,
              "experts": cfg["n_routed_experts"], "confidence": {"hit": args.conf_hit, "miss": args.conf_miss,
                                                                 "noise": args.conf_noise}, "runs": []}
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model = base.build(cfg, backend, getattr(torch, args.dtype), seed=0)
        save_checkpoint(model, tmp)
        del model
        gc.collect()
        vocab = cfg["vocab_size"]
        g = torch.Generator().manual_seed(0)
        prompts = {b: [torch.randint(2, vocab, (args.input_len,), generator=g).tolist() for _ in range(b)]
                   for b in args.batch}
        references, baseline = {}, {}
        llm = make_llm(Path(tmp), None, args)
        for b in args.batch:
            outs, seconds = timed_generate(llm, prompts[b], args)
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            baseline[b] = tokens / seconds
            for p_ids, o in zip(prompts[b], outs):
                references[tuple(p_ids[1:17])] = p_ids + list(o.outputs[0].token_ids)
            record["runs"].append({"method": "none", "batch": b, "tok_s": baseline[b], "seconds": seconds})
            print(f"none     batch {b:3d}: {baseline[b]:9.1f} tok/s", flush=True)
        del llm
        gc.collect()
        for method in METHODS:
            llm = make_llm(Path(tmp), method.removesuffix("_eager"), args)
            if method.endswith("_eager"):
                llm.runner.verify_graphs = None
            verify_graphs = llm.runner.verify_graphs
            drafter = llm.proposer
            drafter.references = references
            for b in args.batch:
                for p in args.p:
                    drafter.reset(p, seed=b)
                    stats = llm.engine.stats
                    from deepserve.core.engine import SpecDecodeStats

                    stats.spec = SpecDecodeStats()
                    graph_steps = verify_graphs.steps if verify_graphs is not None else 0
                    outs, seconds = timed_generate(llm, prompts[b], args)
                    graph_steps = (verify_graphs.steps if verify_graphs is not None else 0) - graph_steps
                    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                    spec = stats.spec
                    steps = spec.num_seq_steps or 1
                    same = sum(references[tuple(q[1:17])][len(q):] == list(o.outputs[0].token_ids)
                               for q, o in zip(prompts[b], outs))
                    run = {"method": method, "batch": b, "p": p, "tok_s": tokens / seconds, "seconds": seconds,
                           "vs_none": tokens / seconds / baseline[b],
                           "verified_per_step": spec.num_verified_tokens / steps,
                           "accepted_per_step": spec.num_accepted_tokens / steps,
                           "equal_to_plain": f"{same}/{b}", "diverged": drafter.diverged,
                           "verify_graph_steps": graph_steps}
                    record["runs"].append(run)
                    print(f"{method:8s} batch {b:3d} p {p:.1f}: {run['tok_s']:9.1f} tok/s ({run['vs_none']:.2f}x), "
                          f"verified {run['verified_per_step']:.2f} accepted {run['accepted_per_step']:.2f} a step, "
                          f"equal to plain {same}/{b}, {graph_steps} verify steps in graphs", flush=True)
            del llm
            gc.collect()
    record["seconds"] = time.perf_counter() - began
    print(table(record))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "spec_graphs.json").write_text(json.dumps(record, indent=1))
    return record


def main() -> None:
    run(parse_args())


def table(record: dict) -> str:
    """Markdown: tokens/s of each method against no speculation, per batch and p."""
    runs = record["runs"]
    none = {r["batch"]: r["tok_s"] for r in runs if r["method"] == "none"}
    lines = ["| batch | none tok/s | p | fixed-k tok/s (x none) | DSpark tok/s (x none) | DSpark vs fixed-k | "
             "fixed-k, eager verify (x none) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for b in sorted(none):
        for p in sorted({r["p"] for r in runs if r["method"] != "none"}):
            got = {r["method"]: r["tok_s"] for r in runs if r["batch"] == b and r.get("p") == p}
            fixed, dspark = got.get("fixed"), got.get("dspark")
            cell = lambda v: f"{v:,.0f} ({v / none[b]:.2f}x)" if v else "-"  # noqa: E731
            rel = f"{100 * (dspark / fixed - 1):+.1f}%" if fixed and dspark else "-"
            lines.append(f"| {b} | {none[b]:,.0f} | {p} | {cell(fixed)} | {cell(dspark)} | {rel} | "
                         f"{cell(got.get('fixed_eager'))} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
