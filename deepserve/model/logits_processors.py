"""Per-request logits processing before sampling, on the device: bad words, `logit_bias`, and the presence,
frequency and repetition penalties (vLLM's semantics and order; see `SamplingParams`).

The runner calls `process_logits` on a step's sampled rows after `min_tokens`' blocked ids and before the
grammar mask and `Backend.sample`. Rows whose request sets none of these options are not touched and a step
without such rows returns its logits as they came (one pass over the chunks' parameters on the host). Every
operation is per row and elementwise or an integer count, so a row's result depends on its own request only
(batch-invariant wherever the logits are) and involves no randomness.

A request's output so far is the `output_token_ids` its chunk carries (what the host knew when it planned the
step) followed by the chunk's `PLACEHOLDER` tokens, which the previous step sampled and the runner has already
filled in the batch's token ids on the device: nothing waits for the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from deepserve.core.interfaces import PLACEHOLDER, ChunkInput


def process_logits(logits: Tensor, chunks: Sequence[ChunkInput], batch_token_ids: Tensor,
                   offsets: Sequence[int]) -> Tensor:
    """`logits` [B, V] of the sampled rows of `chunks` (row b is `chunks[b]`'s last position; a gathered copy
    the caller no longer needs otherwise, so it may be changed in place) with each request's logits
    processing applied. `batch_token_ids`: the step's flattened token ids on the device, placeholders filled;
    `offsets[b]`: where `chunks[b]`'s tokens start in it."""
    rows = [b for b, c in enumerate(chunks) if c.params.uses_logits_processors]
    if not rows:
        return logits
    device, vocab = logits.device, logits.shape[1]
    picked = [chunks[b] for b in rows]
    index = torch.tensor(rows, dtype=torch.long, device=device)
    sub = logits.index_select(0, index).to(torch.float32)
    history = _history(picked, [offsets[b] for b in rows], batch_token_ids, vocab) \
        if any(c.params.reads_output_history for c in picked) else None
    _ban_bad_words(sub, picked, history)
    _add_logit_bias(sub, picked)
    if history is not None:
        _penalize(sub, picked, history[0])
    return logits.index_copy(0, index, sub.to(logits.dtype))


def _history(chunks: Sequence[ChunkInput], offsets: Sequence[int], batch_token_ids: Tensor, vocab: int) \
        -> tuple[Tensor, list[int]]:
    """(each row's output tokens [R, L] int64, padded with `vocab` past its length; the lengths)."""
    known = [list(c.output_token_ids) for c in chunks]
    pending = [[off + j for j, t in enumerate(c.token_ids) if t == PLACEHOLDER] for c, off in zip(chunks, offsets)]
    lengths = [len(k) + len(p) for k, p in zip(known, pending)]
    width = max(max(lengths), 1)
    device = batch_token_ids.device
    ids = torch.tensor([k + [vocab] * (width - len(k)) for k in known], dtype=torch.long, device=device)
    where = [(r, len(known[r]) + j, pos) for r, positions in enumerate(pending) for j, pos in enumerate(positions)]
    if where:
        r, col, pos = (torch.tensor(x, dtype=torch.long, device=device) for x in zip(*where))
        ids[r, col] = batch_token_ids[pos].to(torch.long)
    return ids, lengths


def _ban_bad_words(logits: Tensor, chunks: Sequence[ChunkInput], history: tuple[Tensor, list[int]] | None) -> None:
    """-inf for each bad word's last token where the output ends with the word's other tokens (a one-token word:
    everywhere). Several words may ban one token: the bans are counted, so their order cannot matter."""
    checks = []  # (row, last token, [(history column, expected token), ...])
    for r, c in enumerate(chunks):
        for word in c.params.bad_words_token_ids or ():
            *prefix, last = word
            if prefix:
                n = history[1][r]
                if n < len(prefix):
                    continue
                checks.append((r, last, [(n - len(prefix) + j, t) for j, t in enumerate(prefix)]))
            else:
                checks.append((r, last, []))
    checks = [x for x in checks if x[1] < logits.shape[1]]
    if not checks:
        return
    device = logits.device
    rows = torch.tensor([x[0] for x in checks], dtype=torch.long, device=device)
    last = torch.tensor([x[1] for x in checks], dtype=torch.long, device=device)
    width = max(len(x[2]) for x in checks)
    hit = torch.ones(len(checks), dtype=torch.bool, device=device)
    if width:
        cols = torch.tensor([[j for j, _ in x[2]] + [0] * (width - len(x[2])) for x in checks], device=device)
        want = torch.tensor([[t for _, t in x[2]] + [-1] * (width - len(x[2])) for x in checks], device=device)
        seen = history[0][rows.unsqueeze(1), cols]
        hit = ((seen == want) | (want < 0)).all(dim=1)
    bans = torch.zeros(logits.shape, dtype=torch.int32, device=device)
    bans.index_put_((rows, last), hit.to(torch.int32), accumulate=True)
    logits.masked_fill_(bans > 0, float("-inf"))


def _add_logit_bias(logits: Tensor, chunks: Sequence[ChunkInput]) -> None:
    entries = [(r, t, v) for r, c in enumerate(chunks) for t, v in (c.params.logit_bias or {}).items()
               if t < logits.shape[1]]
    if not entries:
        return
    device = logits.device
    r, t = (torch.tensor(x, dtype=torch.long, device=device) for x in list(zip(*entries))[:2])
    values = torch.tensor([v for _, _, v in entries], dtype=torch.float32, device=device)
    logits[r, t] += values  # a request's keys are distinct: no index repeats


def _penalize(logits: Tensor, chunks: Sequence[ChunkInput], history: Tensor) -> None:
    """Repetition (prompt and output tokens), then frequency and presence (output tokens), as vLLM orders them."""
    device, vocab = logits.device, logits.shape[1]
    counts = torch.zeros((len(chunks), vocab + 1), dtype=torch.float32, device=device)
    counts.scatter_add_(1, history.clamp(max=vocab), torch.ones(history.shape, dtype=torch.float32, device=device))
    counts = counts[:, :vocab]  # the last column caught the padding (integers below 2**24: exact in any order)

    def column(values: list[float]) -> Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)

    repetition = [c.params.repetition_penalty for c in chunks]
    if any(p != 1.0 for p in repetition):
        seen = counts > 0
        prompts = [(r, t) for r, c in enumerate(chunks) if c.params.repetition_penalty != 1.0
                   for t in c.prompt_token_ids if t < vocab]
        if prompts:
            r, t = (torch.tensor(x, dtype=torch.long, device=device) for x in zip(*prompts))
            seen = seen.index_put((r, t), torch.ones((), dtype=torch.bool, device=device))
        penalty = column(repetition)
        scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits.copy_(torch.where(seen, scaled, logits))
    frequency = [c.params.frequency_penalty for c in chunks]
    if any(frequency):
        logits.sub_(column(frequency) * counts)
    presence = [c.params.presence_penalty for c in chunks]
    if any(presence):
        logits.sub_(column(presence) * (counts > 0).to(torch.float32))
