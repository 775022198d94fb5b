"""Train the embedded model v2 in one run: corpus, licences, tokenizer, held-out split, training (main model and
MTP block together), DSpark's confidence head, held-out evaluation against v1. Sized for one ~9-minute command on
one H200; `--smoke` runs the same stages on a CPU in a couple of minutes (a tiny corpus and model, a few steps).

    python -m deepserve.tools.train_v2 run OUT [--device cuda] [--total-budget 500] [--seed 0] [--smoke]

What OUT gets (only small files, so that a device machine can send them back): the checkpoint's safetensors shards
(`model-0000k-of-0000n.safetensors`, each under `SHARD_BYTES`) and `bundle.tar.gz` holding everything else: the
checkpoint's config, index, tokenizer, held-out samples and ids (`heldout_sets.json`) and confidence head
(`model/`), the corpus record (`corpus.json`: sources, versions, licences, the held-out file list, the evaluation
sets' ids), `metrics.json` (every held-out number, v2 and v1 side by side, stage times) and the training log,
summary and loss history.
Every stage starts from `--seed`; the training step count is fitted to the time left (the log prints it, and
`--steps` repeats it).

The corpus (`train_sources`): Python's standard library plus each package installed in the interpreter's
site-packages whose licence is established as permissive (per package and per file), each package capped at
`--package-mb` of text; a stable hash of each file's path holds ~4% of the files out (for the standard library the
same rule and paths as v1, so v1's held-out files stay held out). Evaluation sets come from held-out files only.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import random
import shutil
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import torch

from . import train_corpus as corpus
from .train_tiny import TINY_CONFIG, _logger

#: v2: 8 layers (2 window-only + hash MoE, then CSA / HCA alternating), hidden 256, 8 routed experts of width 64
#: (top-2) + 1 shared, mHC x4, one MTP block: 8.8 M parameters, 17.5 MB in bf16
V2_MODEL = dict(
    hidden_size=256, num_hidden_layers=8, num_attention_heads=4, head_dim=64, q_lora_rank=128, o_lora_rank=128,
    moe_intermediate_size=64, sliding_window=64, index_topk=16,
    layer_types=["sliding_attention", "sliding_attention"]
    + ["compressed_sparse_attention", "heavily_compressed_attention"] * 3,
)
#: the forward under bf16 autocast; of each step's sequences 40% code windows, 30% whole functions (the held-out
#: headers' task: a header, then its body up to the function's end), 30% chat
V2_TRAIN = dict(seq_len=512, tokens_per_step=65536, lr=3e-3, warmup_steps=30, chat_share=0.3, function_share=0.3,
                bf16=True)
#: chat answers: public functions and methods without their docstring, at most this many characters of code (the
#: first GPU run trained on whole library functions, docstrings and all: its answers ran on past 320 tokens and
#: never closed their fence)
CHAT_MAX_CHARS = 600
#: the smoke run: the same stages, sized for a CPU
SMOKE_MODEL = dict(
    vocab_size=1024, hidden_size=64, num_hidden_layers=4, num_attention_heads=2, head_dim=32, q_lora_rank=32,
    o_lora_rank=32, moe_intermediate_size=32, sliding_window=16, index_topk=4, index_n_heads=4, num_hash_layers=1,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                 "compressed_sparse_attention"],
)
SMOKE_TRAIN = dict(seq_len=128, tokens_per_step=1024, warmup_steps=4, function_share=0.3)
SHARD_BYTES = 15 * 10**6
V1_DIR = Path(__file__).resolve().parents[1] / "assets" / "deepserve-tiny-v4"
EVAL_FILE = "eval_sets.json"
#: what ships with the model so that its held-out numbers can be checked: the held-out files, the evaluation
#: headers and chat requests drawn from them, the held-out docstring pairs (tests/test_embedded_model.py reads it)
HELDOUT_SETS_FILE = "heldout_sets.json"
#: the README's chat request, shown in the card's samples
README_CHAT = "Write a function that reverses a list."


# -- evaluation sets ---------------------------------------------------------------------------------------------
def function_headers(f: corpus.SourceFile) -> list[dict]:
    """Headers (signature and docstring, dedented to the def line) of the documented functions and methods of one
    file whose body holds more than the docstring."""
    try:
        tree = ast.parse(f.text)
    except (SyntaxError, ValueError, RecursionError):
        return []
    lines = f.text.splitlines(keepends=True)
    out = []
    for qualname, node in corpus._documented_functions(tree):
        if ast.get_docstring(node) is None or len(node.body) < 2 or node.decorator_list:
            continue
        end = node.body[0].end_lineno
        if end - node.lineno > 40 or node.end_lineno - end > 80:
            continue
        indent = node.col_offset
        chunk = lines[node.lineno - 1 : end]
        if any(line.strip() and line[:indent].strip() for line in chunk):
            continue
        header = "".join(line[indent:] if line.strip() else "\n" for line in chunk)
        if not header.endswith("\n"):
            header += "\n"
        out.append(dict(path=f.path, qualname=qualname, header=header))
    return out


def eval_sets(files: list[corpus.SourceFile], meta: dict, tokenizer_file: Path, v1_tokenizer: Path | None,
              seed: int, num_headers: int = 100, num_chat: int = 100, max_answer_chars: int = 700) -> dict:
    """The held-out evaluation sets: `num_headers` function headers (one per file, seeded choice) and `num_chat`
    docstring -> function requests (V4.1 prompts, non-thinking), with token ids for v2 and, when given, for v1."""
    import tokenizers

    rng = random.Random(seed)
    held = [f for f in files if f.held_out]
    per_file = [hs for hs in (function_headers(f) for f in held) if hs]
    rng.shuffle(per_file)
    headers = [rng.choice(hs) for hs in per_file[:num_headers]]
    if len(headers) < num_headers:  # fewer files than headers: take more per file
        rest = [h for hs in per_file for h in hs if h not in headers]
        headers += rng.sample(rest, min(len(rest), num_headers - len(headers)))
    pairs = [p for p in meta["heldout_pairs"] if "." not in p["qualname"]]
    by_path = {f.path: f for f in held}
    chosen = []
    for p in rng.sample(pairs, len(pairs)):
        src = next((q for q in corpus.function_pairs([by_path[p["path"]]]) if q.qualname == p["qualname"]), None)
        if src is None or len(src.source) > max_answer_chars:
            continue
        chosen.append(corpus.chat_text(src, rng, thinking_share=0.0).user)
        if len(chosen) == num_chat:
            break
    toks = {"v2": tokenizer_file}
    if v1_tokenizer is not None and v1_tokenizer.is_file():
        toks["v1"] = v1_tokenizer
    sets = dict(headers=headers, chat=[dict(user=u) for u in chosen], readme_chat=README_CHAT)
    for key, path in toks.items():
        tok = tokenizers.Tokenizer.from_file(str(path))
        enc = corpus.v41_encoding(path)
        for h in headers:  # the prompt stops after the docstring's quotes: its newline starts the completion, as
            # the tokenizer joins a newline to the next line's indentation ("\n    " is one token, "\n" alone starts
            # a line at column 0)
            h[f"ids_{key}"] = [corpus.BOS, *tok.encode(h["header"].rstrip("\n"), add_special_tokens=False).ids]
        for c in sets["chat"]:
            c[f"ids_{key}"] = corpus.render_prompt(enc, c["user"], thinking=False)
        sets[f"readme_chat_ids_{key}"] = corpus.render_prompt(enc, README_CHAT, thinking=False)
    return sets


# -- the stages --------------------------------------------------------------------------------------------------
def prepare(data: Path, seed: int, vocab_size: int, package_mb: float, processes: int, smoke: bool, log) -> dict:
    from . import train_sources as ts

    sources = [ts.stdlib_source()] + ts.package_sources()
    if smoke:  # the standard library and three small permissive packages, a few files each
        small = [s for s in sources[1:] if s.licence.permissive and 3 <= len(s.files) <= 40][:3]
        sources = [sources[0], *small]
    kept = ts.collect_files(sources, int(package_mb * 1e6), seed, processes,
                            max_files_per_source=400 if smoke else None, log=log)
    files = [corpus.SourceFile(c.path, c.text) for c in kept]
    record = dict(
        python=corpus.python_version(), executable=sys.executable, sources=[s.record() for s in sources],
        package_cap_bytes=int(package_mb * 1e6), held_out_rule=f"sha1(path) % 100 < {corpus.HELD_OUT_PERCENT}",
    )
    corpus.prepare_data(data, vocab_size, seed, chat_variants=1, log=log, files=files,
                        tokenizer_chars=2_000_000 if smoke else 32_000_000, max_pairs=400 if smoke else 60_000,
                        plain_share=0.3, processes=processes, extra_meta=dict(sources=record),
                        chat_max_chars=CHAT_MAX_CHARS)
    meta = json.loads((data / corpus.META_FILE).read_text())
    sets = eval_sets(files, meta, data / "tokenizer.json", V1_DIR / "tokenizer.json", seed,
                     num_headers=8 if smoke else 100, num_chat=4 if smoke else 100)
    (data / EVAL_FILE).write_text(json.dumps(sets) + "\n")
    heldout_ids = dict(
        python=meta["python"], fingerprint=meta["fingerprint"], rule=f"sha1(path) % 100 < {corpus.HELD_OUT_PERCENT}",
        heldout_files=meta["heldout_paths"],
        headers=[dict(path=h["path"], qualname=h["qualname"], header=h["header"]) for h in sets["headers"]],
        chat=[c["user"] for c in sets["chat"]],
        chat_pairs=[dict(path=p["path"], qualname=p["qualname"]) for p in meta["heldout_pairs"]],
    )
    (data / HELDOUT_SETS_FILE).write_text(json.dumps(heldout_ids, indent=0) + "\n")
    log(f"eval sets: {len(sets['headers'])} function headers, {len(sets['chat'])} chat requests (held-out files)")
    return dict(files=files, meta=meta, sets=sets)


def save_sharded(model_dir: Path, max_bytes: int = SHARD_BYTES) -> list[Path]:
    """Split `model.safetensors` into shards of at most `max_bytes` with a `model.safetensors.index.json`
    (Hugging Face's layout, which deepserve's loader and transformers read)."""
    from safetensors.torch import load_file, save_file

    single = model_dir / "model.safetensors"
    state = load_file(str(single))
    groups, size = [[]], 0
    for name in sorted(state):
        n = state[name].numel() * state[name].element_size()
        if groups[-1] and size + n > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map = {}
    for file, group in zip(names, groups):
        save_file({k: state[k].contiguous() for k in group}, str(model_dir / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in group})
    total = sum(t.numel() * t.element_size() for t in state.values())
    (model_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1) + "\n")
    single.unlink()
    return [model_dir / n for n in names]


def _load(model_dir: Path, device: str):
    from deepserve.backends.reference import ReferenceBackend
    from deepserve.model.factory import load_model

    return load_model(model_dir, ReferenceBackend(device, exact=False), dtype="float32", progress=False)


def _stream(tokenizer_file: Path, files: list[corpus.SourceFile]) -> tuple[np.ndarray, int]:
    """BOS file EOS records of `files` under a tokenizer, and their text's UTF-8 byte count."""
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    enc = tok.encode_batch([f.text for f in files], add_special_tokens=False)
    ids = np.concatenate([np.asarray([corpus.BOS, *e.ids, corpus.EOS], dtype=np.int64) for e in enc])
    return ids, sum(len(f.text.encode()) for f in files)


