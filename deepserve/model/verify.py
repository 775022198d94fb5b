"""Lossless verification of speculative drafts: which drafts the target model keeps, and the token after them.

Each verifying sequence contributes 1 + k rows of target logits: row j is the distribution of the token at
position `start + j + 1` given the base token and drafts 1..j; draft j + 1 is checked against row j, and
row k (the bonus row) follows the last draft.
- Greedy rows (temperature 0): a draft is kept when it equals the target's argmax (lowest id on ties), and
  the token after the last kept draft is the argmax of the next row: exactly what plain greedy decoding gives.
- Sampled rows: the standard rejection rule (Leviathan et al. 2023; Chen et al. 2023). Draft d, drawn from the
  drafter's q, is kept with probability min(1, p(d) / q(d)); at the first rejection the token is drawn from
  norm(max(0, p - q)); when all k are kept the bonus token is drawn from p. Each emitted token then has the
  target's distribution p (after temperature, top-k, top-p, min-p).
- Exact rows (drafts a grammar forces, not drawn from q): kept when equal to the row's own sample, greedy or
  seeded, so the tokens are plain decoding's, not just distributed like them.
All randomness is counter-based, keyed on (seed, position): the acceptance coin on a salted key, the bonus and
residual draws on the request's own key through `Backend.sample`, so a row with no drafts samples exactly as
plain decoding does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from deepserve.sampling import argmax_lowest, filter_logits, row_keys, uniform_noise
from deepserve.core.interfaces import Backend

from .speculative import RowSampling

#: mixed into the seed for the acceptance coins, so they are independent of the sampler's own noise
ACCEPT_SALT = 0x5EC0DE
#: mixed into the seed for drawing drafts
DRAFT_SALT = 0xD4AF7


def target_probs(logits: Tensor, sampling: RowSampling) -> Tensor:
    """p: the distribution a row samples from after temperature and the top-k / top-p / min-p filters."""
    filtered = filter_logits(logits, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p)
    return torch.softmax(filtered, dim=-1)


def coins(seeds: Tensor, positions: Tensor, salt: int) -> Tensor:
    """One uniform number in (0, 1) per row, a function of (seed, position, salt) only."""
    return uniform_noise(row_keys(seeds ^ salt, positions), 1)[:, 0]


def verify(backend: Backend, logits: Tensor, sampling: RowSampling, positions: Tensor, num_drafts: list[int],
           draft_ids: Tensor, draft_probs: Tensor | None, all_greedy: bool = False,
           exact_rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Accept or reject every sequence's drafts.

    `logits` [R, V] fp32 holds each sequence's 1 + k_i rows back to back (`num_drafts[i]` = k_i); `sampling`
    and `positions` (the position each row's token would take) are per row. `draft_ids` [R] holds, on row j
    of a sequence, its draft j + 1 (anything on the bonus rows); `draft_probs` [R, V] the draft distribution q
    of that draft (None when no sampled row has a drafter's draft: then every draft is checked by exact match).
    `exact_rows` [R] bool marks the rows whose draft was not drawn from q (tokens a grammar forces): they are
    checked like greedy rows, kept when equal to the row's own sample `Backend.sample` (greedy or seeded), the
    token after a rejection being that sample; with q a point mass on the draft the rejection rule gives the same
    distribution, and the exact match also gives plain decoding's very tokens. Returns
    (number of drafts kept [S], the token that follows them [S]), on the device.
    """
    device = logits.device
    firsts = _row_starts(num_drafts, device)
    k = torch.tensor(num_drafts, device=device)
    seq_of_row = torch.repeat_interleave(torch.arange(len(num_drafts), device=device), k + 1)
    j = torch.arange(logits.shape[0], device=device) - firsts[seq_of_row]
    is_draft_row = j < k[seq_of_row]

    greedy = sampling.temperature <= 0
    if draft_probs is None and all_greedy:
        plain = argmax_lowest(logits)  # what Backend.sample gives a greedy row
    else:  # the bonus draw, and the greedy target everywhere
        plain = backend.sample(logits, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p,
                               sampling.seeds, positions)
    drafts = torch.where(is_draft_row, draft_ids, 0)
    keep = drafts == plain  # greedy rows: exact match with the argmax
    after_reject = plain
    if draft_probs is not None:
        p = target_probs(logits, sampling)
        p_d = p.gather(1, drafts[:, None])[:, 0]
        q_d = draft_probs.gather(1, drafts[:, None])[:, 0]
        u = coins(sampling.seeds, positions, ACCEPT_SALT)
        exact = greedy if exact_rows is None else greedy | exact_rows
        keep = torch.where(exact, keep, u * q_d < p_d)
        residual = torch.clamp(p - draft_probs, min=0.0)
        ones = torch.ones_like(sampling.temperature)
        resampled = backend.sample(torch.log(residual), ones, torch.zeros_like(sampling.top_k), ones,
                                   torch.zeros_like(sampling.min_p), sampling.seeds, positions)
        after_reject = torch.where(exact, plain, resampled)
    # the first row of each sequence that is not a kept draft: a rejected draft's row, or the bonus row
    stop = torch.where(is_draft_row & keep, logits.shape[0], j)
    num_kept = torch.full((len(num_drafts),), logits.shape[0], device=device, dtype=torch.long)
    num_kept = num_kept.scatter_reduce(0, seq_of_row, stop, reduce="amin")
    rows = firsts + num_kept
    token = torch.where(num_kept < k, after_reject[rows], plain[rows])
    return num_kept, token


def _row_starts(num_drafts: list[int], device) -> Tensor:
    starts, at = [], 0
    for k in num_drafts:
        starts.append(at)
        at += k + 1
    return torch.tensor(starts, device=device, dtype=torch.long)
