"""deepserve's sampling semantics in plain PyTorch (CPU or CUDA, no host syncs): the counter-based randomness, the
logit filters, the reference `Backend.sample`, and logprobs. The model runner, the verifier of speculative drafts
and every backend use these, so a token drawn anywhere is the token drawn everywhere.

The randomness is counter-based. Row b draws its noise from a 64-bit key = mix(seed_b, position_b), and token v's
uniform number is splitmix64's v-th output for that key, so a row's draw depends on (seed, position) and on
nothing else: not on the batch size, the row order, or the device's RNG state. The token is chosen with the
exponential race, `argmax_v p_v / E_v` with `E_v = -log u_v` ~ Exp(1), which picks v with probability p_v.
All hashing is int64 arithmetic that wraps modulo 2**64 (what torch does on CPU and CUDA); logical right shifts
are spelled as arithmetic shifts plus a mask.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN = _signed(0x9E3779B97F4A7C15)  # splitmix64's counter increment
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)
_TWO_POW_MINUS_53 = 2.0**-53


def _shr(x: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 bits."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix64(x: Tensor) -> Tensor:
    """splitmix64's finalizer on int64 tensors: a bijection of 64-bit words with full avalanche."""
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def row_keys(seeds: Tensor, positions: Tensor) -> Tensor:
    """The 64-bit noise key of each row, a function of its (seed, position) only."""
    return mix64(mix64(seeds.to(torch.int64) + _GOLDEN) + positions.to(torch.int64) * _GOLDEN)


def uniform_noise(keys: Tensor, vocab_size: int) -> Tensor:
    """u[b, v] in the open interval (0, 1), float64: the top 53 bits of splitmix64 output v + 1 for key b."""
    counters = (torch.arange(1, vocab_size + 1, dtype=torch.int64, device=keys.device) * _GOLDEN).unsqueeze(0)
    bits = _shr(mix64(keys.unsqueeze(1) + counters), 11)
    return (bits.to(torch.float64) + 0.5) * _TWO_POW_MINUS_53


def argmax_lowest(x: Tensor) -> Tensor:
    """Row-wise argmax whose ties go to the lowest index on every device (independent of kernel choices)."""
    ids = torch.arange(x.shape[-1], device=x.device).expand_as(x)
    hit = x == x.max(dim=-1, keepdim=True).values
    return torch.where(hit, ids, x.shape[-1]).min(dim=-1).values


def filter_logits(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor) -> Tensor:
    """Scaled logits [B, V] (fp32) with the tokens removed by top-k, then top-p, then min-p set to -inf.

    Filters work on the tokens sorted best first with ties in id order, so `top_k` keeps exactly k tokens and
    top_k=1 equals greedy. Top-p keeps the smallest prefix whose mass reaches `top_p`; min-p drops tokens less
    likely than `min_p` times the best one. The best token always survives. Greedy rows (temperature 0) are
    scaled by 1: the caller takes their argmax.
    """
    num_rows, vocab = logits.shape
    temp = torch.where(temperature > 0, temperature, 1.0).to(torch.float32).unsqueeze(1)
    scaled = logits.to(torch.float32) / temp
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=logits.device).unsqueeze(0)

    k = top_k.to(torch.int64).unsqueeze(1)
    keep = (k <= 0) | (rank < k)
    probs = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    p = top_p.to(torch.float32).unsqueeze(1)
    keep &= (mass_before < p) | (p >= 1.0)
    probs = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
    keep &= probs >= min_p.to(torch.float32).unsqueeze(1) * probs[:, :1]
    keep[:, 0] = True

    filtered_sorted = sorted_logits.masked_fill(~keep, float("-inf"))
    return torch.empty_like(scaled).scatter_(1, order, filtered_sorted)


def sample(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    min_p: Tensor,
    seeds: Tensor,
    positions: Tensor,
) -> Tensor:
    """`Backend.sample`: one token per row of `logits` [B, V]; see `deepserve.core.interfaces.Backend.sample`."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    filtered = filter_logits(logits, temperature, top_k, top_p, min_p)
    noise = uniform_noise(row_keys(seeds, positions), logits.shape[1])
    # exponential race in log space: log p_v - log E_v; the softmax normaliser is a per-row constant
    scores = filtered.to(torch.float64) - torch.log(-torch.log(noise))
    sampled = argmax_lowest(scores)
    greedy = argmax_lowest(logits.to(torch.float32))
    return torch.where(temperature.to(logits.device) > 0, sampled, greedy)


def suppress_tokens(logits: Tensor, rows: Tensor, token_ids: Tensor) -> Tensor:
    """A copy of `logits` with `logits[rows[i], token_ids[i]] = -inf` (EOS and stop ids under `min_tokens`)."""
    minus_inf = logits.new_full((), float("-inf"))  # filled on the device: no copy from the host
    return logits.index_put((rows.to(torch.int64), token_ids.to(torch.int64)), minus_inf)


def compute_logprobs(logits: Tensor) -> Tensor:
    """Log-softmax of the raw logits in fp32 (vLLM reports logprobs of the model's output, before sampling
    parameters such as temperature or top-k are applied)."""
    return torch.log_softmax(logits.to(torch.float32), dim=-1)


def top_logprobs(logprobs: Tensor, token_ids: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """The chosen tokens' logprobs followed by the k best, per row.

    Returns `(values [B, 1 + k] fp32, ids [B, 1 + k] int64, ranks [B] int64)`: column 0 is the chosen token,
    columns 1..k the top-k best first (ties by lowest id, ranks 1..k by position), and `ranks` the chosen
    token's rank, 1 + the number of tokens with a strictly greater logprob.
    """
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    chosen_ids = token_ids.to(torch.int64).unsqueeze(1)
    chosen = logprobs.gather(1, chosen_ids)
    ranks = 1 + (logprobs > chosen).sum(dim=-1)
    if k == 0:
        return chosen, chosen_ids, ranks
    best, best_ids = torch.sort(logprobs, dim=-1, descending=True, stable=True)
    k = min(k, logprobs.shape[1])
    values = torch.cat([chosen, best[:, :k]], dim=1)
    ids = torch.cat([chosen_ids, best_ids[:, :k]], dim=1)
    return values, ids, ranks