def code_loss(model_dir: Path, model, files: list[corpus.SourceFile], window: int, batch: int,
              limit: int | None = None) -> dict:
    """Held-out next-token loss (nats per token, and per UTF-8 byte of the text scored)."""
    from .train_eval import batched_loss, heldout_windows

    ids, nbytes = _stream(model_dir / "tokenizer.json", files)
    windows = heldout_windows(ids, window, limit)
    res = batched_loss(model, windows, batch)
    content = len(ids) - 2 * len(files)  # tokens of text (no BOS / EOS)
    res["nats_per_byte"] = res["loss"] * content / nbytes
    res["bytes_per_token"] = nbytes / content
    res["files"] = len(files)
    return res


def _generate(model, prompts, max_new, batch, stop, check_every):
    from .train_eval import batched_greedy, incremental_greedy

    if model.backend.device.startswith("cuda"):
        return batched_greedy(model, prompts, max_new, corpus.EOS, batch, stop=stop, check_every=check_every)
    return incremental_greedy(model, prompts, max_new, corpus.EOS, stop=stop, check_every=check_every)


def header_eval(model, sets: dict, key: str, max_new: int, batch: int, tokenizer_dir: Path) -> dict:
    """Greedy completions of the held-out function headers (each prompt: BOS + the header up to its docstring's
    closing quotes) and the share whose completion up to the function's end parses (`completion_parses`)."""
    from deepserve.model.tokenizer import Tokenizer

    from .train_eval import completion_parses, function_end

    tok = Tokenizer(tokenizer_dir, model.cfg)
    headers = [dict(h, header=h["header"].rstrip("\n")) for h in sets["headers"]]

    def ended(i, ids):  # the function has ended once a line returns to the header's level
        text = tok.decode(ids)
        return function_end(headers[i]["header"], text, True) != text

    outs = _generate(model, [h[f"ids_{key}"] for h in headers], max_new, batch, ended, 16)
    rows = []
    for h, (ids, finished) in zip(headers, outs):
        text = tok.decode(ids)
        rows.append(dict(path=h["path"], qualname=h["qualname"], parses=completion_parses(h["header"], text, finished),
                         completion=text, eos=finished))
    return dict(parse_rate=sum(r["parses"] for r in rows) / len(rows), n=len(rows), max_new_tokens=max_new,
                rows=rows)


