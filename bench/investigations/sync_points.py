"""Where `LLM.generate`'s decode steps make the host wait for the GPU (issue 23: at 256 sequences the H100 took
9.89 ms a step against a 6.73 ms graph step, while on the CPU with an emulated asynchronous device the host's
work overlaps the device's: `bench/runner_host.py --device-ms`).

    python3 bench/investigations/sync_points.py [--batch 256] [--tokens 32] [--out DIR]
    bash bench/gpu_call.sh sync_points                         # on the GPU machine

Builds `LLM` over bench/e2e.py's checkpoint (V4-Flash layer shapes, 6 layers, written once into
/tmp/deepserve_e2e_ckpt), warms the shape with one generate, then runs a timed one of `--tokens` tokens with
`torch.cuda.set_sync_debug_mode("warn")`: torch then warns at the calls that synchronize the host with the device
(a pageable copy, `.item()`, `.tolist()` of a device tensor; an explicit event's or stream's synchronize, such as
the runner's deferred read-back, is not flagged). Each warning's Python stack is kept; the sites in deepserve are
counted per decode step and printed, the top ones with their callers, into `sync_points.json`. Needs CUDA.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def deepserve_frames(stack: list[traceback.FrameSummary]) -> list[str]:
    """The frames of the package (innermost last) as 'path:line in function'."""
    return [f"{Path(f.filename).relative_to(ROOT)}:{f.lineno} in {f.name}" for f in stack
            if "/deepserve/" in f.filename and Path(f.filename).is_relative_to(ROOT)]


class SyncRecorder:
    """Counts the synchronizing calls torch warns about, by their innermost deepserve frame, with the callers."""

    def __init__(self) -> None:
        self.sites: collections.Counter[str] = collections.Counter()
        self.callers: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.threads: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.other = 0
        self._lock = threading.Lock()

    def showwarning(self, message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" not in str(message):
            return
        frames = deepserve_frames(traceback.extract_stack()[:-1])
        with self._lock:
            if not frames:
                self.other += 1
                return
            site = frames[-1]
            self.sites[site] += 1
            self.callers[site][" <- ".join(reversed(frames[:-1][-3:]))] += 1
            self.threads[site][threading.current_thread().name] += 1

    def report(self, steps: int, top: int = 15) -> dict:
        return {"steps": steps, "unattributed": self.other,
                "sites": [{"site": site, "per_step": count / steps, "count": count,
                           "threads": dict(self.threads[site]), "callers": dict(self.callers[site].most_common(3))}
                          for site, count in self.sites.most_common(top)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("sync_points needs CUDA: torch.cuda.set_sync_debug_mode only warns for a GPU")
    from e2e import Plan, ensure_checkpoint, prompts, vocab_of

    from deepserve import LLM, SamplingParams

    plan = Plan.make(quick=False)
    ckpt = ensure_checkpoint(Path("/tmp/deepserve_e2e_ckpt"), plan)
    llm = LLM(model=str(ckpt), **plan.llm_options())
    batch = [{"prompt_token_ids": p} for p in prompts(args.batch, plan, vocab_of(ckpt), seed=0)]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate(batch, params, use_tqdm=False)  # the shape warm (any compile or capture out of the count)
    batch = [{"prompt_token_ids": p} for p in prompts(args.batch, plan, vocab_of(ckpt), seed=1)]

    recorder = SyncRecorder()
    began = time.perf_counter()
    with warnings.catch_warnings():  # (restores the filters and the hook it found)
        warnings.simplefilter("always")
        warnings.showwarning = recorder.showwarning
        torch.cuda.set_sync_debug_mode("warn")
        try:
            llm.generate(batch, params, use_tqdm=False)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    seconds = time.perf_counter() - began
    res = {"batch": args.batch, "tokens": args.tokens, "seconds": seconds, "device": torch.cuda.get_device_name(),
           **recorder.report(steps=args.tokens)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sync_points.json").write_text(json.dumps(res, indent=1) + "\n")
    print(f"batch {args.batch}, {args.tokens} tokens: {seconds:.2f} s with the sync checks on; "
          f"{recorder.other} synchronizing calls outside deepserve")
    for s in res["sites"]:
        print(f"{s['per_step']:8.2f} a step  {s['site']}  threads {s['threads']}")
        for caller, n in s["callers"].items():
            print(f"{'':20}<- {caller} ({n})")


if __name__ == "__main__":
    main()
