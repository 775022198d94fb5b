"""Train deepserve's embedded default model, `deepserve-tiny-v4`: a small DeepSeek-V4 (every attention layer
type, hash-routed and learned-routed MoE with a shared expert, mHC, an MTP block) on Python's standard library.

    python -m deepserve.tools.train_tiny prepare DATA            # tokenizer + token arrays (needs deepseek-recipe)
    python -m deepserve.tools.train_tiny train DATA OUT [--device cpu|cuda] [--steps N | --time-budget S]
    python -m deepserve.tools.train_tiny card OUT DATA            # evaluate through deepserve, write README.md
    python -m deepserve.tools.train_tiny all [OUT]                # the three in a row (OUT: the shipped model)

Everything is drawn from `--seed`. `prepare` reads the interpreter's own standard library, so the corpus (and
with it the model) depends on the Python version, which the model card records. `train --time-budget` measures
the first steps and fixes the step count to fit; the log prints it, and `--steps` with that count repeats the run
(bitwise with one thread, `OMP_NUM_THREADS=1`; more threads sum floats in another order, about 1e-6 apart).
`TINY_CONFIG` and `TrainConfig`'s defaults are the shipped model's; they are sized for a CPU (about 25 minutes
on two cores). The training forward is device-agnostic (`--device cuda`), so a GPU can train a larger variant
with `--model-set` / `--set`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

from deepserve.backends.reference import ReferenceBackend
from deepserve.core.config import CSA, ModelConfig

from . import train_corpus as corpus

#: the model: 6 layers (2 window-only, 2 CSA, 2 HCA), the first 2 hash-routed; 8 experts, top-2, 1 shared; sized so
#: that a CPU trains it in 25 minutes
TINY_CONFIG = dict(
    model_type="deepseek_v4", vocab_size=4096, hidden_size=128, num_hidden_layers=6, num_attention_heads=4,
    head_dim=32, q_lora_rank=64, partial_rotary_factor=0.25, o_groups=2, o_lora_rank=64, sliding_window=32,
    layer_types=["sliding_attention", "sliding_attention", "compressed_sparse_attention",
                 "heavily_compressed_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    rope_theta=10000.0, compress_rope_theta=160000.0,
    rope_parameters={"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 1024,
                     "beta_fast": 32, "beta_slow": 1},
    max_position_embeddings=4096, index_n_heads=16, index_head_dim=16, index_topk=8, n_routed_experts=8,
    num_experts_per_tok=2, moe_intermediate_size=128, num_hash_layers=2, num_nextn_predict_layers=1,
    bos_token_id=0, eos_token_id=1,
)
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "assets" / "deepserve-tiny-v4"
DEFAULT_DATA = Path("build") / "deepserve-tiny-data"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _logger(path: Path | None):
    def log(msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, file=sys.stderr, flush=True)
        if path is not None:
            with path.open("a") as f:
                f.write(line + "\n")
    return log


def train_model(data_dir: Path, out: Path, device: str, steps: int | None, time_budget: float | None, seed: int,
                overrides: dict | None = None, model_overrides: dict | None = None,
                log_dir: Path | None = None) -> dict:
    """Train on the prepared data and write a checkpoint (bf16 weights, config, tokenizer) into `out`; the log,
    summary and loss history go to `log_dir` (default `out`) as `train_tiny_*`."""
    from deepserve.model.factory import build_model
    from deepserve.model.writer import save_checkpoint

    from .train_forward import check_against_inference
    from .train_loop import Sampler, TrainConfig, build_trainable, train

    out.mkdir(parents=True, exist_ok=True)
    log_dir = log_dir or out
    log_dir.mkdir(parents=True, exist_ok=True)
    log = _logger(log_dir / "train_tiny_log.txt")
    torch.manual_seed(seed)
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    data, meta = corpus.load_data(data_dir)
    cfg = TrainConfig(seed=seed, **(overrides or {}))
    model_cfg = ModelConfig.from_dict({**TINY_CONFIG, **(model_overrides or {})})
    model = build_trainable(model_cfg, device, data["token_counts"], seed)
    probe = torch.randint(2, model_cfg.vocab_size, (2, 6 * model_cfg.compress_rates[CSA] * model_cfg.index_topk),
                          generator=torch.Generator().manual_seed(seed)).to(device)
    parity = diff = check_against_inference(model, probe)
    log(f"batched training forward vs deepserve's inference forward: max |dlogit| = {diff:.2e}")
    if diff > (5e-3 if device.startswith("cuda") else 1e-3):  # TF32 matmuls on a GPU: 9.2e-4 (H200), 1.04e-3 (H100)
        raise RuntimeError(f"the training forward disagrees with deepserve's forward by {diff}")
    num_params = sum(p.numel() for p in model.parameters())
    log(f"model: {num_params / 1e6:.2f} M parameters; device {device} "
        f"({torch.cuda.get_device_name() if device.startswith('cuda') else 'CPU'}); {cfg}")
    result = train(model, Sampler(data, cfg), cfg, steps, time_budget, log)
    log(f"trained {result['steps_done']} steps ({result['tokens']:,} tokens) in {result['seconds']:.0f} s")

    shipped = build_model(model_cfg, ReferenceBackend("cpu"), torch.bfloat16)
    shipped.load_state_dict({k: v.detach().cpu() for k, v in model.state_dict().items()})
    save_checkpoint(shipped, out)
    for name in TOKENIZER_FILES:
        shutil.copy(data_dir / name, out / name)
    summary = dict(
        seed=seed, device=device, parity=parity,
        device_name=torch.cuda.get_device_name() if device.startswith("cuda") else
        f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)",
        torch=torch.__version__, num_params=num_params, train_config=dataclasses.asdict(cfg),
        data=dict(python=meta["python"], fingerprint=meta["fingerprint"]),
        **{k: v for k, v in result.items() if k != "history"},
    )
    (log_dir / "train_tiny_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (log_dir / "train_tiny_history.json").write_text(json.dumps(result["history"]) + "\n")
    return summary


def _pairs(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        out[key] = json.loads(value)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="build the tokenizer and token arrays")
    p.add_argument("data", type=Path)
    t = sub.add_parser("train", help="train and write a checkpoint")
    t.add_argument("data", type=Path)
    t.add_argument("out", type=Path)
    c = sub.add_parser("card", help="evaluate a checkpoint through deepserve and write its model card")
    c.add_argument("out", type=Path)
    c.add_argument("data", type=Path)
    a = sub.add_parser("all", help="prepare, train and card")
    a.add_argument("out", type=Path, nargs="?", default=DEFAULT_OUT)
    a.add_argument("--data", type=Path, default=None, help=f"where to keep the prepared data (default: {DEFAULT_DATA})")
    for q in (p, t, a):
        q.add_argument("--seed", type=int, default=0)
    for q in (t, a):
        q.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
        q.add_argument("--steps", type=int, default=None, help="total steps (default: fit --time-budget)")
        q.add_argument("--time-budget", type=float, default=None,
                       help="seconds of training (default: 600 unless --steps is given)")
        q.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                       help="override a TrainConfig field, e.g. --set tokens_per_step=8192")
        q.add_argument("--model-set", action="append", default=[], metavar="FIELD=VALUE",
                       help="override a field of TINY_CONFIG (for quick trial runs)")
    for q in (t, c, a):
        q.add_argument("--log-dir", type=Path, default=None, help="where train_tiny_{log,summary,history,eval} go "
                       "(default: next to the checkpoint)")
    for q in (c, a):
        q.add_argument("--command", default=None, help="the training command to print in the card")
        q.add_argument("--eval-device", default="cpu", help="device of the card's evaluation (fp32)")
        q.add_argument("--eval-windows", type=int, default=None, help="held-out windows to score (default: all)")
        q.add_argument("--reuse-eval", action="store_true", help="rewrite README.md from the last evaluation")
    args = parser.parse_args(argv)
    if args.cmd == "all" and args.log_dir is None:
        args.log_dir = Path("build") / "deepserve-tiny-logs"  # keep the shipped directory clean

    if args.cmd in ("prepare", "all"):
        data = args.data if args.cmd == "prepare" else (args.data or DEFAULT_DATA)
        corpus.prepare_data(data, TINY_CONFIG["vocab_size"], args.seed)
    if args.cmd in ("train", "all"):
        data = args.data if args.cmd == "train" else (args.data or DEFAULT_DATA)
        budget = args.time_budget if args.time_budget is not None or args.steps is not None else 600.0
        train_model(data, args.out, args.device, args.steps, budget, args.seed, _pairs(args.set),
                    _pairs(args.model_set), log_dir=args.log_dir)
    if args.cmd in ("card", "all"):
        from .train_card import write_card

        data = args.data if args.cmd == "card" else (args.data or DEFAULT_DATA)
        write_card(args.out, data, command=args.command, log_dir=args.log_dir, device=args.eval_device,
                   num_windows=args.eval_windows, reuse_eval=args.reuse_eval)


if __name__ == "__main__":
    main()