def chat_eval(model, sets: dict, key: str, max_new: int, batch: int, tokenizer_dir: Path) -> dict:
    from deepserve.model.tokenizer import Tokenizer

    from .train_eval import fenced_code_parses

    tok = Tokenizer(tokenizer_dir, model.cfg)

    def closed(i, ids):
        return tok.decode(ids).count("```") >= 2

    prompts = [c[f"ids_{key}"] for c in sets["chat"]] + [sets[f"readme_chat_ids_{key}"]]
    outs = _generate(model, prompts, max_new, batch, closed, 8)
    rows = [dict(user=c["user"], answer=tok.decode(ids), parses=fenced_code_parses(tok.decode(ids)))
            for c, (ids, _) in zip(sets["chat"], outs)]
    readme_ids, _ = outs[-1]
    return dict(parse_rate=sum(r["parses"] for r in rows) / len(rows), n=len(rows), max_new_tokens=max_new,
                rows=rows, readme_chat=dict(user=sets["readme_chat"], answer_64_tokens=tok.decode(readme_ids[:64])))


def chat_answer_loss(model, data: dict, batch: int, limit: int) -> dict:
    """NLL of the held-out chat answers (loss-masked tokens), batched through the training forward."""
    from .train_forward import Pass, main_streams

    device = model.backend.device
    ids, mask, starts = data["heldout_chat"], data["heldout_chat_mask"].astype(bool), data["heldout_chat_starts"]
    n_ex = min(limit, len(starts) - 1)
    nll, n = 0.0, 0
    with torch.inference_mode():
        for i in range(0, n_ex, batch):
            group = range(i, min(i + batch, n_ex))
            seqs = [ids[starts[j] : starts[j + 1]].astype(np.int64) for j in group]
            masks = [mask[starts[j] + 1 : starts[j + 1]] for j in group]
            L = max(len(s) for s in seqs) - 1
            x = torch.full((len(seqs), L), corpus.EOS, dtype=torch.long)
            rows, targets = [], []
            for b, (s, m) in enumerate(zip(seqs, masks)):
                x[b, : len(s) - 1] = torch.from_numpy(s[:-1])
                rows.extend(b * L + np.nonzero(m)[0])
                targets.extend(s[1:][m])
            streams = main_streams(model, x.to(device), Pass(len(seqs), L, torch.arange(L, device=device).repeat(len(seqs))))
            logits = model.logits(model.model.final_hidden(streams[torch.tensor(rows, device=device)]))
            nll += float(torch.nn.functional.cross_entropy(logits, torch.tensor(targets, device=device), reduction="sum"))
            n += len(targets)
    return dict(loss=nll / n, ppl=math.exp(nll / n), tokens=n, examples=n_ex)


