"""Where `LLM.generate`'s time goes at a large batch, step by step (issue 23: at 256 sequences the H100's decode step
through `LLM.generate` was 9.89 ms against a 6.73 ms graph step, and bench/investigations/sync_points.py found no
call that makes a pure decode step wait for the GPU).

    python3 bench/investigations/step_timeline.py [--batch 256] [--tokens 128] [--budgets 8192,32768] [--out DIR]
    bash bench/gpu_call.sh step_timeline                       # on the GPU machine

The issue's decode step is (time of a `--tokens` generate - time of a 1-token generate) / (tokens - 1). With a
prompt burst larger than one step's token budget (`max_num_batched_tokens`), the 1-token call is all prefill steps,
but in the long call the requests admitted first decode while later ones prefill (mixed steps: the decode rows run
eagerly in the prefill's forward) and finish earlier (a tail of shrinking decode batches). This records every
engine step of both calls: when the scheduler planned it, its prefill tokens and decode rows; the time from one
plan to the next is charged to the step planned before (with asynchronous scheduling the engine plans step N+1
once step N-1's results are back, so that interval is about one device step). Per budget: the issue's step, the
time by kind of step (prefill only, mixed, decode only) in each call, and the decode-only steps' mean. bench/e2e.py's
checkpoint (written once into /tmp/deepserve_e2e_ckpt); `--quick`: tiny shapes on the CPU, a check of the harness.
Writes step_timeline.json into --out.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


class Timeline:
    """Wraps a scheduler's `schedule` to note each plan's time and make-up."""

    def __init__(self, scheduler) -> None:
        self.scheduler, self.plan = scheduler, scheduler.schedule
        self.steps: list[tuple[float, int, int]] = []  # (time planned, prefill tokens, decode rows)
        scheduler.schedule = self.schedule

    def schedule(self):
        out = self.plan()
        decode = sum(1 for c in out.chunks if len(c.token_ids) == 1 and c.start > 0)
        if out.chunks:
            self.steps.append((time.perf_counter(), out.num_scheduled_tokens - decode, decode))
        return out

    def close(self) -> None:
        self.scheduler.schedule = self.plan

    def summary(self, ended: float) -> dict:
        """Seconds by kind of step, each interval charged to the step planned before its end."""
        times = [t for t, _, _ in self.steps] + [ended]
        by_kind: dict[str, list[float]] = collections.defaultdict(list)
        decode_batches = collections.Counter()
        for i, (_, prefill, decode) in enumerate(self.steps):
            seconds = times[i + 1] - times[i]
            kind = "decode" if not prefill else "prefill" if not decode else "mixed"
            by_kind[kind].append(seconds)
            if kind == "decode":
                decode_batches[decode] += 1
        return {"steps": len(self.steps),
                "kinds": {k: {"steps": len(v), "seconds": sum(v), "mean_ms": 1e3 * sum(v) / len(v)}
                          for k, v in by_kind.items()},
                "decode_batches": dict(sorted(decode_batches.items())),
                "first_steps": [{"prefill": p, "decode": d, "ms": 1e3 * (times[i + 1] - times[i])}
                                for i, (_, p, d) in enumerate(self.steps[:24])]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--budgets", default="8192,32768", help="max_num_batched_tokens values, comma-separated")
    ap.add_argument("--quick", action="store_true", help="tiny shapes on the CPU: a check of this script")
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args()
    from e2e import Plan, ensure_checkpoint, prompts, vocab_of

    from deepserve import LLM, SamplingParams

    plan = Plan.make(quick=args.quick)
    ckpt_dir = Path("/tmp/deepserve_e2e_ckpt" + ("_quick" if args.quick else ""))
    ckpt = ensure_checkpoint(ckpt_dir, plan)
    vocab = vocab_of(ckpt)
    res = {"batch": args.batch, "tokens": args.tokens, "prompt_len": plan.prompt_len, "budgets": {}}
    for budget in [int(b) for b in args.budgets.split(",")]:
        llm = LLM(model=str(ckpt), **plan.llm_options(), max_num_batched_tokens=budget)
        seed = 0

        def generate(n: int) -> tuple[float, Timeline]:
            nonlocal seed
            batch = [{"prompt_token_ids": p} for p in prompts(args.batch, plan, vocab, seed=seed)]
            seed += 1
            params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            timeline = Timeline(llm.engine.scheduler)
            plan.sync()
            began = time.perf_counter()
            try:
                llm.generate(batch, params, use_tqdm=False)
                plan.sync()
            finally:
                timeline.close()
            ended = time.perf_counter()
            return ended - began, timeline.summary(ended)

        generate(1), generate(args.tokens)  # the shapes warm
        (t1, one), (tn, many) = generate(1), generate(args.tokens)
        row = res["budgets"][str(budget)] = {
            "step_ms": 1e3 * (tn - t1) / (args.tokens - 1), "seconds_1": t1, f"seconds_{args.tokens}": tn,
            "call_1": one, f"call_{args.tokens}": many}
        print(f"== budget {budget}: issue's step {row['step_ms']:.2f} ms ({t1:.3f} s for 1 token, "
              f"{tn:.3f} s for {args.tokens})", flush=True)
        for label, s in (("1 token", one), (f"{args.tokens} tokens", many)):
            kinds = ", ".join(f"{k} {v['steps']} steps {v['seconds']:.3f} s ({v['mean_ms']:.2f} ms each)"
                              for k, v in s["kinds"].items())
            print(f"   {label}: {s['steps']} steps: {kinds}", flush=True)
        print("   decode-only steps by rows:", many["decode_batches"], flush=True)
        llm.engine.shutdown()
        del llm
        if not args.quick:
            import torch

            torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "step_timeline.json").write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
