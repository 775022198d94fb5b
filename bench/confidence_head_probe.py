"""The confidence head of a checkpoint (default build/v2old: fe5f6b7's v2 weights) under several head settings,
each scored by tests/test_confidence.py's bar on the checkpoint's heldout.json prompts (the first 16), from the
outcomes of N training prompts cut from the standard library's held-out files (CPU, torch's kernels).

    python bench/confidence_head_probe.py [N] [MODEL_DIR]      results: bench/results/confidence_head_v2_probe.txt
"""

import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepserve.backends.reference import ReferenceBackend  # noqa: E402
from deepserve.model.factory import load_model  # noqa: E402
from deepserve.model.tokenizer import Tokenizer  # noqa: E402
from deepserve.tools import train_confidence as tc  # noqa: E402

#: head settings tried: (width, weight decay, lr, epochs); the first is train_confidence's default
SETTINGS = [(32, 1e-3, 3e-3, 30), (32, 1e-2, 1e-3, 60), (16, 1e-2, 3e-3, 30), (8, 1e-2, 3e-3, 40),
            (32, 0.1, 1e-3, 60)]


def main() -> None:
    num_prompts = int(sys.argv[1]) if len(sys.argv) > 1 else 1536
    model_dir = Path(sys.argv[2]) if len(sys.argv) > 2 else Path("build/v2old")
    t0 = time.time()
    model = load_model(model_dir, ReferenceBackend("cpu", exact=False), dtype="float32", progress=False)
    tok = Tokenizer(model_dir, model.cfg)
    test_prompts = [c["prompt"] for c in json.loads((model_dir / "heldout.json").read_text())["completion"]]
    files = tc.heldout_prompt_files(tok, test_prompts, None)
    train_files = [f for f in files if not tc.is_eval_file(f[0])]
    rng = random.Random(0)
    newline_ids = {i for i in range(tok.vocab_size) if (tok.id_to_token(i) or "").endswith("Ċ")}
    prompts = tc.cut_prompts(train_files, newline_ids, num_prompts, 128, 24, rng)
    g = torch.Generator().manual_seed(0)
    picked = [i for i in range(len(prompts)) if i % 4 >= 2]  # as train_confidence.fit extends them
    extended = tc.extend_by_sampling(model, [prompts[i] for i in picked], [rng.randint(1, 8) for _ in picked], g)
    for i, p in zip(picked, extended):
        prompts[i] = p
    n_val = len(prompts) // 8
    val = tc.collect(model, prompts[:n_val], 16, 5, 32, "val", time.time() + 60)
    train = tc.collect(model, prompts[n_val:], 16, 5, 32, "train", time.time() + 330)
    print(f"rows train {len(train)} val {len(val)}; {time.time() - t0:.0f} s; files {len(train_files)}", flush=True)
    test = tc.log_draft_outcomes(model, test_prompts[:16], num_tokens=16, k=5)
    y, p1 = test.accepted, test.top1_probability()
    rate = torch.full_like(y, y.mean().item())
    print(f"test rows {len(y)} rate {y.mean():.3f} top1 ll {tc.log_loss(p1, y):.3f} auc {tc.auc(p1, y):.3f}")
    for width, wd, lr, epochs in SETTINGS:
        head, _ = tc.train_head(train, val, model.cfg.hidden_size, 0, width, epochs, lr=lr, weight_decay=wd,
                                log=lambda _: None)
        ph = head(test.features)
        print(dict(width=width, wd=wd, lr=lr, ll=round(tc.log_loss(ph, y), 3),
                   bar_ll_top1=round(0.5 * tc.log_loss(p1, y), 3), bar_ll_const=round(0.6 * tc.log_loss(rate, y), 3),
                   auc=round(tc.auc(ph, y), 3), bar_auc=round(tc.auc(p1, y) + 0.1, 3),
                   ece=round(tc.calibration(ph, y)[0], 3), mean_gap=round(abs(ph.mean().item() - y.mean().item()), 3)),
              flush=True)
    print(f"done {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
