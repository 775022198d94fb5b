"""Where an engine decode step's time goes on the GPU: `LLM.generate` on a checkpoint, with per-step timings.

    python bench/investigations/engine_profile.py --model DIR [--num-seqs 64 --input-len 512 --output-len 128]
        [--enforce-eager]
    python bench/investigations/engine_profile.py --synthetic [--model DIR]
        # bench/gpu.py's V4-Flash-shape checkpoint, written into DIR first unless it holds one (GPU)

Times, per engine step: the runner's `execute` (wall, on the runner thread), the part of it in the model forward
(`DecodeGraphs.forward` or the eager forward), the host gaps the engine records between device steps, and the
engine's `step()` on the main thread; counts graph and eager forwards. Prints medians (and the decode rate at the
median step: sequences over its seconds) and writes a JSON record.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def synthetic_checkpoint(path: Path) -> Path:
    sys.path.insert(0, str(ROOT / "bench"))
    from gpu import V4_FLASH_LAYER, build  # noqa: E402

    from deepserve.backends.nvidia import NvidiaBackend
    from deepserve.model.writer import save_checkpoint

    model = build(V4_FLASH_LAYER, NvidiaBackend("cuda:0"), torch.bfloat16)
    save_checkpoint(model, path)
    del model
    torch.cuda.empty_cache()
    return path


def timed_calls(obj, name: str, log: list) -> None:
    """Replace obj.name with a wrapper appending each call's wall seconds to `log`."""
    fn = getattr(obj, name)

    def wrapper(*args, **kwargs):
        began = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            log.append(time.perf_counter() - began)

    setattr(obj, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--synthetic", action="store_true")
    ap.add_argument("--num-seqs", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("engine_profile.json"))
    args = ap.parse_args()
    from deepserve import LLM, SamplingParams

    path = args.model
    if args.synthetic and not (path and (path / "config.json").is_file()):  # written once, reused by later runs
        path = synthetic_checkpoint(path or Path(tempfile.mkdtemp(prefix="deepserve-engine-")))
    llm = LLM(str(path), max_num_seqs=args.num_seqs, kv_cache_bytes=8 << 30 if torch.cuda.is_available() else None,
              max_model_len=args.input_len + args.output_len + 256, enforce_eager=args.enforce_eager,
              load_plugins=False)
    vocab = llm.model.cfg.vocab_size
    g = torch.Generator().manual_seed(5)
    prompts = [{"prompt_token_ids": torch.randint(2, vocab, (args.input_len,), generator=g).tolist()}
               for _ in range(args.num_seqs)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)  # warm-up
    logs = {"execute": [], "graph_forward": [], "eager_forward": [], "engine_step": []}
    timed_calls(llm.runner, "execute", logs["execute"])
    if llm.graphs is not None:
        timed_calls(llm.graphs, "forward", logs["graph_forward"])
    model_call = llm.runner.model

    class Timed:  # the runner calls self.model(batch, states) for eager forwards
        def __getattr__(self, name):
            return getattr(model_call, name)

        def __call__(self, *a, **k):
            began = time.perf_counter()
            try:
                return model_call(*a, **k)
            finally:
                logs["eager_forward"].append(time.perf_counter() - began)

    llm.runner.model = Timed()
    timed_calls(llm.engine, "step", logs["engine_step"])
    gaps_before = len(llm.engine.stats.host_gaps)
    began = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True),
                        use_tqdm=False)
    seconds = time.perf_counter() - began
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    gaps = llm.engine.stats.host_gaps[gaps_before:]
    ms = lambda xs: 1e3 * statistics.median(xs) if xs else None  # noqa: E731
    res = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
           "graphs": llm.graphs is not None, "seconds": seconds, "output_tok_s": tokens / seconds,
           "steps": len(logs["engine_step"]), "graph_forwards": len(logs["graph_forward"]),
           "eager_forwards": len(logs["eager_forward"]),
           "decode_tok_s": args.num_seqs / (statistics.median(logs["engine_step"]) or float("nan")),
           "median_ms": {k: ms(v) for k, v in logs.items()} | {"host_gap": ms(gaps)},
           "total_s": {k: sum(v) for k, v in logs.items()} | {"host_gaps": sum(gaps)}}
    print(json.dumps(res, indent=1))
    args.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