def acceptance_prompts(files: list[corpus.SourceFile], num: int, seed: int, chars: int = 600) -> list[str]:
    """Held-out text snippets ending a line (about 128 tokens each), the same text for v1 and v2."""
    rng = random.Random(seed)
    pool = [f for f in files if f.held_out and len(f.text) > 4 * chars]
    out = []
    while len(out) < num and pool:
        f = rng.choice(pool)
        cut = f.text.find("\n", rng.randrange(chars, len(f.text) - chars)) + 1
        if cut > chars:
            out.append(f.text[cut - chars : cut])
    return out


def mtp_eval(model_dir: Path, model, texts: list[str], num_tokens: int = 48) -> dict:
    from deepserve.model.tokenizer import Tokenizer

    from .train_eval import mtp_acceptance

    tok = Tokenizer(model_dir, model.cfg)
    prompts = [[corpus.BOS, *tok.encode(t, add_bos=False)[-128:]] for t in texts]
    res = mtp_acceptance(model, prompts, num_tokens=num_tokens)
    res["tokens_per_verify_step"] = 1 + res["mean_accepted"]
    return res


def bundle(out: Path, work: Path) -> None:
    """Everything but the shards, in one archive (a device call brings back few files)."""
    tmp = out / "bundle.tar.gz.part"
    with tarfile.open(tmp, "w:gz") as tar:
        for p in sorted(work.rglob("*")):
            if p.is_file() and not p.name.startswith("model-") and p.name != "data.npz":
                tar.add(p, arcname=p.relative_to(work).as_posix())
    tmp.replace(out / "bundle.tar.gz")


