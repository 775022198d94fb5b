"""Where a training step of the embedded model v2 spends its time (issue 24): the v2 model and step of
deepserve/tools/train_v2.py on random tokens, timed at several batch sizes (seconds per step and tokens per second:
a step bound by the host's launches takes about as long at twice the tokens), and one step under torch.profiler
(the kernels with the most GPU time, and GPU busy time against the step's wall time).

    python3 bench/investigations/train_profile.py [--tokens 65536,131072,262144] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from deepserve.core.config import ModelConfig  # noqa: E402
from deepserve.tools.train_loop import TrainConfig, build_trainable, param_groups, step_losses  # noqa: E402
from deepserve.tools.train_tiny import TINY_CONFIG  # noqa: E402
from deepserve.tools.train_v2 import SMOKE_MODEL, V2_MODEL, V2_TRAIN  # noqa: E402


def one_step(model, opt, seqs, device, dense, cfg, autocast):
    with autocast():
        losses = step_losses(model, seqs, device, dense, cfg.mtp_stride, 0)
        loss = losses["main"] + cfg.mtp_weight * losses["mtp"] + cfg.chain_weight * losses["chain"] \
            + cfg.indexer_weight * losses.get("indexer", 0)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="65536,131072,262144", help="tokens per step to time")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="the smoke model on the CPU (a check of this script)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    device = "cuda" if cuda else "cpu"
    over = SMOKE_MODEL if args.smoke else V2_MODEL
    mcfg = ModelConfig.from_dict({**TINY_CONFIG, **over})
    cfg = TrainConfig(**{**V2_TRAIN, "seq_len": 128 if args.smoke else V2_TRAIN["seq_len"]})
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    model = build_trainable(mcfg, device, np.ones(mcfg.vocab_size), 0)
    opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=1e-4, fused=True if cuda else None)

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda)

    rng = np.random.default_rng(0)

    def batch(tokens):
        n = max(1, tokens // cfg.seq_len)
        return [(rng.integers(2, mcfg.vocab_size, cfg.seq_len + 1), np.ones(cfg.seq_len, np.float32))
                for _ in range(n)]

    def sync():
        if cuda:
            torch.cuda.synchronize()

    rows = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        for dense in (True, False):
            seqs = batch(tokens)
            try:
                for _ in range(2):
                    one_step(model, opt, seqs, device, dense, cfg, autocast)
                sync()
                t = time.perf_counter()
                for _ in range(args.steps):
                    one_step(model, opt, seqs, device, dense, cfg, autocast)
                sync()
                dt = (time.perf_counter() - t) / args.steps
            except torch.OutOfMemoryError:
                print(f"tokens {tokens} dense {dense}: out of memory")
                torch.cuda.empty_cache()
                continue
            row = dict(tokens=tokens, dense=dense, s_per_step=round(dt, 4), tok_per_s=round(tokens / dt),
                       peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 1) if cuda else None)
            rows.append(row)
            print(json.dumps(row), flush=True)

    from torch.profiler import ProfilerActivity, profile

    seqs = batch(int(args.tokens.split(",")[0]))
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync()
    t = time.perf_counter()
    with profile(activities=acts) as prof:
        one_step(model, opt, seqs, device, False, cfg, autocast)
        sync()
    wall = time.perf_counter() - t
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=25)
    print(table)
    events = prof.key_averages()
    busy = sum(e.self_device_time_total for e in events) / 1e6 if cuda else None
    launches = sum(e.count for e in events if e.key.startswith(("cudaLaunchKernel", "cuLaunchKernel")))
    summary = dict(rows=rows, profiled_wall_s=round(wall, 4), gpu_busy_s=busy, kernel_launches=launches)
    print(json.dumps(summary))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "train_profile.json").write_text(json.dumps(dict(summary, table=table), indent=1))


if __name__ == "__main__":
    main()
