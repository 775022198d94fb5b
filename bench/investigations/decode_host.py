"""Host cost of a decode step on the CPU: the batched zero-copy paged path against the forced general path.

    OMP_NUM_THREADS=1 python bench/investigations/decode_host.py [--batches 1 16 64] [--steps 8] [--chunk 1] [--out FILE.json]

The demo model (random tiny V4: window 16, CSA ratio 4 with an indexer, HCA ratio 16, layers SW SW CSA HCA CSA
HCA) over a paged cache; every sequence prefilled to a random context of 100-400 tokens (so blocks close on
different steps, as in serving), then decode steps of one token per sequence (`--chunk N`: N tokens each, the shape of a speculative verify step,
or of prompt chunks for N past the window). Two identical caches: one decodes
with `layouts.PAGED` on, the other with it off; their logits are checked equal every step.

Per decode step it reports
- ops: aten ops dispatched by the whole forward (on a GPU each is about one kernel launch; the reference
  backend's own loops, e.g. its MoE over experts, are counted too),
- state ops: aten ops inside the attention layers minus the backend's attention and indexer kernels (the state
  handling this path batches: key pools, ring writes, compressor frontiers, row appends, indexer keys),
- own ops: the state ops minus every other backend call too (projections, norms, RoPE): the ops the model's
  Python issues itself for the state handling,
- host ms: wall time of the forward (median over the steps; on the CPU this includes the arithmetic, small for
  this model).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from deepserve.backends.reference import ReferenceBackend  # noqa: E402
from deepserve.core.config import ModelConfig  # noqa: E402
from deepserve.model import layouts as layouts_mod  # noqa: E402
from deepserve.model.attention import Attention  # noqa: E402
from deepserve.model.batch import make_batch  # noqa: E402
from deepserve.model.factory import build_model, randomize  # noqa: E402
from deepserve.model.kv_cache import PagedKVCache  # noqa: E402
from deepserve.tools.demo_checkpoint import DEMO_CONFIG  # noqa: E402

PAGE = 64


class Ops(TorchDispatchMode):
    """Counts every aten op (`total`), those inside attention layers outside the backend's attention and indexer
    kernels (`state`), and those inside attention layers outside any backend call (`own`)."""

    def __init__(self, model):
        super().__init__()
        self.total, self.state, self.own, self.inside, self.in_backend = Counter(), Counter(), Counter(), False, 0
        self.hooks = []
        for m in model.modules():
            if isinstance(m, Attention):
                self.hooks.append(m.register_forward_pre_hook(lambda *_: setattr(self, "inside", True)))
                self.hooks.append(m.register_forward_hook(lambda *_: setattr(self, "inside", False)))
        backend = model.backend
        names = [n for n in dir(type(backend)) if not n.startswith("_") and callable(getattr(backend, n))]
        self.patched = {name: getattr(backend, name) for name in names}
        for name, fn in self.patched.items():
            setattr(backend, name, self._wrap(fn, name in ("sparse_attention", "indexer_topk")))
        self.backend = backend

    def _wrap(self, fn, kernel: bool):
        def call(*a, **k):
            inside, self.in_backend = self.inside, self.in_backend + 1
            if kernel:
                self.inside = False
            try:
                return fn(*a, **k)
            finally:
                self.inside, self.in_backend = inside, self.in_backend - 1
        return call

    def close(self):
        for h in self.hooks:
            h.remove()
        for name in self.patched:
            delattr(self.backend, name)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.total[func] += 1
        if self.inside:
            self.state[func] += 1
            if not self.in_backend:
                self.own[func] += 1
        return func(*args, **(kwargs or {}))


def setup(model, batch_size, seed, extra_tokens=64, step_tokens=16):
    """Two caches holding the same `batch_size` prefilled sequences, with pages for `extra_tokens` more each and a
    scratch region for `step_tokens` new tokens per sequence; returns (states per cache, rng)."""
    rng = random.Random(seed)
    pages_each = (400 + extra_tokens) // PAGE + 2
    caches = [PagedKVCache(model, batch_size * pages_each, PAGE, batch_size,
                           max_step_tokens=batch_size * max(step_tokens, 16)) for _ in range(2)]
    tables = [list(range(i * pages_each, (i + 1) * pages_each)) for i in range(batch_size)]
    prompts = [[rng.randrange(2, 258) for _ in range(rng.randint(100, 400))] for _ in range(batch_size)]
    states = []
    for cache in caches:
        sts = [cache.new_sequence(t)[0] for t in tables]
        for st, prompt in zip(sts, prompts):
            model(make_batch([prompt], [0], "cpu"), [st])
        states.append(sts)
    return states, rng


def decode(model, states, token_lists, fast):
    layouts_mod.PAGED = fast
    try:
        batch = make_batch(token_lists, [s.num_tokens for s in states], "cpu")
        return model(batch, states).logits
    finally:
        layouts_mod.PAGED = True


@torch.inference_mode()
def run(batches, steps, chunk=1, seed=0):
    torch.set_num_threads(1)
    cfg = ModelConfig.from_dict({**DEMO_CONFIG, "vocab_size": 512})
    model = randomize(build_model(cfg, ReferenceBackend("cpu"), torch.float32), seed)
    rows = []
    for bs in batches:
        (fast_states, slow_states), rng = setup(model, bs, seed + bs, chunk * (steps + 1), chunk)
        result = {"batch": bs, "chunk": chunk}
        times = {True: [], False: []}
        for step in range(steps + 1):
            tokens = [[rng.randrange(2, 258) for _ in range(chunk)] for _ in range(bs)]
            logits = {}
            for fast, sts in ((True, fast_states), (False, slow_states)):
                if step == 0:  # the counted step (the dispatch mode slows it, so it is not timed)
                    ops = Ops(model)
                    with ops:
                        logits[fast] = decode(model, sts, tokens, fast)
                    ops.close()
                    key = "fast" if fast else "general"
                    result[f"{key}_ops"] = sum(ops.total.values())
                    result[f"{key}_state_ops"] = sum(ops.state.values())
                    result[f"{key}_own_ops"] = sum(ops.own.values())
                else:
                    t0 = time.perf_counter()
                    logits[fast] = decode(model, sts, tokens, fast)
                    times[fast].append((time.perf_counter() - t0) * 1e3)
            if not torch.equal(logits[True], logits[False]):
                raise AssertionError(f"batch {bs} step {step}: the fast path's logits differ")
        result["fast_ms"] = statistics.median(times[True])
        result["general_ms"] = statistics.median(times[False])
        rows.append(result)
        print(json.dumps(result), flush=True)
    return rows


def table(rows) -> str:
    out = ["| batch | ops / step, general -> fast | state ops / step, general -> fast | own ops / step, general -> fast "
           "| host ms / step, general -> fast |",
           "| --- | --- | --- | --- | --- |"]
    for r in rows:
        out.append(f"| {r['batch']} | {r['general_ops']:,} -> **{r['fast_ops']:,}** | "
                   f"{r['general_state_ops']:,} -> **{r['fast_state_ops']:,}** | "
                   f"{r['general_own_ops']:,} -> **{r['fast_own_ops']:,}** | "
                   f"{r['general_ms']:.1f} -> **{r['fast_ms']:.1f}** |")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=1)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if os.environ.get("OMP_NUM_THREADS") != "1":
        print("note: run with OMP_NUM_THREADS=1 for comparable numbers", file=sys.stderr)
    rows = run(args.batches, args.steps, args.chunk)
    print(table(rows))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
