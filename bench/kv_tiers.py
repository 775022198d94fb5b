"""The KV cache tiers on a multi-turn agent trace: time to first token and prefill tokens computed, per tier setup.

    .venv/bin/python bench/kv_tiers.py                  # CPU, the embedded model; writes the JSON and the plot
    .venv/bin/python bench/kv_tiers.py --plot-only      # redraw docs/kv_tiers.png from the JSON
    .venv/bin/python bench/kv_tiers.py --sessions 4 --turns 2   # a quick look

The trace (issue 21): `--sessions` agent sessions share a system prompt; each turn sends the whole conversation
so far (system prompt, first user message, then per earlier turn the model's output and a tool result), so
contexts grow turn by turn. Sessions take turns round-robin: between two turns of one session every other session
has its turn (its think time), which is what evicts its GPU pages, since the GPU pages (`--gpu-pages`) hold fewer
tokens than the sessions' contexts together. Requests run one at a time (TTFT is the prefill's own time, not
queueing); store writes are given up to a second to land between requests (the think-time gap). The setups'
engines live side by side and take each request in turn, so a busy shared machine loads them alike; besides the
wall-clock TTFT, the process's CPU seconds to the first token are recorded (steadier on a shared machine).

Setups, each a fresh engine (and a fresh store directory): GPU pages only; + a host tier (`host_cache_bytes`
large enough for every block); + a `dir://` store (no host tier); + `ec:10+2:dir://` (no host tier); + a `dir://`
store that keeps no window snapshots, its prefixes' window state rebuilt by a bounded SWA replay; host tier + SWA
host slots (`swa_host_slots` = sessions: each next turn restores its tail from the slot). Per setup: TTFT
median and p99, prefill tokens computed (prompt tokens minus `num_cached_tokens`) and the tokens each tier
supplied; ratios against GPU-only measured in the same run. Also pyeclib's 10+2 encode and decode speed at the
model's block size and at 1 MiB. The H200 run of this trace is not done here (no device in the session that
wrote it): `--accelerator nvidia` runs the same on a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deepserve import LLM, SamplingParams  # noqa: E402
from deepserve.model.kv_cache import bytes_per_page, page_pool_bytes  # noqa: E402

MODEL = ROOT / "deepserve" / "assets" / "deepserve-tiny-v4"
OUT = ROOT / "bench" / "results" / "kv_tiers_cpu.json"
PLOT = ROOT / "docs" / "kv_tiers.png"
P = 128


def trace(args) -> list[tuple[int, int, list[int]]]:
    """(session, turn, new tokens of this turn) in arrival order; the model's outputs are appended as they come."""
    rng = random.Random(args.seed)
    system = [rng.randrange(10, 4000) for _ in range(args.system_tokens)]
    out = []
    for turn in range(args.turns):
        for s in range(args.sessions):
            if turn == 0:
                new = system + [rng.randrange(10, 4000) for _ in range(args.user_tokens)]
            else:
                new = [rng.randrange(10, 4000) for _ in range(args.tool_tokens)]
            out.append((s, turn, new))
    return out


