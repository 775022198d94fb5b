"""How many device operations a graphed decode step launches with the FP8 KV cache (`kv_cache_dtype="fp8"`): the
static forward of `DecodeGraphs` (the step a CUDA graph replays) over the demo checkpoint on the NVIDIA backend
under Triton's interpreter (CPU), its torch ops (each at least one kernel on a GPU) and Triton launches counted,
with the packed writes in one launch each, the fused compressor storing packed rows and no separate rounding of
a token's kv row before the pools encode it (`new`), and without them (`old`: `PackedKVOps.write_packed` off, the
fused compressor declining packed pools, the layouts' `rounds_on_store` false: the code before these changes).

    python bench/investigations/fp8_step_ops.py [--batch 4] [--out FILE]

Views, allocations and `to` are not counted as launches (`NO_KERNEL`); every other torch op is, once.

A CUDA graph removes the launches' host cost but not their device cost (a few microseconds each for these
small kernels on the H200), so fewer launches a step is fewer device microseconds a step. Counts only; the time
is for bench/stored_precision.py on a GPU.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


#: ops that launch no kernel (views, allocations) or need not (`to` a dtype the tensor has): left out of the count
NO_KERNEL = {"view", "_unsafe_view", "slice", "select", "reshape", "detach", "empty", "empty_like", "empty_strided",
             "new_empty", "transpose", "t", "unsqueeze", "squeeze", "flatten", "expand", "as_strided", "alias",
             "permute", "unbind", "split", "narrow", "to", "lift_fresh", "_reshape_alias"}


def measure_static_step(llm, batch: int) -> dict:
    """The torch ops and Triton launches of one decode step of `llm` (an NVIDIA-backend `LLM` built with
    `enforce_eager`, on the CPU under the interpreter) through `DecodeGraphs`' static forward (`capture=False`): the
    step a CUDA graph would replay, `batch` sequences of 40-token prompts, the last of three steps counted."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime.interpreter import InterpretedFunction

    from deepserve import SamplingParams
    from deepserve.model.cuda_graphs import DecodeGraphs

    graphs = DecodeGraphs(llm.model, llm.cache, batch, 4, capture=False)
    llm.runner.graphs = graphs
    prompts = [{"prompt_token_ids": [(37 * i + 11 * j) % 200 + 30 for i in range(40)]} for j in range(batch)]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    counts: collections.Counter = collections.Counter()
    kernels: collections.Counter = collections.Counter()  # Triton launches by kernel
    launches = [0]
    inside = [False]  # in a kernel: the interpreter's own tensor copies are not the step's ops

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not inside[0]:
                counts[str(func.overloadpacket.__name__)] += 1
            return func(*args, **(kwargs or {}))

    run = InterpretedFunction.run

    def counted(self, *args, **kwargs):
        launches[0] += 1
        kernels[getattr(self.fn, "__name__", "?")] += 1
        inside[0] = True
        try:
            return run(self, *args, **kwargs)
        finally:
            inside[0] = False

    forward, steps = graphs.model, []

    class Measured:  # the static forward, its ops and launches counted
        backend, main_state_owner, state_owners = forward.backend, forward.main_state_owner, forward.state_owners

        def __call__(self, *args, **kwargs):
            counts.clear()
            kernels.clear()
            launches[0] = 0
            InterpretedFunction.run = counted
            try:
                with Ops():
                    out = forward(*args, **kwargs)
            finally:
                InterpretedFunction.run = run
            steps.append({"torch_ops": sum(counts.values()), "triton_launches": launches[0], "ops": dict(counts),
                          "kernels": dict(kernels),
                          "kernel_ops": sum(n for op, n in counts.items() if op not in NO_KERNEL)})
            return out

    graphs.model = Measured()
    llm.generate(prompts, params, use_tqdm=False)
    if not steps:
        raise RuntimeError("no decode step went through the static forward")
    return {**steps[-1], "layers": llm.model.cfg.num_hidden_layers, "layer_types": list(llm.model.cfg.layer_types)}


def count_step(checkpoint: Path, batch: int, new: bool) -> dict:
    from deepserve import LLM
    from deepserve.backends.nvidia import NvidiaBackend
    from deepserve.backends.nvidia.packed_kv import PackedKVOps
    from deepserve.model.layouts.paged import PagedLayer
    from deepserve.model.layouts.static import StaticLayer

    PackedKVOps.write_packed = new
    fused = NvidiaBackend.compress_decode
    if not new:  # the fused compressor declines packed pools, as before it could store them
        NvidiaBackend.compress_decode = lambda self, *a, codec=None, turn=None: False if codec is not None \
            else fused(self, *a)
    rounds = {cls: cls.rounds_on_store for cls in (PagedLayer, StaticLayer) if hasattr(cls, "rounds_on_store")}
    if not new:  # the forward rounds each kv row before the pools encode it, as before
        for cls in rounds:
            cls.rounds_on_store = lambda self: False
    try:
        llm = LLM(model=str(checkpoint), accelerator="nvidia", device="cpu", dtype="bfloat16", kv_cache_dtype="fp8",
                  enforce_eager=True, block_size=128, max_num_seqs=batch)
        return measure_static_step(llm, batch)
    finally:
        PackedKVOps.write_packed = True
        NvidiaBackend.compress_decode = fused
        for cls, method in rounds.items():
            cls.rounds_on_store = method


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from deepserve.backends.nvidia.interpreted import support_kernels
    from deepserve.tools.demo_checkpoint import build_demo_checkpoint

    support_kernels()
    checkpoint = build_demo_checkpoint(Path(tempfile.mkdtemp()) / "demo")
    res = {name: count_step(checkpoint, args.batch, new) for name, new in (("old", False), ("new", True))}
    for name, r in res.items():
        print(f"{name}: {r['kernel_ops']} torch ops that launch a kernel (of {r['torch_ops']} dispatched) + "
              f"{r['triton_launches']} Triton launches a decode step (batch {args.batch}, {r['layers']} layers)")
    total = {k: r["kernel_ops"] + r["triton_launches"] for k, r in res.items()}
    print(f"launches a step: {total['old']} -> {total['new']} ({total['old'] / total['new']:.2f}x fewer)")
    if args.out:
        args.out.write_text(json.dumps({"batch": args.batch, **res}, indent=1))


if __name__ == "__main__":
    main()
