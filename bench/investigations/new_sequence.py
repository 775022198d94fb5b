"""Host time of a new sequence's state in the paged cache (`PagedKVCache.new_sequence`: the slot's window rings and
open frontiers zeroed, a state object per layer and stream), paid on every admission, at a given depth.

    python bench/investigations/new_sequence.py [--layers 43] [--repeats 200]
    PYTHONPATH=/tmp/old python bench/investigations/new_sequence.py ...   # an older tree's package

The demo checkpoint at `--layers` (bench/runner_host.py's `depth`: two window-only layers, then CSA / HCA), fp32 on
the CPU. Prints the median of 5 runs of `--repeats` new sequences, in milliseconds a sequence.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # bench/, after PYTHONPATH


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=43)
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    import torch

    import deepserve
    from deepserve import LLM
    from deepserve.tools.demo_checkpoint import build_demo_checkpoint
    from runner_host import depth

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = build_demo_checkpoint(Path(tmp) / "demo", seed=2, **depth(args.layers))
        llm = LLM(str(checkpoint), dtype="float32", max_num_seqs=4, block_size=128, max_model_len=1024,
                  load_plugins=False)
    cache, runs = llm.cache, []
    for _ in range(5):
        began = time.perf_counter()
        for _ in range(args.repeats):
            _, slot = cache.new_sequence([0, 1])
            cache.free_sequence(slot)
        runs.append((time.perf_counter() - began) / args.repeats * 1e3)
    print(json.dumps({"package": str(Path(deepserve.__file__).parent), "layers": args.layers,
                      "ms_per_sequence": statistics.median(runs), "runs": runs}))


if __name__ == "__main__":
    main()
