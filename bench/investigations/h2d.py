"""How the model's small host-to-device copies should be made: `batch.to_device` three ways, on the GPU.

    python bench/investigations/h2d.py [--out DIR]

A forward sends a few dozen small index lists to the device (token ids, positions, block tables, the
compressor's block lists). Four ways to send one, each measured while the device is busy with earlier work
(as it is when the host runs a step ahead):
  pinned:   the list in pinned memory, copied asynchronously (the CPU tensor pinned per call),
  pageable: the list in ordinary memory, copied with non_blocking=True (the driver stages a small copy at once
            and does not wait for the stream),
  blocking: `torch.tensor(list, device=cuda)`, which waits for the stream to drain first,
  adaptive: blocking when the stream is idle (nothing to wait for), else pageable (`batch.to_device`).
Then the benchmark model's prefill of 1K and 8K tokens and a batch-1 eager decode step with `to_device`
switched to each way (the copy cost is measured both with the device busy and idle). Writes h2d.json into --out
($OUT when set).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.gpu import V4_FLASH_LAYER, build, decode_steps, prefill_states, sync  # noqa: E402
from deepserve.model import attention, batch, compressor, cuda_graphs, kv_cache, runner  # noqa: E402

USERS = (attention, batch, compressor, cuda_graphs, kv_cache, runner)  # every module that calls to_device


def pinned(values, dtype, device):
    return torch.as_tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)


def pageable(values, dtype, device):
    return torch.as_tensor(values, dtype=dtype).to(device, non_blocking=True)


def blocking(values, dtype, device):
    return torch.as_tensor(values, dtype=dtype).to(device)


WAYS = {"pinned": pinned, "pageable": pageable, "blocking": blocking, "adaptive": batch.to_device}  # the last: ours


def use(way) -> None:
    for module in USERS:
        module.to_device = way


def copy_cost(device) -> dict:
    """Host microseconds per call of each way (a 256-entry list), with a 20 ms matmul queued ahead (busy) and
    with nothing queued (idle)."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    values = list(range(256))
    out = {}
    for name, way in WAYS.items():
        for _ in range(50):
            way(values, torch.long, device)
        for state in ("busy", "idle"):
            sync(device)
            if state == "busy":
                for _ in range(40):
                    a @ a  # ~20 ms of queued work
            began = time.perf_counter()
            for _ in range(200):
                way(values, torch.long, device)
            out[f"{name} {state}"] = 1e6 * (time.perf_counter() - began) / 200
            sync(device)
        print(f"  {name:<9} {out[name + ' busy']:8.1f} us a copy (device busy), {out[name + ' idle']:8.1f} (idle)",
              flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_out")))
    args = ap.parse_args()
    device = "cuda:0"
    from deepserve.backends.nvidia import NvidiaBackend

    res = {"device": torch.cuda.get_device_name(0), "copy_us": copy_cost(device)}
    model = build(V4_FLASH_LAYER, NvidiaBackend(device), torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    vocab = model.cfg.vocab_size
    res["prefill_ms"], res["decode_b1_eager_ms"] = {}, {}
    for name, way in WAYS.items():
        use(way)
        for n in (1024, 8192):
            prompt = torch.randint(2, vocab, (n,), generator=g).tolist()
            times = []
            for _ in range(4):
                sync(device)
                began = time.perf_counter()
                states, cache = prefill_states(model, device, [prompt], group=1, extra_tokens=16)
                sync(device)
                times.append(time.perf_counter() - began)
                del states, cache
            res["prefill_ms"].setdefault(name, {})[n] = 1e3 * sorted(times)[len(times) // 2]
        states, cache = prefill_states(model, device, [prompt[:512]], group=1, extra_tokens=16)
        toks = torch.randint(2, vocab, (10, 1), generator=g).tolist()
        decode_steps(model, device, states, toks[:2], 512)
        res["decode_b1_eager_ms"][name] = 1e3 * decode_steps(model, device, states, toks[2:], 514)
        del states, cache
        print(f"  {name:<9} prefill 1K {res['prefill_ms'][name][1024]:7.2f} ms, 8K {res['prefill_ms'][name][8192]:7.2f}"
              f" ms; eager batch-1 decode {res['decode_b1_eager_ms'][name]:6.2f} ms", flush=True)
    use(WAYS["adaptive"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "h2d.json").write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
