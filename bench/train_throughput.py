"""Training throughput of the embedded model v2 (issue 24) under a few recipe choices, on random tokens: tokens
per second of `train_loop.step_losses` + backward + AdamW for each variant, so that the one 9-minute training run
uses the fastest that trains the same model.

    python bench/train_throughput.py [--device cuda] [--steps 12] [--variants sparse,dense,bf16,bf16_fused,...]

Variants: `sparse` the reference backend's per-expert MoE loop (a host sync per MoE site; the v2 attempt's path),
`dense` the sync-free MoE of `train_forward.moe`, `bf16` that under bf16 autocast, `bf16_fused` with the fused
AdamW, `bf16_fused_b2` with twice the sequences per step, `compile` bf16 + fused with the training step's
forward compiled by torch.compile (its compile time printed apart).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepserve.core.config import ModelConfig  # noqa: E402
from deepserve.tools import train_forward  # noqa: E402
from deepserve.tools.train_loop import build_trainable, param_groups, step_losses  # noqa: E402
from deepserve.tools.train_tiny import TINY_CONFIG  # noqa: E402
from deepserve.tools.train_v2 import V2_MODEL  # noqa: E402


def measure(name: str, device: str, steps: int, seq_len: int, seqs: int, dense_moe: bool, bf16: bool,
            fused: bool, compiled: bool) -> dict:
    cfg = ModelConfig.from_dict({**TINY_CONFIG, **V2_MODEL})
    counts = np.ones(cfg.vocab_size)
    model = build_trainable(cfg, device, counts, 0)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3, betas=(0.9, 0.95), fused=fused or None)
    rng = np.random.default_rng(0)
    original = train_forward.moe
    if not dense_moe:
        train_forward.moe = lambda mlp, x, ids: mlp(x, ids)
    fn = step_losses
    if compiled:
        fn = torch.compile(step_losses, dynamic=False)
    ctx = torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    times, first = [], None
    try:
        for step in range(steps):
            batch = [(rng.integers(2, cfg.vocab_size, seq_len + 1), np.ones(seq_len, dtype=bool)) for _ in range(seqs)]
            torch.cuda.synchronize()
            t = time.time()
            with ctx:
                losses = fn(model, batch, device, step % 2 == 0, 2, step)
                loss = losses["main"] + 0.3 * losses["mtp"] + 0.15 * losses["chain"] + 0.1 * losses.get("indexer", 0)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            torch.cuda.synchronize()
            dt = time.time() - t
            if step < 2:
                first = dt if first is None else first + dt
            else:
                times.append(dt)
    finally:
        train_forward.moe = original
    per = float(np.median(times))
    res = dict(variant=name, seq_len=seq_len, seqs=seqs, s_per_step=round(per, 4),
               tok_per_s=round(seqs * seq_len / per), first_two_s=round(first, 1),
               peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 1))
    print(res, flush=True)
    torch.cuda.reset_peak_memory_stats()
    del model, opt
    torch.cuda.empty_cache()
    return res


VARIANTS = {
    "sparse": dict(dense_moe=False, bf16=False, fused=False, compiled=False),
    "dense": dict(dense_moe=True, bf16=False, fused=False, compiled=False),
    "bf16": dict(dense_moe=True, bf16=True, fused=False, compiled=False),
    "bf16_fused": dict(dense_moe=True, bf16=True, fused=True, compiled=False),
    "bf16_fused_b2": dict(dense_moe=True, bf16=True, fused=True, compiled=False, scale=2),
    "compile": dict(dense_moe=True, bf16=True, fused=True, compiled=True),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--seqs", type=int, default=128)
    ap.add_argument("--variants", default="sparse,dense,bf16,bf16_fused,bf16_fused_b2,compile")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    for name in args.variants.split(","):
        v = dict(VARIANTS[name])
        scale = v.pop("scale", 1)
        try:
            measure(name, args.device, args.steps, args.seq_len, args.seqs * scale, **v)
        except Exception as exc:  # noqa: BLE001 - one variant's failure (OOM, a compile error) leaves the others
            print(dict(variant=name, error=repr(exc)[:400]), flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
