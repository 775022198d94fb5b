"""Evaluation of the embedded model through deepserve's own inference path (fresh `SequenceState`s, varlen
batches, `torch.inference_mode`): held-out loss, greedy completion accuracy against a unigram baseline, and the
MTP block's draft acceptance as a speculative decoder would see it.

Acceptance is measured on greedy continuations y of held-out prompts, which the main model generated itself, so
`y[i+2]` is exactly what greedy verification accepts after `y[i+1]`:
- first draft: the MTP's argmax from (`H_i`, `y[i+1]`) equals `y[i+2]`;
- chained k=5: from position i, draft d1..d5 by feeding the MTP block its own output streams and its own previous
  draft; the accepted length is the number of leading drafts that equal y[i+2..i+6] (0..5). Each position starts
  from the MTP window state of the true prefix (the state is copied, drafted into and thrown away).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from deepserve.model.batch import make_batch
from deepserve.model.deepseek_v4 import DeepseekV4ForCausalLM

from .train_corpus import BOS


def heldout_windows(tokens: np.ndarray, length: int, limit: int | None = None) -> list[list[int]]:
    """Non-overlapping windows of the held-out stream, each starting with BOS (prepended where it starts
    inside a file), as the training windows do."""
    out = []
    for start in range(0, len(tokens) - 1, length - 1):
        w = tokens[start : start + length - 1].astype(np.int64).tolist()
        if len(w) < 16:
            break
        out.append(w if w[0] == BOS else [BOS, *w])
        if limit is not None and len(out) >= limit:
            break
    return out


@torch.inference_mode()
def heldout_loss(model: DeepseekV4ForCausalLM, windows: Sequence[Sequence[int]], batch_size: int = 4) -> dict:
    """Mean next-token NLL (nats) over every target of every window, and the MTP's next-next-token NLL and
    top-1 accuracy on the true text."""
    device = model.backend.device
    nll = mtp_nll = 0.0
    n = mtp_n = mtp_hits = 0
    for i in range(0, len(windows), batch_size):
        group = windows[i : i + batch_size]
        states = [model.make_state() for _ in group]
        inputs = [w[:-1] for w in group]
        out = model(make_batch(inputs, [0] * len(group), device, logits_rows=[range(len(x)) for x in inputs]), states)
        targets = torch.tensor([t for w in group for t in w[1:]], device=device)
        nll += float(torch.nn.functional.cross_entropy(out.logits, targets, reduction="sum"))
        n += len(targets)
        if model.mtp:
            rows, toks, tgts, off = [], [], [], 0
            for w in group:
                L = len(w) - 1
                rows.extend(range(off, off + L - 1))
                toks.append(w[1:-1])
                tgts.extend(w[2:])
                off += L
            mb = make_batch(toks, [0] * len(group), device, logits_rows=[range(len(t)) for t in toks])
            mo = model.mtp_forward(0, mb, states, out.streams[torch.tensor(rows, device=device)])
            t2 = torch.tensor(tgts, device=device)
            mtp_nll += float(torch.nn.functional.cross_entropy(mo.logits, t2, reduction="sum"))
            mtp_hits += int((mo.logits.argmax(-1) == t2).sum())
            mtp_n += len(t2)
    res = dict(loss=nll / n, ppl=math.exp(nll / n), tokens=n)
    if mtp_n:
        res.update(mtp_loss=mtp_nll / mtp_n, mtp_top1=mtp_hits / mtp_n)
    return res


def completion_prompts(tokens: np.ndarray, doc_starts: np.ndarray, newline_ids: set[int], num: int,
                       context: int, continuation: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, reference) pairs cut from held-out files at line starts: BOS + `context` tokens, then the next
    `continuation` tokens of the file."""
    rng = np.random.default_rng(seed)
    ends = np.append(doc_starts[1:], len(tokens))
    out, tries = [], 0
    while len(out) < num and tries < 10_000 * num:
        tries += 1
        d = int(rng.integers(0, len(doc_starts)))
        a, b = int(doc_starts[d]) + 1, int(ends[d]) - 1  # inside the file, without its BOS / EOS
        if b - a < context + continuation + 1:
            continue
        cut = int(rng.integers(a + context, b - continuation))
        if int(tokens[cut - 1]) not in newline_ids:  # the prompt ends a line
            continue
        ctx = tokens[cut - context : cut].astype(np.int64).tolist()
        ref = tokens[cut : cut + continuation].astype(np.int64).tolist()
        out.append(([BOS, *ctx], ref))
    return out


