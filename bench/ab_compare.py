"""An older commit's deepserve against the working tree's, on one GPU in one call: the baseline of a speed-up
measured on the same machine in the same run.

On the development machine, export the old package next to the tree (without the embedded model's weights,
which the benchmark does not read, so the tree stays small enough to travel):

    git archive <commit> deepserve | tar -x -C ab_old --exclude 'deepserve/assets/*'

then, on the GPU machine:

    python3 bench/ab_compare.py --old ab_old [--rounds 2] [--prefill 1024] [--batches 1]

Each round runs the old and then the new package, each in a fresh process, through `bench/gpu.py`'s
`bench_deepserve` (its prefill rows, and the eager and CUDA-graph decode rows at context 512), and prints one
RESULT line per run; alternating them spreads the machine's drift over both. Writes ab_compare.json into --out
($OUT when set).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_RUN = """
import json, sys, torch
sys.path.insert(0, {path!r})
import deepserve
sys.path.insert(1, {root!r})
import bench.gpu as g
from deepserve.backends.nvidia import NvidiaBackend
model = g.build(g.V4_FLASH_LAYER, NvidiaBackend("cuda"), torch.bfloat16)
res = g.bench_deepserve(model, "cuda", {prefill}, {batches}, 512, 20, g.V4_FLASH_LAYER["vocab_size"], 512)
flat = {{k: {{a: b for a, b in v.items() if not isinstance(b, (list, dict))}} for k, v in res["decode_graphs"].items()}}
print("RESULT", json.dumps({{"package": deepserve.__file__, "prefill": res["prefill"], "decode": res["decode"],
                            "decode_graphs": flat}}), flush=True)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", type=Path, required=True, help="the folder holding the old `deepserve` package")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prefill", default="1024", help="prefill lengths, comma-separated (empty: none)")
    ap.add_argument("--batches", default="1", help="decode batch sizes, comma-separated")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "."))
    args = ap.parse_args()
    prefill = [int(x) for x in args.prefill.split(",") if x]
    batches = [int(x) for x in args.batches.split(",") if x]
    runs = []
    for r in range(args.rounds):
        for label, path in (("old", args.old.resolve()), ("new", ROOT)):
            code = _RUN.format(path=str(path), root=str(ROOT), prefill=prefill, batches=batches)
            proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode or not lines:
                print(f"{label} round {r + 1}: failed\n{proc.stderr[-2000:]}", flush=True)
                continue
            result = json.loads(lines[-1][len("RESULT "):])
            runs.append({"which": label, "round": r + 1, **result})
            graphs = result["decode_graphs"]
            print(f"{label} round {r + 1}: " + ", ".join(f"graphs b{k} {v['ms_per_step']:.3f} ms/step"
                                                         for k, v in graphs.items()), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ab_compare.json").write_text(json.dumps({"old": str(args.old), "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
