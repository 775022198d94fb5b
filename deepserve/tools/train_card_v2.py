"""The model card of the embedded model v2 (`deepserve/assets/deepserve-tiny-v4/README.md`, copied to
docs/model_card.md), written from a `train_v2` run's records and the CPU evaluations that follow it.

    python -m deepserve.tools.train_card_v2 MODEL_DIR RUN_DIR [--cpu-eval FILE ...] [--v1-eval FILE]
        [--confidence FILE] [--extra FILE] [--docs docs/model_card.md]

RUN_DIR is the unpacked `bundle.tar.gz` of the device run (`logs/metrics.json`, `data/meta.json`). The samples are
generated here, through `LLM.generate` (fp32, CPU), from MODEL_DIR.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from deepserve.core.config import CSA, HCA, SLIDING, ModelConfig

from . import train_corpus as corpus

#: v1's numbers, from its model card (held out: its own 66 standard-library files, 256-token windows, CPU fp32)
V1_CARD = dict(code_loss=4.061, code_tokens=275_873, chat_loss=3.768, mtp_first=0.726, mtp_tokens_per_step=2.98,
               next_token=0.312, free_run=0.062, params=4.78e6, train_minutes=24.1, train_tokens=2.0e6)
SAMPLE_PROMPTS = (
    ("completion (the issue's prompt)", "def fibonacci(n):\n    ", 48),
    ("completion", 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""', 96),
    ("completion", 'import os\n\n\ndef list_python_files(directory):\n    """Return the paths of the .py files under '
                   'directory."""', 96),
)
CHAT_SAMPLES = (("chat (V4.1, non-thinking): the README's curl request, its max_tokens 64", "Write a function that "
                 "reverses a list.", 64), ("chat (V4.1, non-thinking)", corpus.CARD_CHAT_REQUEST, 128))


def train_gpu_options(command: str) -> str:
    """The options that bench/train_gpu.sh passed on, from the run's recorded command (`... run OUT --device
    cuda OPTIONS`): the script adds OUT and the device itself."""
    words = command.split()
    words = words[words.index("run") + 2 :]
    if "--device" in words:
        at = words.index("--device")
        del words[at : at + 2]
    return " ".join(words)

def gpu_short(metrics: dict) -> str:
    """The GPU's model from the run's recorded device name ("NVIDIA H100 80GB HBM3" -> "H100")."""
    name = metrics.get("device_name") or metrics.get("train", {}).get("device_name", "GPU")
    found = re.search(r"\b[A-Z]{1,2}\d{2,4}[A-Z]?\b", name)
    return found.group(0) if found else name


def sample_defaults(model_dir: Path) -> dict:
    """The model's sampling defaults the samples are generated with (its generation_config.json's)."""
    from deepserve.core.generation_config import sampling_defaults

    return sampling_defaults("auto", model_dir)


def samples(model_dir: Path) -> list[dict]:
    from deepserve import LLM, SamplingParams

    llm = LLM(model=str(model_dir), dtype="float32", load_plugins=False, accelerator="cpu")
    enc = corpus.v41_encoding(model_dir / "tokenizer.json")
    greedy = lambda n: SamplingParams(**{**llm.sampling_defaults, "temperature": 0.0, "max_tokens": n})  # noqa: E731
    out = []
    for kind, prompt, n in SAMPLE_PROMPTS:
        r = llm.generate([prompt], greedy(n), use_tqdm=False)[0].outputs[0]
        out.append(dict(kind=kind, prompt=prompt, max_tokens=n, text=r.text, finish_reason=r.finish_reason))
    for kind, user, n in CHAT_SAMPLES:
        ids = corpus.render_prompt(enc, user, thinking=False)
        r = llm.generate([{"prompt_token_ids": ids}], greedy(n), use_tqdm=False)[0].outputs[0]
        out.append(dict(kind=kind, prompt=user, max_tokens=n, text=r.text, finish_reason=r.finish_reason))
    return out


