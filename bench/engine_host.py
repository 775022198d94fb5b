"""The engine's own host time per decode step, without a model: can it keep up with the GPU?

    python bench/engine_host.py [--batches 1,16,64,256] [--steps 200] [--out FILE]
    PYTHONPATH=/tmp/old python bench/engine_host.py ...   # another tree's package
    python bench/engine_host.py --baseline /tmp/old --repeats 3 ...   # both, case by case, alternately

`EngineCore` (scheduler, KV manager, detokenizer, stop strings, outputs) drives an executor that returns every
step's samples at once (random ids over the embedded model's tokenizer). So each `step()` is pure host work: plan
the step, build its input, apply the previous step's samples, detokenize, check stops, make the outputs. With
asynchronous scheduling that work overlaps the device's step, so the engine keeps a GPU busy only while it is
shorter than the device's step (the H200 decode graph: 1.55 ms at batch 1, 3.86 ms at 64, 5.85 ms at 256 in
run 39; docs/benchmarks.md). Prints and writes the median milliseconds per step at each batch size, prompt length
and output length so far: greedy requests streamed (a snapshot of each every step), the same with snapshots holding
views of the output (`views=True`, as the server streams), with stop strings, and with only final outputs
(`LLM.generate`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # after PYTHONPATH: `PYTHONPATH=/tmp/old` measures that tree's package

from deepserve.core.config import ModelConfig  # noqa: E402
from deepserve.core.engine import EngineCore  # noqa: E402
from deepserve.core.interfaces import ModelExecutor, StepInput, StepOutput  # noqa: E402
from deepserve.core.kv.manager import KVCacheManager  # noqa: E402
from deepserve.core.sampling_params import SamplingParams  # noqa: E402
from deepserve.core.scheduler.cost_model import CostModelConfig, StepCostModel  # noqa: E402
from deepserve.core.scheduler.scheduler import Scheduler  # noqa: E402
from deepserve.model.tokenizer import IncrementalDetokenizer, Tokenizer  # noqa: E402

MODEL = ROOT / "deepserve" / "assets" / "deepserve-tiny-v4"
PAGE = 128


class InstantExecutor(ModelExecutor):
    """Samples a random id for every sampling chunk, at once (ids above 255: the byte tokenizer's words)."""

    def __init__(self, vocab: int, slots: int, seed: int = 0) -> None:
        self.rng, self.vocab, self.slots = random.Random(seed), vocab, slots

    @property
    def num_free_slots(self) -> int:
        return self.slots

    @property
    def num_active_sequences(self) -> int:
        return 0

    def execute(self, step: StepInput) -> StepOutput:
        return StepOutput(sampled={c.request_id: self.rng.randrange(256, self.vocab) for c in step.chunks if c.samples})


def measure(batch: int, steps: int, stop: list[str] | None, tokenizer, cfg, prompt_len: int = 64,
            generated: int = 0, final_only: bool = False, views: bool = False) -> float:
    """Median host milliseconds of `EngineCore.step()` with `batch` requests of `prompt_len`-token prompts
    decoding, from `generated` tokens into their outputs on; a snapshot of every request each step (streaming;
    `views`: snapshots holding views of the output, as the server streams) or, `final_only`, outputs only at the
    end (`LLM.generate`)."""
    max_len = prompt_len + generated + 4096  # room for the tokens early requests decode while later ones prefill
    kv = KVCacheManager(batch * -(-max_len // PAGE) + 8, PAGE, True)
    scheduler = Scheduler(kv, StepCostModel(CostModelConfig()), batch, 8192, max_len, cfg.eos_token_ids)
    engine = EngineCore(scheduler, InstantExecutor(cfg.vocab_size, batch), page_size=PAGE,
                        make_detokenizer=lambda ids, skip: IncrementalDetokenizer(tokenizer, ids, skip))
    params = SamplingParams(temperature=0, max_tokens=generated + 4000, ignore_eos=True, stop=stop)
    rng = random.Random(1)
    for i in range(batch):
        engine.add_request(str(i), [rng.randrange(256, cfg.vocab_size) for _ in range(prompt_len)], params,
                           final_only=final_only, views=views)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # the prompts' steps, until every request has sampled
    for _ in range(generated + 1):
        engine.step()
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        outputs = engine.step()
        times.append(time.perf_counter() - began)
        if len(engine.scheduler.running) != batch or len(outputs) != (0 if final_only else batch):
            raise RuntimeError(f"batch {batch}: {len(outputs)} outputs in a step, some finished: not a steady decode")
    engine.shutdown()
    return 1e3 * statistics.median(times)


def child_result(script: str, argv: list[str], tree: str) -> dict:
    """Run `script argv --out FILE` in a child process with the package of `tree` (`PYTHONPATH`; "" for this
    tree's own) and return the JSON it wrote."""
    import os
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        env = {**os.environ, "PYTHONPATH": tree} if tree else {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        subprocess.run([sys.executable, script, *argv, "--out", f.name], env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return json.loads(Path(f.name).read_text())


def compare(args) -> None:
    """Each case `repeats` times with the baseline package and with this one, alternately (so a burst of load
    elsewhere hits both alike); the fastest of each, and their ratio."""
    trees = {"baseline": str(args.baseline.resolve()), "current": ""}
    res = {"python": sys.version.split()[0], "steps": args.steps, "repeats": args.repeats, "baseline": trees["baseline"],
           "ms_per_step": {}}
    for n, gen, b in itertools.product(args.prompt_lens.split(","), args.generated.split(","), args.batches.split(",")):
        runs: dict[str, list[dict]] = {"baseline": [], "current": []}
        for _ in range(args.repeats):
            for name, tree in trees.items():
                res_child = child_result(__file__, ["--batches", b, "--prompt-lens", n, "--generated", gen, "--steps",
                                                    str(args.steps)], tree)
                runs[name].append(next(iter(res_child["ms_per_step"].values())))
        row = {"batch": int(b), "prompt_len": int(n), "generated": int(gen)}
        for mode in ("streaming", "streaming_views", "stop_strings", "final_only"):
            old, new = (min(r[mode] for r in runs[name]) for name in ("baseline", "current"))
            row[mode] = {"baseline": old, "current": new, "speedup": old / new}
        res["ms_per_step"][f"{b}x{n}+{gen}"] = row
        print(f"batch {int(b):4d}, prompts of {int(n):5d}, {int(gen):5d} generated: " + ", ".join(
            f"{mode} {row[mode]['baseline']:.3f} -> {row[mode]['current']:.3f} ms"
            for mode in ("streaming", "streaming_views", "stop_strings", "final_only")), flush=True)
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--prompt-lens", default="64,4096")
    ap.add_argument("--generated", default="0", help="tokens decoded before the timed steps, comma-separated")
    ap.add_argument("--repeats", type=int, default=1,
                    help="measure each case this many times and keep the fastest (a shared machine's bursts of load)")
    ap.add_argument("--baseline", type=Path, default=None,
                    help="a tree holding the old package (`git archive HEAD deepserve | tar -x -C DIR`): every case "
                         "is measured with it and with this one, alternately, in child processes")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.baseline is not None:
        return compare(args)
    cfg = ModelConfig.from_dict(json.loads((MODEL / "config.json").read_text()))
    tokenizer = Tokenizer(MODEL, cfg)
    import deepserve

    res = {"python": sys.version.split()[0], "package": str(Path(deepserve.__file__).parent), "steps": args.steps,
           "repeats": args.repeats, "ms_per_step": {}}
    for n, gen, b in itertools.product(map(int, args.prompt_lens.split(",")), map(int, args.generated.split(",")),
                                       map(int, args.batches.split(","))):
        def best(**kw) -> float:
            return min(measure(b, args.steps, tokenizer=tokenizer, cfg=cfg, prompt_len=n, generated=gen, **kw)
                       for _ in range(args.repeats))

        plain = best(stop=None)
        stops = best(stop=["<|no such text|>", "\x00END\x00"])  # never met
        final = best(stop=None, final_only=True)
        views = best(stop=None, views=True)
        res["ms_per_step"][f"{b}x{n}+{gen}"] = {"batch": b, "prompt_len": n, "generated": gen, "streaming": plain,
                                                 "stop_strings": stops, "final_only": final, "streaming_views": views}
        print(f"batch {b:4d}, prompts of {n:5d}, {gen:5d} generated: streaming {plain:7.3f} ms a step "
              f"({1e3 * plain / b:5.1f} us a request), as views {views:7.3f}, with stop strings {stops:7.3f}, "
              f"final only {final:7.3f}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
