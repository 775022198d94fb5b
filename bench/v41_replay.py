"""What SWA bounded replay costs on V4.1 in quality, and what it saves, against exact (issue 22 item 3; CPU).

    .venv/bin/python bench/v41_replay.py          # writes bench/results/v41_replay_cpu.json (about a minute)

For each golden checkpoint (`tiny_a`: window 32 x 8 layers = 256; `tiny_b`: 16 x 10 = 160), boundaries B of 256
and 384 (page multiples) and random prompts of B + 16 tokens: the cold state at B (a prefill of B tokens), and
states rebuilt at B by `deepserve.model.v41.replay.replay_state` from the exact compressed rows and the last L
tokens, L in {window x depth (exact), 128 (DeepInfer's bounded), 64}. From each state: the greedy agreement (the
share of 16 free-running greedy tokens before the first that differs from the cold state's) and, teacher-forced on
the cold run's greedy tokens, the |logprob difference| of those tokens (mean and max). Tokens computed to get the
state at B: L for a replay, B for recomputing the prefix without one.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deepserve.model.v41 import load_v41  # noqa: E402
from deepserve.model.v41.replay import BOUNDED_LENGTH, exact_length, replay_state  # noqa: E402

STEPS = 16


def greedy_from(model, state, first: int) -> tuple[list[int], list[torch.Tensor]]:
    tokens, logprobs, t = [], [], first
    for _ in range(STEPS):
        lp = torch.log_softmax(model.forward([t], state).logits, -1)
        t = int(lp.argmax())
        tokens.append(t)
        logprobs.append(lp)
    return tokens, logprobs


def teacher_forced(model, state, first: int, tokens: list[int]) -> list[torch.Tensor]:
    out, t = [], first
    for nxt in tokens:
        out.append(torch.log_softmax(model.forward([t], state).logits, -1))
        t = nxt
    return out


def clone(model, state):
    copy = model.make_state()
    copy.load(state.save())
    return copy


def main() -> int:
    torch.set_num_threads(1)
    rows, began = [], time.perf_counter()
    for name in ("tiny_a", "tiny_b"):
        model = load_v41(ROOT / "tests" / "golden" / "v41" / name / "tiny")
        lengths = [exact_length(model.cfg), BOUNDED_LENGTH, 64]
        for boundary in (256, 384):
            per_len = {L: {"agree": [], "dev": []} for L in lengths if L <= boundary}
            for seed in range(3):
                ids = torch.randint(3, 500, (boundary + 1,), generator=torch.Generator().manual_seed(seed)).tolist()
                cold = model.make_state()
                model.forward(ids[:boundary], cold)
                ref_tokens, ref_lp = greedy_from(model, clone(model, cold), ids[boundary])
                for L in per_len:
                    state = replay_state(model, ids, boundary, L, cold)
                    tokens, _ = greedy_from(model, clone(model, state), ids[boundary])
                    agree = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), STEPS)
                    lp = teacher_forced(model, state, ids[boundary], ref_tokens)
                    devs = [abs(float(a[t] - b[t])) for a, b, t in zip(ref_lp, lp, ref_tokens)]
                    per_len[L]["agree"].append(agree / STEPS)
                    per_len[L]["dev"] += devs
            for L, r in per_len.items():
                rows.append({"model": name, "boundary": boundary, "replay_tokens": L,
                             "exact": L >= exact_length(model.cfg), "recompute_tokens": boundary,
                             "greedy_agreement": round(statistics.mean(r["agree"]), 3),
                             "logprob_dev_mean": round(statistics.mean(r["dev"]), 4),
                             "logprob_dev_max": round(max(r["dev"]), 4)})
                print(json.dumps(rows[-1]))
    out = {"rows": rows, "wall_s": round(time.perf_counter() - began, 1), "torch": torch.__version__}
    path = ROOT / "bench" / "results" / "v41_replay_cpu.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