def _pct(x) -> str:
    return "n/a" if x is None else f"{x:.0%}" if x in (0, 1) else f"{x:.1%}"


def card_text(model_dir: Path, metrics: dict, meta: dict, cpu_eval: dict, v1_eval: dict | None,
              confidence: dict | None, extra: dict, shown: list[dict]) -> str:
    cfg = ModelConfig.from_file(model_dir)
    kinds = {SLIDING: "window-only", CSA: "CSA", HCA: "HCA"}
    layers = ", ".join(f"{i}: {kinds[t]}{' + hash MoE' if m == 'hash_moe' else ''}"
                       for i, (t, m) in enumerate(zip(cfg.layer_types, cfg.mlp_layer_types)))
    shard_bytes = sum(p.stat().st_size for p in model_dir.glob("model-*.safetensors"))
    tr, tc, ev = metrics["train"], metrics["train_config"], metrics["eval"]
    src = meta["sources"]
    sources = src["sources"]
    kept = [s for s in sources if s.get("kept")]
    left_out = [s for s in sources if not s["permissive"]]
    permissive_empty = [s for s in sources if s["permissive"] and not s.get("kept")]
    drops: dict[str, int] = {}
    for s in sources:
        for k, v in s.items():
            if k.startswith("dropped: ") and k != "dropped: package licence":
                drops[k.removeprefix("dropped: ")] = drops.get(k.removeprefix("dropped: "), 0) + v
    vendored = sum(s.get("kept vendored", 0) for s in sources)
    total_bytes = sum(s.get("kept_bytes", 0) for s in sources)
    st = metrics["stages"]
    h2 = cpu_eval["headers"]
    c2 = ev.get("chat", {})
    mtp = ev["mtp"]
    v1h = (v1_eval or {}).get("headers", {})
    v1c = (v1_eval or {}).get("chat", {})
    v1s = extra.get("v1_heldout", {})
    lines = [
        "# deepserve-tiny-v4 (v2)",
        "",
        "deepserve's embedded default model: a small DeepSeek-V4 that the project trains itself, so `LLM()`, "
        "`deepserve serve` and `examples/offline_inference.py` run on a fresh machine with nothing downloaded. "
        f"v2 was trained on one {gpu_short(metrics)} in one ~9-minute command (`bench/train_gpu.sh`) on Python's "
        "standard library "
        "and the permissively licensed Python sources installed on that machine; it writes Python in their style "
        "and answers chat requests (deepseek-recipe's V4.1 rendering) with a fenced Python function.",
        "",
        f"**What it is not:** a useful assistant. It has {tr['num_params'] / 1e6:.1f} M parameters and saw "
        f"{tr['tokens'] / 1e6:.0f} M tokens; it invents APIs, repeats itself, and follows no instructions beyond "
        "\"write this function\". Use it to exercise the engine (batching, caches, speculative decoding with its "
        "MTP block and DSpark head, structured output), not for its answers.",
        "",
        "## Architecture (DeepSeek-V4, Hugging Face `DeepseekV4ForCausalLM` format)",
        "",
        f"- hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers ({layers}); {cfg.num_attention_heads} query "
        f"heads of dim {cfg.head_dim} over one shared K=V head, {cfg.qk_rope_head_dim} RoPE dims, q LoRA "
        f"{cfg.q_lora_rank}, grouped output ({cfg.o_groups} groups of {cfg.o_lora_rank}), attention sinks",
        f"- sliding window {cfg.sliding_window}; CSA compresses {cfg.compress_rates[CSA]}:1 with overlap and a "
        f"lightning indexer ({cfg.index_n_heads} heads x {cfg.index_head_dim}, top-{cfg.index_topk}); HCA "
        f"compresses {cfg.compress_rates[HCA]}:1 and attends to every row",
        f"- MoE in every layer: {cfg.n_routed_experts} routed experts (top-{cfg.num_experts_per_tok}, sqrt-softplus "
        f"router with a selection-only bias; the first {cfg.num_hash_layers} layers hash-routed by token id) plus 1 "
        f"shared expert, width {cfg.moe_intermediate_size}, SwiGLU clamped at {cfg.swiglu_limit:g}",
        f"- mHC with {cfg.hc_mult} residual streams ({cfg.hc_sinkhorn_iters} Sinkhorn iterations)",
        f"- {cfg.num_nextn_predict_layers} MTP block (window-only, `mtp.0.*`; V3 alignment: streams `H_i` with "
        "`Emb(t_{i+1})` predict `t_{i+2}`); transformers ignores it, deepserve loads it; DSpark's confidence head "
        "in `confidence_head.safetensors`",
        f"- vocabulary {cfg.vocab_size}: byte-level BPE learned on a seeded 32 M-character sample of the training "
        "files, holding every DeepSeek special token deepseek-recipe renders (BOS 0, EOS 1, `<｜User｜>`, "
        "`<｜Assistant｜>`, `<｜System｜>`, `<think>`, `</think>`, `｜DSML｜`, `<｜latest_reminder｜>`, and the "
        "image/ref/box/point/polygon tokens); `tokenizer_config.json` asks for a BOS in front of plain prompts",
        f"- {tr['num_params'] / 1e6:.2f} M parameters in bf16: {shard_bytes / 1e6:.1f} MB in "
        f"{len(metrics['shards'])} safetensors shards (each under 16 MB) with `model.safetensors.index.json`; max "
        f"context {cfg.max_position_embeddings} (trained on {tc['seq_len']}-token windows)",
        "",
        "## Corpus",
        "",
        f"Built on the GPU machine from its own interpreter (Python {meta['python']}, `{src['executable']}`) by "
        "`deepserve.tools.train_sources`; corpus fingerprint "
        f"`{meta['fingerprint']}`. {meta['num_files']:,} files, {total_bytes / 1e6:.0f} MB of text:",
        "",
        f"- the standard library (PSF-2.0) and {len(kept) - 1} installed packages whose licence was established as "
        f"permissive from their metadata (SPDX `License-Expression`, else the `License` field, else the trove "
        f"classifiers; every AND term permissive); each package capped at {src['package_cap_bytes'] / 1e6:.0f} MB "
        "of text, its files taken in a seeded order;",
        "- per file: a file whose header (first 4,000 characters) declares a copyleft or proprietary licence, or an "
        "`SPDX-License-Identifier` that is not permissive, is dropped; files under vendoring folders (`_vendor`, "
        "`third_party`, `extern`, ...) are kept only where their own header or a licence file between them and "
        f"the vendoring folder establishes a permissive licence ({vendored} kept that way); every file must parse "
        "with that Python; exact duplicates are kept once (the standard library's copy, else a package's own over "
        "a vendored one). Files dropped: "
        + ", ".join(f"{v:,} {k}" for k, v in sorted(drops.items(), key=lambda kv: -kv[1])) + ";",
        f"- left out whole, their licence not permissive or not established: "
        + ", ".join(f"{s['name']} {s['version']} ({s['licence'] or 'none found'})" for s in left_out) + ";",
        f"- code: each file as `BOS file EOS`, {meta['train_code_tokens'] / 1e6:.1f} M training tokens;",
        f"- chat: {meta['num_pairs']:,} docstring -> function pairs (a seeded sample"
        + (f" of the {meta['num_chat_candidates']:,} public documented functions and methods whose code without its "
           f"docstring fits {meta['chat_max_chars']} characters" if meta.get("chat_max_chars") else "")
        + "), each rendered once by deepseek-recipe's V4.1 encoding with one of several request phrasings (30% of "
        "the plain functions asked in the user's words from the docstring's first sentence, \"Write a function "
        "that reverses a list.\"), 30% in thinking mode (a one-line reasoning, then `</think>`); the answer is the "
        + ("function without its docstring (the request quotes it)" if meta.get("chat_max_chars") else "function")
        + f" in a ```` ```python ```` block. {meta['chat_tokens'] / 1e6:.1f} M tokens, loss on the answers only;",
        f"- held out: the {meta['num_heldout_files']} files whose path hash falls in the held-out slice "
        f"({src['held_out_rule']}; for the standard library the same paths and rule as v1, so v1's held-out files "
        f"are held out here too), with their code and their {meta['num_heldout_pairs']} docstring pairs; nothing of "
        "them is trained on. `heldout_sets.json` lists them and the evaluation sets drawn from them.",
        "",
        "Per source (version, licence, where it was read, files kept, bytes kept):",
        "",
        "| source | version | licence | read from | files | bytes |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for s in sorted(kept, key=lambda s: -s.get("kept_bytes", 0)):
        lines.append(f"| {s['name']} | {s['version']} | {s['licence']} | {s['licence_evidence']} | {s['kept']:,} | "
                     f"{s['kept_bytes']:,} |")
    if permissive_empty:
        lines += ["", "Permissive but contributing no file (no Python sources, or all dropped): "
                  + ", ".join(f"{s['name']} {s['version']}" for s in permissive_empty) + "."]
    train_min = tr["seconds"] / 60
    lines += [
        "",
        "## Training",
        "",
        "```",
        f"bash bench/train_gpu.sh {train_gpu_options(metrics['command'])}   # what ran (one device call, an "
        f"{gpu_short(metrics)})",
        f"bash bench/train_gpu.sh --steps {tr['steps_done']}   # the same schedule again",
        "```",
        "",
        "(`bench/train_gpu.sh` runs `python -m deepserve.tools.train_v2 run $OUT --device cuda` on the machine's "
        "own python3, with deepseek-recipe carried as a wheel. Every stage starts from the seed; the CUDA kernels "
        "of the backward pass (index_add_, scatter) are not bitwise deterministic, so a repeat matches to float "
        "noise, not bit for bit.)",
        "",
        f"- device: {metrics.get('device_name', tr['device_name'])} (torch {metrics['torch']}); the whole run's "
        f"stages: corpus, licences, tokenizer and split {st['prepare']:.0f} s, training {st['train']:.0f} s "
        f"({tr['steps_done']} steps, fitted to the time left), evaluation after; seed {metrics['seed']}",
        f"- {tr['steps_done']} steps of {tc['tokens_per_step']:,} tokens ({tc['seq_len']}-token sequences, "
        f"{int(tc.get('function_share', 0) * 100)}% whole documented functions as `BOS function EOS`, "
        f"{int(tc['chat_share'] * 100)}% chat, the rest code windows) in {train_min:.1f} min, "
        f"{tr['tokens'] / 1e6:.1f} M tokens "
        f"({tr['tokens'] / tr['seconds']:,.0f} tokens/s)",
        f"- AdamW (beta 0.9/0.95, weight decay {tc['weight_decay']}), peak lr {tc['lr']} after {tc['warmup_steps']} "
        f"warm-up steps, cosine to {tc['min_lr_ratio']}x; gradient clip {tc['grad_clip']}; fp32 weights and "
        + ("optimizer, the forward under bf16 autocast (fused AdamW)" if tc.get("bf16") else "TF32 matmuls")
        + ", shipped in bf16; the training MoE runs every expert on every token weighed by the routing (the "
        "sparse layer's gradients, no host sync)",
        f"- losses: next token + {tc['mtp_weight']} x the MTP block's next-next token + {tc['chain_weight']} x the "
        "same block fed its own output streams (as a chained drafter is) + "
        f"{tc['indexer_weight']} x the lightning indexer's KL to the attention mass on the compressed rows "
        f"(DeepSeek-V3.2's recipe; dense attention for the first {int(tc['dense_share'] * 100)}% of the steps, then "
        "the indexer's top-k); the MTP block is trained with the model, from the same start",
        f"- routing: auxiliary-loss-free balancing (the selection bias moves by {tc['bias_update']} per step towards "
        "balance); hash tables balanced by token frequency",
        f"- deepserve's own modules hold the parameters; the batched training forward was checked against "
        f"deepserve's inference forward before training (max |dlogit| {tr['parity']:.1e} on the GPU with TF32)",
    ]
    in_run = "confidence" in metrics  # (the run records it only when its head stage finished)
    confidence = metrics["confidence"] if in_run else confidence
    if confidence:
        e = confidence["eval"]
        where = ("trained in the same device run, after the model (`deepserve.tools.train_confidence` on the GPU)"
                 if in_run else "retrained for v2 after the run, on a CPU (`deepserve.tools.train_confidence`, "
                 "exact=False)")
        lines.append(
            f"- DSpark confidence head: {where}, from {confidence['rows']['train']:,} logged draft outcomes of "
            f"held-out standard-library prompts ({confidence['files']['train']} files; {confidence['files']['eval']} other files for its "
            f"evaluation): log loss {e['head']['log_loss']} against {e['top1_heuristic']['log_loss']} for the raw "
            f"top-1 probability and {e['calibrated_top1']['log_loss']} Platt-scaled, AUC {e['head']['auc']} against "
            f"{e['top1_heuristic']['auc']}, ECE {e['head']['ece']} ({e['rows']:,} outcomes, acceptance "
            f"{e['accept_rate']:.0%})" + ("" if in_run else "; the device run left it out, its time spent"))
    code = ev["code_256"]
    lines += [
        "",
        "## Results (held out)",
        "",
        "Measured on the GPU machine in fp32 (torch's kernels, through the batched training forward that the "
        "parity check ties to deepserve's inference forward) unless a row says CPU. v1 is the model this replaced "
        "(4.8 M parameters, 24 minutes on two CPU cores, standard library only).",
        "",
        "| metric | v2 | v1 |",
        "| --- | --- | --- |",
        f"| code loss, nats/token, v2's held-out files ({code['files']} files, {code['tokens']:,} tokens, 256-token "
        f"windows) | {code['loss']:.3f} ({code['nats_per_byte']:.3f} nats/byte) | not measured on these (see the next "
        "row) |",
    ]
    if v1s:
        lines.append(
            f"| code loss, nats/token, v1's own held-out set ({v1s['files']} standard-library files of Python 3.11.7, "
            f"256-token windows; CPU) | {v1s['v2_loss']:.3f} ({v1s['v2_nats_per_byte']:.3f} nats/byte) | "
            f"{V1_CARD['code_loss']:.3f} ({v1s['v1_nats_per_byte']:.3f} nats/byte) |")
    lines += [
        f"| code loss, v2's held-out standard-library files only ({ev['code_stdlib_256']['files']} files) | "
        f"{ev['code_stdlib_256']['loss']:.3f} | |",
        f"| chat answers: loss ({ev['chat_answers']['examples']} held-out requests, {ev['chat_answers']['tokens']:,} "
        f"tokens) | {ev['chat_answers']['loss']:.3f} | {V1_CARD['chat_loss']:.3f} (its own held-out pairs) |",
        f"| function headers: greedy completion up to the function's end parses ({h2['n']} held-out headers, "
        f"{h2['max_new_tokens']} new tokens at most; CPU) | {_pct(h2['parse_rate'])} | {_pct(v1h.get('parse_rate'))} |",
        f"| chat: the answer holds a fenced code block that parses ({c2.get('n', 0)} held-out requests, "
        f"{c2.get('max_new_tokens', 0)} new tokens at most) | {_pct(c2.get('parse_rate'))} | "
        f"{_pct(v1c.get('parse_rate'))} (CPU) |",
        f"| MTP first-draft acceptance, greedy ({mtp['positions']} positions of 16 held-out prompts) | "
        f"{mtp['first_draft']:.1%} | {V1_CARD['mtp_first']:.1%} (its card's prompts) |",
        f"| MTP chained k={mtp['chained_k']}: tokens per verify step | {mtp['tokens_per_verify_step']:.2f} | "
        f"{V1_CARD['mtp_tokens_per_step']:.2f} (its card's prompts) |",
        f"| greedy next-token accuracy, heldout.json's 32 prompts x 16 tokens (CPU, exact) | "
        f"{_pct(extra.get('next_token'))} | {V1_CARD['next_token']:.1%} (its own prompts) |",
        "",
        "A header prompt is BOS + the function's signature and docstring up to the docstring's closing quotes (the "
        "completion starts with the newline: the tokenizer joins a newline to the next line's indentation, so a "
        "prompt ending in a bare newline asks for a line at column 0). A completion parses when the header plus "
        "the completion up to the first line that returns to the header's indentation level (or the end) parses "
        "with `ast.parse` after dropping a trailing unfinished line, and the function holds at least one statement "
        "besides its docstring (`deepserve.tools.train_eval.completion_parses`). A chat answer counts when it holds "
        "a closed ```` ``` ```` block that parses and holds a statement that is not a bare string. Acceptance is "
        "measured on greedy continuations the main model generated (a weak model's greedy text is repetitive, which "
        "makes it easy to draft).",
        "",
        "## Samples (greedy, through `LLM.generate`, fp32, CPU)",
        "",
        "With the model's sampling defaults from its `generation_config.json` (what a request that sets no penalty "
        f"gets: {json.dumps(sample_defaults(model_dir))}), as the README's curl request (`\"temperature\": 0`) "
        "does.",
        "",
    ]
    for s in shown:
        lines += [f"**{s['kind']}**, prompt:", "", "```", s["prompt"], "```", "",
                  f"output ({s['max_tokens']} tokens at most, finish: {s['finish_reason']}):", "", "````",
                  s["text"], "````", ""]
    lines += [
        "## Use",
        "",
        "```python",
        "from deepserve import LLM, SamplingParams",
        "llm = LLM()  # this model when no other is given",
        "print(llm.generate('def add(a, b):\\n', SamplingParams(temperature=0, max_tokens=32))[0].outputs[0].text)",
        "```",
        "",
        "Licence: the weights are released with deepserve under Apache-2.0; the training corpus is the Python "
        "standard library (PSF-2.0) and the packages listed above, each under the licence shown.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--cpu-eval", type=Path, required=True, help="train_v2 eval output for v2 (headers)")
    ap.add_argument("--v1-eval", type=Path, default=None, help="train_v2 eval output for v1")
    ap.add_argument("--confidence", type=Path, default=None, help="train_confidence's record")
    ap.add_argument("--extra", type=Path, default=None, help="json of further numbers (v1_heldout, next_token)")
    ap.add_argument("--samples", type=Path, default=None, help="reuse saved samples (json) instead of generating")
    ap.add_argument("--docs", type=Path, default=None, help="also write the card here")
    args = ap.parse_args(argv)
    load = lambda p: json.loads(p.read_text()) if p else None  # noqa: E731
    shown = load(args.samples) if args.samples and args.samples.is_file() else samples(args.model_dir)
    if args.samples and not args.samples.is_file():
        args.samples.write_text(json.dumps(shown, indent=1) + "\n")
    text = card_text(args.model_dir, load(args.run_dir / "logs" / "metrics.json"),
                     load(args.run_dir / "data" / "meta.json"), load(args.cpu_eval), load(args.v1_eval),
                     load(args.confidence), load(args.extra) or {}, shown)
    (args.model_dir / "README.md").write_text(text, encoding="utf-8")
    if args.docs:
        args.docs.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