@torch.inference_mode()
def greedy_generate(model: DeepseekV4ForCausalLM, prompts: Sequence[Sequence[int]], num_tokens: int,
                    keep_streams: bool = False):
    """Greedy continuations of every prompt, decoded together in varlen batches. With `keep_streams`, also
    return each sequence's final mHC streams for every position of prompt + continuation except the last."""
    device = model.backend.device
    states = [model.make_state() for _ in prompts]
    out = model(make_batch(list(prompts), [0] * len(prompts), device), states)
    streams = [[s] for s in _split(out.streams, [len(p) for p in prompts])] if keep_streams else None
    gen = [[int(t)] for t in out.logits.argmax(-1).tolist()]
    for _ in range(num_tokens - 1):
        starts = [len(p) + len(g) - 1 for p, g in zip(prompts, gen)]
        out = model(make_batch([[g[-1]] for g in gen], starts, device), states)
        if keep_streams:
            for s, row in zip(streams, out.streams):
                s.append(row[None])
        for g, t in zip(gen, out.logits.argmax(-1).tolist()):
            g.append(int(t))
    if keep_streams:
        return gen, [torch.cat(s) for s in streams]
    return gen


def _split(rows: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
    return list(torch.split(rows, list(lengths)))


@dataclass(frozen=True, slots=True)
class CompletionScore:
    """Token accuracy on held-out continuations. `model_accuracy`: free-running greedy completion, compared
    position by position with the real continuation (one early miss can misalign the rest). `next_token_accuracy`:
    the greedy (argmax) prediction of each continuation token given the real text before it. `unigram_accuracy`:
    always predicting the corpus's most frequent token (the same for both readings)."""

    model_accuracy: float
    next_token_accuracy: float
    unigram_accuracy: float
    num_prompts: int
    num_tokens: int


@torch.inference_mode()
def completion_accuracy(model: DeepseekV4ForCausalLM, pairs, unigram_token: int) -> CompletionScore:
    n = len(pairs[0][1])
    gen = greedy_generate(model, [p for p, _ in pairs], n)
    hits = sum(int(g == r) for (_, ref), out in zip(pairs, gen) for g, r in zip(out, ref))
    full = [list(p) + list(r) for p, r in pairs]
    rows = [range(len(p) - 1, len(p) - 1 + len(r)) for p, r in pairs]
    out = model(make_batch(full, [0] * len(full), model.backend.device, logits_rows=rows),
                [model.make_state() for _ in full])
    truth = torch.tensor([t for _, r in pairs for t in r], device=out.logits.device)
    next_hits = int((out.logits.argmax(-1) == truth).sum())
    base = sum(int(r == unigram_token) for _, ref in pairs for r in ref)
    total = len(pairs) * n
    return CompletionScore(hits / total, next_hits / total, base / total, len(pairs), total)


@torch.inference_mode()
def mtp_acceptance(model: DeepseekV4ForCausalLM, prompts: Sequence[Sequence[int]], num_tokens: int, k: int = 5) -> dict:
    """First-draft acceptance and mean accepted length of chained k-token drafts (see the module docstring)."""
    device = model.backend.device
    gens, streams = greedy_generate(model, prompts, num_tokens, keep_streams=True)
    first_hits = first_n = 0
    accepted: list[int] = []
    for prompt, gen, H in zip(prompts, gens, streams):
        seq = list(prompt) + gen  # H has a row for every position but the last
        P = len(prompt)
        state = model.make_state()
        # true prefix: rows i = 0 .. P-2 pair H_i with seq[i+1]
        model.mtp_forward(0, make_batch([seq[1:P]], [0], device), [state], H[: P - 1])
        for i in range(P - 1, len(seq) - 2):
            out = model.mtp_forward(0, make_batch([[seq[i + 1]]], [i], device), [state], H[i : i + 1])
            draft = int(out.logits.argmax(-1))
            first_hits += int(draft == seq[i + 2])
            first_n += 1
            if i + 1 + k >= len(seq):
                continue
            saved = (copy.deepcopy(state.mtp_layers), state.mtp_num_tokens)
            length, prev, tok = 0, out.streams, draft
            for j in range(k):
                if tok != seq[i + 2 + j]:
                    break
                length += 1
                if j == k - 1:
                    break
                nxt = model.mtp_forward(0, make_batch([[tok]], [i + 1 + j], device), [state], prev)
                prev, tok = nxt.streams, int(nxt.logits.argmax(-1))
            accepted.append(length)
            state.mtp_layers, state.mtp_num_tokens = saved
    return dict(first_draft=first_hits / first_n, chained_k=k, mean_accepted=float(np.mean(accepted)),
                positions=first_n, chained_positions=len(accepted))


# -- v2: batched evaluation through the training forward ----------------------------------------------------------
# The training forward (`train_forward`) is checked against deepserve's inference forward before every training
# run (max |dlogit| in the card), and is one batched pass per step instead of a loop over sequences, so the
# evaluations below that generate hundreds of tokens for hundreds of prompts use it.

@torch.inference_mode()
def batched_loss(model: DeepseekV4ForCausalLM, windows: Sequence[Sequence[int]], batch_size: int = 32) -> dict:
    """Mean next-token NLL (nats) over every target of every window (each from position 0), batched through the
    training forward; windows of one batch are right-padded (causal attention: padding never reaches a target)."""
    from .train_forward import Pass, main_streams

    device = model.backend.device
    nll, n = 0.0, 0
    for i in range(0, len(windows), batch_size):
        group = windows[i : i + batch_size]
        L = max(len(w) for w in group) - 1
        ids = torch.full((len(group), L), BOS, dtype=torch.long)
        rows, targets = [], []
        for b, w in enumerate(group):
            ids[b, : len(w) - 1] = torch.tensor(w[:-1])
            rows.extend(range(b * L, b * L + len(w) - 1))
            targets.extend(w[1:])
        streams = main_streams(model, ids.to(device), Pass(len(group), L, torch.arange(L, device=device).repeat(len(group))))
        rows_t = torch.tensor(rows, device=device)
        logits = model.logits(model.model.final_hidden(streams[rows_t]))
        nll += float(torch.nn.functional.cross_entropy(logits, torch.tensor(targets, device=device), reduction="sum"))
        n += len(targets)
    return dict(loss=nll / n, ppl=math.exp(nll / n), tokens=n)


@torch.inference_mode()
def incremental_greedy(model: DeepseekV4ForCausalLM, prompts: Sequence[Sequence[int]], max_new: int, eos: int,
                       stop=None, check_every: int = 16) -> list[tuple[list[int], bool]]:
    """`batched_greedy`'s results through deepserve's inference path (each sequence's own caches, one token a step,
    finished sequences leave the batch): far less work than recomputing, for a CPU."""
    device = model.backend.device
    states = [model.make_state() for _ in prompts]
    out = model(make_batch([list(p) for p in prompts], [0] * len(prompts), device), states)
    gens: list[list[int]] = [[] for _ in prompts]
    ended = [False] * len(prompts)
    nxt = out.logits.argmax(-1).tolist()
    live = list(range(len(prompts)))
    for step in range(max_new):
        for b, t in zip(live, nxt):
            if t == eos:
                ended[b] = True
            else:
                gens[b].append(int(t))
        if stop is not None and (step + 1) % check_every == 0:
            for b in live:
                if not ended[b] and stop(b, gens[b]):
                    ended[b] = True
        live = [b for b in live if not ended[b]]
        if not live or step == max_new - 1:
            break
        out = model(make_batch([[gens[b][-1]] for b in live], [len(prompts[b]) + len(gens[b]) - 1 for b in live],
                               device), [states[b] for b in live])
        nxt = out.logits.argmax(-1).tolist()
    return [(g, e) for g, e in zip(gens, ended)]


@torch.inference_mode()
def batched_greedy(model: DeepseekV4ForCausalLM, prompts: Sequence[Sequence[int]], max_new: int, eos: int,
                   batch_size: int = 64, stop=None, check_every: int = 16) -> list[tuple[list[int], bool]]:
    """Greedy continuations (token ids, ended by `eos`) of every prompt, batched through the training forward
    (the whole sequence recomputed every step; right-padded, so each row reads its own last position).
    `stop(i, ids)`, checked every `check_every` steps, ends prompt i early (e.g. once its function has ended)."""
    from .train_forward import Pass, main_streams

    device = model.backend.device
    results: list[tuple[list[int], bool]] = []
    for start in range(0, len(prompts), batch_size):
        group = [list(p) for p in prompts[start : start + batch_size]]
        gens: list[list[int]] = [[] for _ in group]
        ended = [False] * len(group)
        live = list(range(len(group)))
        for step in range(max_new):
            if not live:
                break
            seqs = [group[b] + gens[b] for b in live]
            L = max(len(s) for s in seqs)
            ids = torch.full((len(seqs), L), eos, dtype=torch.long)
            for r, s in enumerate(seqs):
                ids[r, : len(s)] = torch.tensor(s)
            streams = main_streams(model, ids.to(device), Pass(len(seqs), L, torch.arange(L, device=device).repeat(len(seqs))))
            rows = torch.tensor([r * L + len(s) - 1 for r, s in enumerate(seqs)], device=device)
            nxt = model.logits(model.model.final_hidden(streams[rows])).argmax(-1).tolist()
            for b, t in zip(live, nxt):
                if t == eos:
                    ended[b] = True
                else:
                    gens[b].append(int(t))
            if stop is not None and (step + 1) % check_every == 0:
                for b in live:
                    if not ended[b] and stop(start + b, gens[b]):
                        ended[b] = True
            live = [b for b in live if not ended[b]]
        results.extend((g, e) for g, e in zip(gens, ended))
    return results


def function_end(header: str, completion: str, finished: bool) -> str:
    """The issue's cut of a completion: up to the first non-blank line that returns to the header's indentation
    level (the function has ended), else the whole completion less a trailing unfinished line (one that the
    generation's token limit cut off; a completion that ended with EOS is whole). When the header does not end
    with a newline (the prompt stops after the docstring's closing quotes), the completion's first piece finishes
    the header's last line and is never a line of its own."""
    indent = len(header) - len(header.lstrip(" "))
    lines = completion.split("\n")
    first = 0 if header.endswith("\n") else 1
    for i, line in enumerate(lines[first:], first):
        if line.strip() and len(line) - len(line.lstrip(" ")) <= indent:
            return "\n".join(lines[:i])
    return completion if finished else "\n".join(lines[:-1])


def completion_parses(header: str, completion: str, finished: bool) -> bool:
    """Whether header + `function_end(...)` parses with `ast.parse` and the function holds at least one statement
    besides its docstring (comments are no statements, so a completion of comments alone fails)."""
    import ast
    import textwrap
    import warnings

    code = textwrap.dedent(header + function_end(header, completion, finished))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    fn = next((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None)
    if fn is None:
        return False
    doc = 1 if ast.get_docstring(fn, clean=False) is not None else 0
    return len(fn.body) > doc


_FENCE = None


def fenced_code_parses(answer: str) -> bool:
    """Whether a chat answer holds a closed ```` ```python ```` (or bare ```` ``` ````) block that parses with
    `ast.parse` and holds at least one statement that is not a bare string."""
    import ast
    import re
    import warnings

    global _FENCE
    if _FENCE is None:
        _FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)
    for block in _FENCE.findall(answer):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tree = ast.parse(block)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            continue
        if any(not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)) for s in tree.body):
            return True
    return False