def run(out: Path, device: str, seed: int, total_budget: float, smoke: bool, steps: int | None = None,
        package_mb: float = 4.0, processes: int | None = None, reserve: float = 250.0) -> dict:
    import os

    from .train_confidence import fit
    from .train_tiny import train_model

    t0 = time.time()
    deadline = t0 + total_budget
    out.mkdir(parents=True, exist_ok=True)
    work = out / "work" if smoke else Path("/tmp/deepserve-v2-work")
    if work.exists():
        shutil.rmtree(work)
    data_dir, model_dir, logs = work / "data", work / "model", work / "logs"
    for d in (data_dir, model_dir, logs):
        d.mkdir(parents=True)
    log = _logger(logs / "run_log.txt")
    processes = processes or max(1, min(16, os.cpu_count() or 1))
    torch.manual_seed(seed)
    stages: dict[str, float] = {}
    metrics: dict = dict(seed=seed, device=device, smoke=smoke, torch=torch.__version__, stages=stages,
                         command=" ".join(["python -m deepserve.tools.train_v2", *sys.argv[1:]]))

    def guarded(name: str, fn) -> None:
        """Run one evaluation stage; a failure is logged and recorded, and the run goes on to the next."""
        t = time.time()
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the weights are saved already; keep what the other stages give
            import traceback

            log(f"stage {name} failed: {exc!r}\n{traceback.format_exc()}")
            metrics.setdefault("failed", {})[name] = repr(exc)
        stage(name, t)
        bundle(out, work)

    def stage(name: str, t: float) -> None:
        stages[name] = round(time.time() - t, 1)
        log(f"stage {name}: {stages[name]} s (total {time.time() - t0:.0f} s)")
        (logs / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")

    t = time.time()
    vocab = (SMOKE_MODEL if smoke else TINY_CONFIG)["vocab_size"]
    prep = prepare(data_dir, seed, vocab, package_mb, processes, smoke, log)
    shutil.copy(data_dir / corpus.META_FILE, logs / "corpus.json")
    shutil.copy(data_dir / EVAL_FILE, logs / EVAL_FILE)
    stage("prepare", t)
    if device.startswith("cuda"):  # after the corpus's worker processes: CUDA starts only now
        metrics["device_name"] = torch.cuda.get_device_name()

    t = time.time()
    model_over = SMOKE_MODEL if smoke else V2_MODEL
    train_over = SMOKE_TRAIN if smoke else V2_TRAIN
    budget = None if steps else max(10.0, deadline - time.time() - reserve)
    summary = train_model(data_dir, model_dir, device, steps, budget, seed, train_over, model_over, log_dir=logs)
    shards = save_sharded(model_dir, SHARD_BYTES)
    shutil.copy(data_dir / HELDOUT_SETS_FILE, model_dir / HELDOUT_SETS_FILE)
    for s in shards:
        shutil.copy(s, out / s.name)
    metrics["train"] = {k: v for k, v in summary.items() if k != "train_config"}
    metrics["train_config"] = summary["train_config"]
    metrics["model_config"] = {**TINY_CONFIG, **model_over}
    metrics["shards"] = {s.name: s.stat().st_size for s in shards}
    stage("train", t)
    bundle(out, work)

    files = prep["files"]
    held = [f for f in files if f.held_out]
    held_std = [f for f in held if not f.path.startswith("site-packages/")]
    data, _ = corpus.load_data(data_dir)
    cuda = device.startswith("cuda")
    batch = 128 if cuda else 4  # loss windows per forward (the H200 run took 50 s for the losses at 32)
    v1 = V1_DIR if (V1_DIR / "config.json").is_file() and not smoke else None
    seq_len = summary["train_config"]["seq_len"]

    model = _load(model_dir, device)
    ev = metrics["eval"] = {}
    max_new = 256 if cuda else 24
    texts = acceptance_prompts(files, 16 if cuda else 2, seed)
    limit = None if cuda else 8

    def losses():
        ev["code"] = code_loss(model_dir, model, held, seq_len, batch, limit)
        ev["code_256"] = code_loss(model_dir, model, held, 256, batch, limit)
        ev["code_stdlib_256"] = code_loss(model_dir, model, held_std, 256, batch, limit)
        ev["chat_answers"] = chat_answer_loss(model, data, batch, 400 if cuda else 8)
        log(f"code loss {ev['code_256']['loss']:.3f} nats/token (256-token windows)")

    def generate():
        ev["headers"] = header_eval(model, prep["sets"], "v2", max_new, 100 if cuda else 8, model_dir)
        log(f"headers: {ev['headers']['parse_rate']:.0%} parse")
        ev["chat"] = chat_eval(model, prep["sets"], "v2", 320 if cuda else 24, 101 if cuda else 8, model_dir)
        log(f"chat: {ev['chat']['parse_rate']:.0%} fenced blocks parse")

    def mtp():
        ev["mtp"] = mtp_eval(model_dir, model, texts, 48 if cuda else 8)
        log(f"mtp: first draft {ev['mtp']['first_draft']:.1%}, {ev['mtp']['tokens_per_verify_step']:.2f} tokens/step")
        _write_heldout(model_dir, model, data, seed, num=4 if smoke else 32)

    def old_model():
        if deadline - time.time() < 150:  # v1's losses, generations and MTP take about as long as v2's
            raise TimeoutError(f"no time left for v1's evaluation ({deadline - time.time():.0f} s)")
        m1 = _load(v1, device)
        e1 = metrics["eval_v1"] = {}
        e1["code_256"] = code_loss(v1, m1, held, 256, batch)
        e1["code_stdlib_256"] = code_loss(v1, m1, held_std, 256, batch)
        e1["headers"] = header_eval(m1, prep["sets"], "v1", max_new, 100, v1)
        e1["chat"] = chat_eval(m1, prep["sets"], "v1", 320, 101, v1)
        e1["mtp"] = mtp_eval(v1, m1, texts, 48)
        log(f"v1: code {e1['code_256']['loss']:.3f}, headers {e1['headers']['parse_rate']:.0%}, "
            f"chat {e1['chat']['parse_rate']:.0%}, mtp {e1['mtp']['first_draft']:.1%}")

    def head():
        # before v1's evaluation (which only runs in what is left; v1's numbers are also measured on a CPU): the
        # head's outcomes from the new model are this run's to collect
        left = min(110.0, deadline - time.time() - 10)
        if left < 20 and not smoke:
            raise TimeoutError(f"no time left for the confidence head ({left:.0f} s)")
        rec = fit(model_dir, model_dir / "confidence_head.safetensors", held, device,
                  train_prompts=1536 if cuda else 16, eval_prompts=256 if cuda else 8, batch_size=128 if cuda else 8,
                  context=128 if cuda else 32, num_tokens=16 if cuda else 8, epochs=30 if cuda else 3, seed=seed,
                  time_budget=left if cuda else None, exact=False)
        (logs / "train_confidence.json").write_text(json.dumps(rec, indent=1) + "\n")
        metrics["confidence"] = {k: rec[k] for k in ("rows", "seconds", "files")}
        metrics["confidence"]["eval"] = {k: v for k, v in rec["eval"].items() if k != "by_draft"}

    guarded("eval_loss", losses)
    guarded("eval_generate", generate)
    guarded("eval_mtp", mtp)
    guarded("confidence", head)
    if v1 is not None:
        guarded("eval_v1", old_model)
    metrics["total_seconds"] = round(time.time() - t0, 1)
    (logs / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    bundle(out, work)
    log(f"done in {metrics['total_seconds']} s")
    return metrics


def _write_heldout(model_dir: Path, model, data: dict, seed: int, num: int = 32) -> None:
    """`heldout.json` for the tests: `num` held-out completion prompts (BOS + 128 tokens ending a line, 16-token
    references), the unigram token, and a parity text; plus the model's measured completion accuracy. (The
    confidence head then leaves out the files these prompts come from: the smoke run's few held-out files need
    a smaller `num` to leave it any.)"""
    import dataclasses

    from deepserve.model.tokenizer import Tokenizer

    from .train_eval import completion_accuracy, completion_prompts

    tok = Tokenizer(model_dir, model.cfg)
    newline_ids = {i for i in range(tok.vocab_size) if (tok.id_to_token(i) or "").endswith("Ċ")}
    pairs = completion_prompts(data["heldout_code"], data["heldout_doc_starts"], newline_ids, num=num, context=128,
                               continuation=16, seed=seed)
    unigram = int(np.argmax(data["token_counts"]))
    score = completion_accuracy(model, pairs, unigram)
    heldout = dict(
        unigram_token=unigram, unigram_text=tok.decode([unigram], skip_special_tokens=False),
        completion=[dict(prompt=p, reference=r) for p, r in pairs],
        parity_text=tok.decode(data["heldout_code"][1:400].astype(np.int64).tolist()),
        **dataclasses.asdict(score),
    )
    (model_dir / "heldout.json").write_text(json.dumps(heldout) + "\n")


def header_ids(sets: dict, key: str, tokenizer_file: Path) -> None:
    """(Re)tokenize the header prompts of `sets` for one tokenizer (BOS + header up to its docstring's quotes)."""
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    for h in sets["headers"]:
        h[f"ids_{key}"] = [corpus.BOS, *tok.encode(h["header"].rstrip("\n"), add_special_tokens=False).ids]


def evaluate_generation(model_dir: Path, sets_file: Path, key: str, device: str, out: Path, num_chat: int | None,
                        max_new: int = 256, chat_max_new: int = 320) -> dict:
    """The header and chat evaluations of one checkpoint on a saved `eval_sets.json` (e.g. on a CPU after a device
    run, or for v1 with `--key v1`), written to `out`."""
    sets = json.loads(sets_file.read_text())
    header_ids(sets, key, model_dir / "tokenizer.json")
    if num_chat is not None:
        sets["chat"] = sets["chat"][:num_chat]
    model = _load(model_dir, device)
    res = dict(model=str(model_dir), key=key, device=device,
               headers=header_eval(model, sets, key, max_new, 100, model_dir))
    print(f"{key}: headers {res['headers']['parse_rate']:.0%} parse", file=sys.stderr)
    if num_chat != 0:
        res["chat"] = chat_eval(model, sets, key, chat_max_new, 101, model_dir)
        print(f"{key}: chat {res['chat']['parse_rate']:.0%} parse", file=sys.stderr)
    out.write_text(json.dumps(res, indent=1) + "\n")
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="the whole run into OUT")
    r.add_argument("out", type=Path)
    r.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--total-budget", type=float, default=500.0, help="seconds for the whole run")
    r.add_argument("--reserve", type=float, default=250.0,
                   help="seconds kept for evaluation and the head (the H200 run: evaluation 137 s at loss batch 32, "
                        "the head 110)")
    r.add_argument("--steps", type=int, default=None, help="training steps (default: fit the time left)")
    r.add_argument("--package-mb", type=float, default=4.0, help="text cap per package (MB)")
    r.add_argument("--processes", type=int, default=None)
    r.add_argument("--smoke", action="store_true", help="a tiny corpus and model, for a CPU check of every stage")
    e = sub.add_parser("eval", help="the header and chat evaluations of a checkpoint on a saved eval_sets.json")
    e.add_argument("model_dir", type=Path)
    e.add_argument("eval_sets", type=Path)
    e.add_argument("out", type=Path)
    e.add_argument("--key", default="v2", help="whose prompt ids to use (v2, or v1 for the old tokenizer)")
    e.add_argument("--device", default="cpu")
    e.add_argument("--num-chat", type=int, default=None, help="chat requests to run (default all; 0: none)")
    args = ap.parse_args(argv)
    if args.cmd == "eval":
        evaluate_generation(args.model_dir, args.eval_sets, args.key, args.device, args.out, args.num_chat)
        return
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda, but torch sees no GPU")
    if args.smoke and args.steps is None:
        args.steps = 6
    run(args.out, args.device, args.seed, args.total_budget, args.smoke, args.steps, args.package_mb, args.processes,
        args.reserve)


if __name__ == "__main__":
    main()
