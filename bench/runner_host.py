"""Host milliseconds of a decode step through `LLM.generate`, the model runner included, with the device's work
taken out: can the engine and the runner together keep a GPU busy?

    python bench/runner_host.py [--batches 1,64,256] [--steps 60] [--generated 0,1000] [--layers 43] [--out FILE]
    python bench/runner_host.py --baseline /tmp/old --repeats 3 ...   # an older tree's package too, alternately

bench/engine_host.py times `EngineCore.step()` over an executor that returns its samples at once, so it leaves out
the runner's thread: resolving each chunk's state, building the batch, filling the placeholders from the last
step's samples, the decode graph's inputs, sampling, the read-back. Here the real `ModelRunner` runs, over the
demo checkpoint (a tiny V4 of vocabulary 258) in a paged cache, with its decode steps taken by `DecodeGraphs`
(`capture=False`) whose static forward is replaced by a stand-in that returns logits of the right shape at once
(greedy: one byte's id highest in every row). So a step's wall time is the host's work on both threads
(the engine's, the runner's; they share one GIL), with asynchronous scheduling as `LLM` runs it, and the small
vocabulary keeps sampling's arithmetic negligible, as it is on a GPU. Requests are `LLM.generate`'s (final
outputs only; no stop strings), greedy, `ignore_eos`. Reports the median step over the timed decode steps, after
`--generated` tokens of each request. `-k K`: speculative steps instead, K drafts a sequence from a drafter that
costs nothing on the device and whose drafts are all kept, verified through `VerifyGraphs` (`capture=False`, the
same stand-in forward, the rollback's ops stood in for as well: on a GPU both are graph replays) with its
batched rollback: the host's share of a speculative step.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # after PYTHONPATH: `PYTHONPATH=/tmp/old` measures that tree's package
sys.path.append(str(ROOT / "bench"))

from engine_host import child_result  # noqa: E402  (the child-process runner both host benchmarks use)


TOKEN = 100  # the id every stand-in logits row picks (a byte's: text every token) and every draft proposes


def measure(batch: int, steps: int, generated: int, checkpoint: Path, k: int = 0, device_ms: float = 0.0) -> float:
    """Median milliseconds of `EngineCore.step()` over `steps` decode steps of `batch` requests, each having
    generated `generated` tokens before. `k`: speculative steps of k drafts instead (every draft kept: the
    drafter proposes the id the stand-in picks), verified by `VerifyGraphs` with its batched rollback.
    `device_ms`: an asynchronous device of that step time stood in for (`emulate_device`)."""
    import torch

    from deepserve import LLM, SamplingParams
    from deepserve.model.cuda_graphs import DecodeGraphs
    from deepserve.model.deepseek_v4 import ForwardOutput
    from deepserve.model.verify_graphs import VerifyGraphs

    torch.set_num_threads(1)
    total = generated + (steps + 2) * (k + 1)
    pages = -(-(16 + total + 16) // 128)
    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    llm = LLM(str(checkpoint), dtype="float32", max_num_seqs=batch, block_size=128, max_model_len=pages * 128,
              load_plugins=False, enable_prefix_caching=False, speculative_config=spec)
    if k:
        llm.runner.proposer = Drafter(k)
        graphs = llm.runner.verify_graphs = VerifyGraphs(llm.model, llm.cache, batch, pages, k + 1, capture=False)
    else:
        graphs = llm.runner.graphs = DecodeGraphs(llm.model, llm.cache, batch, pages, capture=False)
    model, vocab = graphs.model, llm.model.cfg.vocab_size
    logits = torch.zeros(batch * (k + 1), vocab)
    logits[:, TOKEN] = 1.0

    class Instant:  # the static forward's stand-in: the graph's outputs at once
        backend, main_state_owner = model.backend, model.main_state_owner
        state_owners = model.state_owners

        def __call__(self, fb, layout=None):
            n = fb.token_ids.shape[0]
            if k and not layout.frontiers:  # what a verify pass leaves for the rollback: each stream's frontier
                for layer, name, _ in graphs._streams:
                    kv = getattr(llm.cache.layers[layer], name).open_kv
                    shape = (n // (k + 1), kv.shape[1] + k, kv.shape[2])
                    layout.frontiers[(layer, name)] = (torch.zeros(shape), torch.zeros(shape))
            return ForwardOutput(streams=logits[:n, None, :1], logits=logits[:n])

    graphs.model = Instant()
    if k:  # the pass's saves and the rollback are its graphs' replays on a GPU: device work, stood in for too
        graphs._pass = lambda bucket: graphs.model(bucket.batch, layout=bucket.layout)
        graphs._rollback = lambda bucket: None
    prompts = [{"prompt_token_ids": [2 + i % 250, 3, 4, 5, 6, 7, 8, 9]} for i in range(batch)]
    times: list[float] = []
    step = llm.engine.step

    def timed():
        began = time.perf_counter()
        out = step()
        times.append(time.perf_counter() - began)
        return out

    llm.engine.step = timed
    with emulate_device(device_ms) if device_ms else contextlib.nullcontext():
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=total, ignore_eos=True), use_tqdm=False)
    if k and graphs.steps < steps:
        raise RuntimeError(f"only {graphs.steps} verify steps went through the verify graphs")
    # the steps after `generated` tokens (the first step or two hold the prompts), short of the last two
    decode = times[-(steps + 2) : -2]
    return 1e3 * statistics.median(decode)


@contextlib.contextmanager
def emulate_device(ms: float):
    """A device that takes `ms` for each step the runner launches, in launch order, while the host goes on: a step
    starts when launched or when the device finishes the one before, whichever is later, and its samples reach the
    host when it ends (the runner's deferred read-back, `runner._read_back_later`, waits until then). With the host's
    work overlapping the device's, a step then takes max(host, ms); with it serialized, host + ms. The runner's own
    read-back comes back when the block ends (a later `measure` in the process wraps the original, not this)."""
    from deepserve.model import runner

    launch, busy_until = runner._read_back_later, [0.0]

    def read_back_later(out, tokens, request_ids, clock):
        done = max(time.perf_counter(), busy_until[0]) + ms / 1e3
        busy_until[0] = done
        finish = launch(out, tokens, request_ids, clock)

        def read_back() -> None:
            wait = done - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            finish()

        return read_back

    runner._read_back_later = read_back_later
    try:
        yield
    finally:
        runner._read_back_later = launch


class Drafter:
    """A proposer of k drafts of `TOKEN` for every drafting sequence, at once (no device work)."""

    state_owners = ()
    planner = None

    def __init__(self, k: int) -> None:
        self.num_speculative_tokens = k

    def capture_graphs(self, *args, **kwargs) -> int:
        return 0

    def propose(self, streams, chunks, sampling):
        import torch

        from deepserve.model.speculative import Drafts

        n = sum(1 for c in chunks if c.num_drafts)
        return Drafts(torch.full((n, self.num_speculative_tokens), TOKEN, dtype=torch.long), None) if n else None


def depth(layers: int) -> dict:
    """The demo checkpoint's overrides for `layers` layers (none for 0): two window-only, then CSA / HCA."""
    if not layers:
        return {}
    kinds = ["sliding_attention"] * 2 + [("compressed_sparse_attention", "heavily_compressed_attention")[i % 2]
                                         for i in range(layers - 2)]
    return {"num_hidden_layers": layers, "layer_types": kinds[:layers]}


def compare(args) -> dict:
    """Each case `repeats` times with the baseline package and with this one, alternately, in child processes;
    the fastest of each, and their ratio."""
    trees = {"baseline": str(args.baseline.resolve()), "current": ""}
    res = {"python": sys.version.split()[0], "steps": args.steps, "repeats": args.repeats,
           "layers": args.layers or 6, "baseline": trees["baseline"], "ms_per_step": {}}
    for gen, b in itertools.product(args.generated.split(","), args.batches.split(",")):
        runs: dict[str, list[float]] = {"baseline": [], "current": []}
        for _ in range(args.repeats):
            for name, tree in trees.items():
                res_child = child_result(__file__, ["--batches", b, "--generated", gen, "--steps", str(args.steps),
                                                    "-k", str(args.k), "--layers", str(args.layers)], tree)
                runs[name].append(next(iter(res_child["ms_per_step"].values()))["ms"])
        old, new = min(runs["baseline"]), min(runs["current"])
        res["ms_per_step"][f"{b}+{gen}"] = {"batch": int(b), "generated": int(gen), "baseline": old, "current": new,
                                           "speedup": old / new, "runs": runs}
        print(f"batch {int(b):4d}, {int(gen):5d} generated: {old:.3f} -> {new:.3f} ms a step ({old / new:.2f}x)",
              flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--generated", default="0", help="tokens decoded before the timed steps, comma-separated")
    ap.add_argument("-k", type=int, default=0, help="speculative steps of k drafts, every one kept (0: decode)")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each case (the fastest counts)")
    ap.add_argument("--layers", type=int, default=0,
                    help="layers of the checkpoint (0: the demo's 6); N > 0: two window-only layers, then CSA and "
                         "HCA alternating (V4-Flash has 43), for the host work that grows with depth")
    ap.add_argument("--baseline", type=Path, default=None,
                    help="a tree holding the old package (`git archive REV deepserve | tar -x -C DIR`), measured "
                         "alternately with this one in child processes")
    ap.add_argument("--device-ms", type=float, default=0.0,
                    help="stand in an asynchronous device of this step time (e.g. the H100's 6.73 ms graph step at "
                         "256): does the host's work overlap it?")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.baseline is not None:
        res = compare(args)
    else:
        import deepserve
        from deepserve.tools.demo_checkpoint import build_demo_checkpoint

        res = {"python": sys.version.split()[0], "package": str(Path(deepserve.__file__).parent),
               "steps": args.steps, "layers": args.layers or 6, "ms_per_step": {}}
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = build_demo_checkpoint(Path(tmp) / "demo", seed=2, **depth(args.layers))
            for gen, b in itertools.product(map(int, args.generated.split(",")), map(int, args.batches.split(","))):
                ms = min(measure(b, args.steps, gen, checkpoint, args.k, args.device_ms) for _ in range(args.repeats))
                res["ms_per_step"][f"{b}+{gen}"] = {"batch": b, "generated": gen, "k": args.k, "ms": ms}
                print(f"batch {b:4d}, {gen:5d} generated, k {args.k}: {ms:.3f} ms a step ({1e3 * ms / b:.1f} us a "
                      f"request)", flush=True)
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