class Setup:
    """One tier setup's engine, its sessions' conversations so far, and what its requests measured."""

    def __init__(self, name: str, args, kw: dict) -> None:
        self.name = name
        self.llm = LLM(str(MODEL), accelerator=args.accelerator, block_size=P, max_num_seqs=4, **kw)
        self.params = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
        self.history: dict[int, list[int]] = {}
        self.ttft, self.cpu_ttft = [], []
        self.computed = self.cached = self.prompt_tokens = 0

    def turn(self, session: int, turn: int, new: list[int]) -> None:
        engine = self.llm.engine
        prompt = self.history.get(session, []) + new
        rid = f"{session}-{turn}"
        began, cpu = time.perf_counter(), time.process_time()
        engine.add_request(rid, prompt, self.params)
        first = final = None
        while final is None:
            for out in engine.step():
                if out.request_id == rid and first is None and out.outputs[0].token_ids:
                    first = time.perf_counter() - began
                    self.cpu_ttft.append(time.process_time() - cpu)
                if out.request_id == rid and out.finished:
                    final = out
        while engine.has_unfinished_requests():  # the step that frees it (and saves its SWA slot)
            engine.step()
        if engine.kv_tiers is not None:
            engine.kv_tiers.flush(1.0)  # the think-time gap: the store writes land
        self.ttft.append(first)
        self.computed += len(prompt) - final.num_cached_tokens
        self.cached += final.num_cached_tokens
        self.prompt_tokens += len(prompt)
        self.history[session] = prompt + list(final.outputs[0].token_ids)

    def result(self) -> dict:
        engine = self.llm.engine
        tiers = {tier: {"hit_tokens": s.num_hit_tokens, "errors": s.num_errors,
                        "evicted_blocks": s.num_evicted_blocks, "stored_bytes": s.num_stored_bytes}
                 for tier, s in (engine.kv_tiers.snapshot().items() if engine.kv_tiers is not None else ())}
        swa = engine.swa_slots.stats if engine.swa_slots is not None else None
        return {
            "setup": self.name, "requests": len(self.ttft), "prompt_tokens": self.prompt_tokens,
            "prefill_tokens_computed": self.computed, "cached_tokens": self.cached,
            "ttft_median_s": statistics.median(self.ttft), "ttft_p99_s": _p99(self.ttft),
            "cpu_ttft_median_s": statistics.median(self.cpu_ttft), "cpu_ttft_p99_s": _p99(self.cpu_ttft),
            "tiers": tiers, "replayed_tokens": engine.num_replayed_tokens,
            "swa_slots": None if swa is None else {"saved": swa.num_saved, "restored": swa.num_restored,
                                                   "evicted": swa.num_evicted},
        }


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def ec_speed(block_bytes: int, seconds: float = 0.5) -> list[dict]:
    from pyeclib.ec_iface import ECDriver, VALID_EC_TYPES

    from deepserve.plugins.cache.ec_store import EC_TYPES

    ec_type = next(t for t in EC_TYPES if t in VALID_EC_TYPES)
    driver = ECDriver(k=10, m=2, ec_type=ec_type)
    out = []
    for size in (block_bytes, 2**20):
        data = os.urandom(size)

        def rate(fn) -> float:
            fn()
            n, began = 0, time.perf_counter()
            while time.perf_counter() - began < seconds:
                fn()
                n += 1
            return n * size / (time.perf_counter() - began) / 1e9

        frags = driver.encode(data)
        assert driver.decode(frags[2:]) == data  # two data fragments lost
        out.append({"ec_type": ec_type, "block_bytes": size, "encode_GBps": rate(lambda: driver.encode(data)),
                    "decode_data_fragments_GBps": rate(lambda: driver.decode(frags[:10])),
                    "decode_two_lost_GBps": rate(lambda: driver.decode(frags[2:]))})
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["setups"]
    names = [r["setup"] for r in rows]
    x = range(len(rows))
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.6))
    a.bar([i - 0.2 for i in x], [r["ttft_median_s"] * 1e3 for r in rows], 0.4, label="median")
    a.bar([i + 0.2 for i in x], [r["ttft_p99_s"] * 1e3 for r in rows], 0.4, label="p99")
    a.set_ylabel("time to first token (ms)")
    b.bar(list(x), [r["prefill_tokens_computed"] for r in rows], 0.6, color="tab:green", label="prompt tokens")
    b.bar(list(x), [r.get("replayed_tokens", 0) for r in rows], 0.6, color="tab:olive", label="SWA replay",
          bottom=[r["prefill_tokens_computed"] for r in rows])
    b.set_ylabel("prefill tokens computed")
    b.legend()
    for ax in (a, b):
        ax.set_xticks(list(x), names, rotation=20, ha="right")
    a.legend()
    t = result["trace"]
    fig.suptitle(f"KV tiers, {t['sessions']} agent sessions x {t['turns']} turns, {t['gpu_pages']} GPU pages of {P} "
                 f"tokens ({result['machine']['device']}, embedded model)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=256)
    ap.add_argument("--user-tokens", type=int, default=200)
    ap.add_argument("--tool-tokens", type=int, default=90)
    ap.add_argument("--output-tokens", type=int, default=24)
    ap.add_argument("--gpu-pages", type=int, default=16)
    ap.add_argument("--accelerator", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--plot-only", action="store_true")
    args = ap.parse_args()
    if args.plot_only:
        plot(json.loads(args.out.read_text()), PLOT)
        return
    probe = LLM(str(MODEL), accelerator=args.accelerator, block_size=P, max_num_seqs=4)
    page = bytes_per_page(probe.model, P, probe.model.lm_head.weight.dtype)
    block = sum(page_pool_bytes(probe.runner.cache).values())
    del probe
    base = dict(kv_cache_bytes=args.gpu_pages * page)
    root = Path(tempfile.mkdtemp(prefix="kv_tiers_"))
    big = 1 << 34
    setups = [("GPU pages", {}), ("+ host tier", dict(host_cache_bytes=big)),
              ("+ dir store", dict(kv_store=f"dir://{root}/dir")),
              ("+ ec:10+2 (dir)", dict(kv_store=f"ec:10+2:dir://{root}/ec")),
              ("+ dir, no snapshots, bounded replay",
               dict(kv_store=f"dir://{root}/dir-replay", kv_store_snapshots=False, swa_replay="bounded")),
              ("+ host tier + SWA slots", dict(host_cache_bytes=big, swa_host_slots=args.sessions))]
    try:
        engines = [Setup(name, args, {**base, **kw}) for name, kw in setups]
        for session, turn, new in trace(args):  # every setup takes each request in turn: the same machine load
            for setup in engines:
                setup.turn(session, turn, new)
        rows = [setup.result() for setup in engines]
        for setup in engines:
            setup.llm.engine.shutdown()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for row in rows:
        print(f"{row['setup']:36s} TTFT median {row['ttft_median_s'] * 1e3:7.1f} ms  p99 {row['ttft_p99_s'] * 1e3:7.1f}"
              f" ms  (CPU {row['cpu_ttft_median_s'] * 1e3:7.1f} / {row['cpu_ttft_p99_s'] * 1e3:7.1f} ms)  prefill "
              f"computed {row['prefill_tokens_computed']:6d} of {row['prompt_tokens']}", flush=True)
    gpu = rows[0]
    for row in rows:
        row["ttft_median_vs_gpu_only"] = row["ttft_median_s"] / gpu["ttft_median_s"]
        row["cpu_ttft_median_vs_gpu_only"] = row["cpu_ttft_median_s"] / gpu["cpu_ttft_median_s"]
        row["prefill_tokens_vs_gpu_only"] = row["prefill_tokens_computed"] / gpu["prefill_tokens_computed"]
    import torch

    result = {
        "command": "python bench/kv_tiers.py " + " ".join(sys.argv[1:]),
        "machine": {"device": args.accelerator, "cpu": platform.processor() or platform.machine(),
                    "cpu_count": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads()},
        "trace": {"sessions": args.sessions, "turns": args.turns, "system_tokens": args.system_tokens,
                  "user_tokens": args.user_tokens, "tool_tokens": args.tool_tokens,
                  "output_tokens": args.output_tokens, "gpu_pages": args.gpu_pages, "page_tokens": P,
                  "page_bytes": page, "block_bytes": block},
        "setups": rows,
        "ec_10_2": ec_speed(block),
        "not_run": "the H200 run (no device in this session)",
    }
    for e in result["ec_10_2"]:
        print(f"ec 10+2 {e['ec_type']} {e['block_bytes']:8d} B: encode {e['encode_GBps']:.2f} GB/s, decode "
              f"{e['decode_data_fragments_GBps']:.2f} GB/s, two lost {e['decode_two_lost_GBps']:.2f} GB/s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, PLOT)


if __name__ == "__main__":
    main()
