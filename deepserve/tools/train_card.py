"""Evaluate a trained `deepserve-tiny-v4` checkpoint through deepserve and write its model card (`README.md`)
plus `heldout.json`, the held-out samples the card's numbers and the tests use."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import torch

from deepserve.backends.reference import ReferenceBackend
from deepserve.core.config import CSA, HCA, SLIDING

from . import train_corpus as corpus
from .train_eval import completion_accuracy, completion_prompts, heldout_loss, heldout_windows, mtp_acceptance

HELDOUT_FILE = "heldout.json"
CODE_SAMPLES = (
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    'import os\n\n\ndef list_python_files(directory):\n    """Return the paths of the .py files under directory."""\n',
)
CHAT_SAMPLE = corpus.CARD_CHAT_REQUEST


def evaluate(out: Path, data_dir: Path, device: str = "cpu", num_windows: int | None = None, seed: int = 0,
             window: int = 256) -> dict:
    """Every number of the card, measured on the checkpoint in `out` in fp32 with deepserve's reference ops.
    Held-out text is scored in windows of `window` tokens (the training length)."""
    from deepserve.model.factory import load_model
    from deepserve.model.tokenizer import Tokenizer

    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
    data, meta = corpus.load_data(data_dir)
    model = load_model(out, ReferenceBackend(device), dtype="float32", progress=False)
    tok = Tokenizer(out, model.cfg)
    t0 = time.time()
    windows = heldout_windows(data["heldout_code"], window, num_windows)
    batch = 16 if device.startswith("cuda") else 4
    code = heldout_loss(model, windows, batch)
    chat = _chat_answer_loss(model, data, batch)
    newline_ids = {i for i in range(tok.vocab_size) if (tok.id_to_token(i) or "").endswith("Ċ")}
    pairs = completion_prompts(data["heldout_code"], data["heldout_doc_starts"], newline_ids, num=32, context=128,
                               continuation=16, seed=seed)
    unigram = int(np.argmax(data["token_counts"]))
    score = completion_accuracy(model, pairs, unigram)
    accept = mtp_acceptance(model, [p for p, _ in pairs[:16]], num_tokens=48)
    heldout = dict(
        unigram_token=unigram, unigram_text=tok.decode([unigram], skip_special_tokens=False),
        completion=[dict(prompt=p, reference=r) for p, r in pairs],
        parity_text=tok.decode(data["heldout_code"][1:400].astype(np.int64).tolist()),
        model_accuracy=score.model_accuracy, unigram_accuracy=score.unigram_accuracy,
    )
    (out / HELDOUT_FILE).write_text(json.dumps(heldout) + "\n")
    return dict(code=code, chat=chat, completion=dataclasses.asdict(score), acceptance=accept,
                seconds=time.time() - t0, eval_device=device, window=window)


@torch.inference_mode()
def _chat_answer_loss(model, data, batch: int) -> dict:
    """NLL of the assistant answers (the masked tokens) of the held-out chat examples, prompt as context."""
    from deepserve.model.batch import make_batch

    device = model.backend.device
    ids, mask, starts = data["heldout_chat"], data["heldout_chat_mask"].astype(bool), data["heldout_chat_starts"]
    nll, n = 0.0, 0
    for i in range(0, len(starts) - 1, 2 * batch):
        group = range(i, min(i + 2 * batch, len(starts) - 1))
        seqs = [ids[starts[j] : starts[j + 1]].astype(np.int64).tolist() for j in group]
        masks = [mask[starts[j] + 1 : starts[j + 1]] for j in group]
        states = [model.make_state() for _ in seqs]
        out = model(make_batch([s[:-1] for s in seqs], [0] * len(seqs), device,
                               logits_rows=[range(len(s) - 1) for s in seqs]), states)
        targets = torch.tensor([t for s in seqs for t in s[1:]], device=device)
        keep = torch.tensor(np.concatenate(masks), device=device)
        loss = torch.nn.functional.cross_entropy(out.logits, targets, reduction="none")
        nll += float(loss[keep].sum())
        n += int(keep.sum())
    return dict(loss=nll / n, ppl=float(np.exp(nll / n)), tokens=n)


def samples(out: Path, chat_prompt_ids: list[int], max_tokens: int = 96) -> list[dict]:
    """Greedy completions through the public API (`LLM.generate`), fp32."""
    from deepserve import LLM, SamplingParams

    llm = LLM(model=str(out), dtype="float32", load_plugins=False)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    prompts = [*CODE_SAMPLES, {"prompt_token_ids": chat_prompt_ids}]
    results = llm.generate(prompts, params, use_tqdm=False)
    shown = [*CODE_SAMPLES, CHAT_SAMPLE]
    return [dict(prompt=p, kind="chat (V4.1, non-thinking)" if i == 2 else "completion", text=r.outputs[0].text,
                 finish_reason=r.outputs[0].finish_reason) for i, (p, r) in enumerate(zip(shown, results))]


def _fmt_params(n: int) -> str:
    return f"{n / 1e6:.1f} M"


def write_card(out: Path, data_dir: Path, command: str | None = None, log_dir: Path | None = None,
               device: str = "cpu", num_windows: int | None = None, reuse_eval: bool = False) -> dict:
    """Evaluate (or, with `reuse_eval`, read the last evaluation from `log_dir`) and write `out/README.md`."""
    from deepserve.core.config import ModelConfig

    log_dir = log_dir or out
    summary = json.loads((log_dir / "train_tiny_summary.json").read_text())
    meta = json.loads((data_dir / corpus.META_FILE).read_text())
    if reuse_eval:
        results = json.loads((log_dir / "train_tiny_eval.json").read_text())
    else:
        results = evaluate(out, data_dir, device, num_windows, window=summary["train_config"]["seq_len"])
        results["samples"] = samples(out, meta["card_chat_prompt_ids"])
        (log_dir / "train_tiny_eval.json").write_text(json.dumps(results, indent=1) + "\n")
    cfg = ModelConfig.from_file(out)
    (out / "README.md").write_text(_card_text(cfg, summary, meta, results, command, out), encoding="utf-8")
    return results


def _card_text(cfg, summary, meta, r, command, out: Path) -> str:
    kinds = {SLIDING: "window-only", CSA: "CSA", HCA: "HCA"}
    layers = ", ".join(f"{i}: {kinds[t]}{' + hash MoE' if m == 'hash_moe' else ''}"
                       for i, (t, m) in enumerate(zip(cfg.layer_types, cfg.mlp_layer_types)))
    size_mb = (out / "model.safetensors").stat().st_size / 1e6
    tc = summary["train_config"]
    acc = r["acceptance"]
    comp = r["completion"]
    cmd = command or "python -m deepserve.tools.train_tiny all"
    lines = [
        "# deepserve-tiny-v4",
        "",
        "deepserve's embedded default model: a small DeepSeek-V4 that the project trains itself, so `LLM()`, "
        "`deepserve serve` and `examples/offline_inference.py` run on a fresh machine with nothing downloaded. "
        "It writes Python in the style of the standard library it was trained on, and answers chat requests "
        "(deepseek-recipe's V4.1 rendering) with a fenced Python function.",
        "",
        "**What it is not:** a useful assistant. It has "
        f"{_fmt_params(summary['num_params'])} parameters and saw {summary['tokens'] / 1e6:.0f} M tokens of one "
        "code base; it invents APIs, loses track of long functions, knows no natural language beyond docstrings "
        "and follows no instructions beyond \"write this function\". Use it to exercise the engine (batching, "
        "caches, speculative decoding with its MTP block, structured output), not for its answers.",
        "",
        "## Architecture (DeepSeek-V4, Hugging Face `DeepseekV4ForCausalLM` format)",
        "",
        f"- hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers ({layers}); "
        f"{cfg.num_attention_heads} query heads of dim {cfg.head_dim} over one shared K=V head, "
        f"{cfg.qk_rope_head_dim} RoPE dims, q LoRA {cfg.q_lora_rank}, grouped output ({cfg.o_groups} groups of "
        f"{cfg.o_lora_rank}), attention sinks",
        f"- sliding window {cfg.sliding_window}; CSA compresses {cfg.compress_rates[CSA]}:1 with overlap and a "
        f"lightning indexer ({cfg.index_n_heads} heads x {cfg.index_head_dim}, top-{cfg.index_topk}); HCA compresses "
        f"{cfg.compress_rates[HCA]}:1 and attends to every row",
        f"- MoE in every layer: {cfg.n_routed_experts} routed experts (top-{cfg.num_experts_per_tok}, sqrt-softplus "
        f"router with a selection-only bias; the first {cfg.num_hash_layers} layers hash-routed by token id) plus "
        f"1 shared expert, width {cfg.moe_intermediate_size}, SwiGLU clamped at {cfg.swiglu_limit:g}",
        f"- mHC with {cfg.hc_mult} residual streams ({cfg.hc_sinkhorn_iters} Sinkhorn iterations)",
        f"- {cfg.num_nextn_predict_layers} MTP block (window-only, `mtp.0.*`; V3 alignment: streams `H_i` with "
        "`Emb(t_{i+1})` predict `t_{i+2}`); transformers ignores it, deepserve loads it",
        f"- vocabulary {cfg.vocab_size}: byte-level BPE learned on the training files, holding every DeepSeek "
        "special token deepseek-recipe renders (BOS 0, EOS 1, `<｜User｜>`, `<｜Assistant｜>`, `<｜System｜>`, "
        "`<think>`, `</think>`, `｜DSML｜`, `<｜latest_reminder｜>`, and the image/ref/box/point/polygon tokens); "
        "`tokenizer_config.json` asks for a BOS in front of plain prompts",
        f"- {_fmt_params(summary['num_params'])} parameters, stored in bf16 ({size_mb:.1f} MB); max context "
        f"{cfg.max_position_embeddings} (trained on {tc['seq_len']}-token windows)",
        "",
        "## Corpus",
        "",
        f"Python {meta['python']}'s own standard library (PSF licence), {meta['num_files']} `.py` files including its "
        "tests (data-only folders `encodings/` and `pydoc_data/` left out), corpus fingerprint "
        f"`{meta['fingerprint']}`:",
        f"- code: each file as `BOS file EOS`, {meta['train_code_tokens'] / 1e6:.2f} M training tokens;",
        f"- chat: {meta['num_pairs']} docstring -> function pairs (functions and methods with a docstring), each "
        f"rendered {meta['chat_variants']} times by deepseek-recipe's V4.1 encoding with one of several request "
        "phrasings, 30% in thinking mode (a one-line reasoning, then `</think>`); the answer is the function in a "
        f"```` ```python ```` block. {meta['chat_tokens'] / 1e6:.2f} M tokens, loss on the answers only;",
        f"- held out: the {meta['num_heldout_files']} files (~{corpus.HELD_OUT_PERCENT}%) whose path hash falls in "
        "the held-out slice, with their code and their docstring pairs; nothing of them is trained on.",
        "",
        "A different Python version gives a slightly different corpus; the fingerprint tells.",
        "",
        "## Training",
        "",
        "```",
        cmd,
        "```",
        "",
        f"- device: {summary['device_name']} (torch {summary['torch']}); {summary['steps_done']} steps of "
        f"{tc['tokens_per_step']} tokens ({tc['seq_len']}-token sequences, {int(tc['chat_share'] * 100)}% chat) in "
        f"{summary['seconds'] / 60:.1f} min, {summary['tokens'] / 1e6:.1f} M tokens; seed {summary['seed']}",
        f"- AdamW (beta 0.9/0.95, weight decay {tc['weight_decay']}), peak lr {tc['lr']} after {tc['warmup_steps']} "
        f"warm-up steps, cosine to {tc['min_lr_ratio']}x; gradient clip {tc['grad_clip']}; fp32 weights, shipped "
        "in bf16",
        f"- losses: next token + {tc['mtp_weight']} x the MTP block's next-next token + {tc['chain_weight']} x the "
        "same block fed its own output streams (as a chained drafter is) + "
        f"{tc['indexer_weight']} x the lightning indexer's KL to the attention mass on the compressed rows "
        f"(DeepSeek-V3.2's recipe; dense attention for the first {int(tc['dense_share'] * 100)}% of the steps, "
        "then the indexer's top-k)",
        "- routing: auxiliary-loss-free balancing (the selection bias moves by "
        f"{tc['bias_update']} per step towards balance); hash tables balanced by token frequency",
        "- deepserve's own modules (`deepserve.model`) hold the parameters, so the checkpoint has the engine's "
        "canonical names; `deepserve.tools.train_forward` runs them batched over whole sequences, and before "
        f"training it was checked against deepserve's inference forward (max |dlogit| {summary.get('parity', 0):.1e})",
        "",
        "## Results (held out, fp32, measured through deepserve's inference path)",
        "",
        "| metric | value |",
        "| --- | --- |",
        f"| code: next-token loss / perplexity ({r['code']['tokens']:,} tokens, {r.get('window', 256)}-token "
        "windows) | "
        f"{r['code']['loss']:.3f} nats / "
        f"{r['code']['ppl']:.2f} |",
        f"| chat answers: loss / perplexity ({r['chat']['tokens']:,} tokens) | {r['chat']['loss']:.3f} / "
        f"{r['chat']['ppl']:.2f} |",
        f"| MTP next-next token on the true text: loss / top-1 | {r['code']['mtp_loss']:.3f} / "
        f"{r['code']['mtp_top1']:.1%} |",
        f"| greedy next-token accuracy on held-out continuations ({comp['num_prompts']} prompts x "
        f"{comp['num_tokens'] // comp['num_prompts']} tokens, real text as context) | "
        f"{comp['next_token_accuracy']:.1%} "
        f"(unigram baseline {comp['unigram_accuracy']:.1%}) |",
        f"| free-running greedy completion of the same prompts, position-wise token accuracy | "
        f"{comp['model_accuracy']:.1%} (unigram baseline {comp['unigram_accuracy']:.1%}) |",
        f"| MTP draft acceptance, greedy, first draft token ({acc['positions']} positions) | "
        f"{acc['first_draft']:.1%} |",
        f"| MTP chained k={acc['chained_k']}: mean accepted drafts per step (0-{acc['chained_k']}) | "
        f"{acc['mean_accepted']:.2f} (so {1 + acc['mean_accepted']:.2f} tokens per verify step) |",
        "",
        "Acceptance is measured on greedy continuations the main model generated from held-out prompts: the first "
        "draft is accepted when the MTP's argmax from (`H_i`, `y_{i+1}`) equals the main model's greedy `y_{i+2}`; "
        "a chained draft feeds the MTP block its own output streams and previous draft, and counts the leading "
        "drafts that greedy verification keeps. A weak model's greedy text is repetitive, which makes its own "
        "continuations easy to draft; on the real held-out text the MTP's next-next-token top-1 is the lower figure "
        "in the table. `heldout.json` holds the completion prompts and a parity text that the tests use.",
        "",
        "## Samples (greedy, through `LLM.generate`)",
        "",
    ]
    for s in r["samples"]:
        lines += [f"**{s['kind']}**, prompt:", "", "```", s["prompt"].rstrip("\n"), "```", "", "output:", "", "```",
                  s["text"].rstrip("\n"), "```", ""]
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
        "standard library, under the PSF licence.",
        "",
    ]
    return "\n".join(lines)
