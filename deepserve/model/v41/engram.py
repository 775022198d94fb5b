"""Engram: V4.1's hashed n-gram memory (v41-architecture.md §4).

Row ids depend on token ids only: each token maps to a normalized-token id, each position hashes the 2..N-grams
ending at it (rolling XOR of id x odd multiplier), and every (n-gram size, head) owns a prime-sized bucket range
of its layer's table. The table rows (FP8 e4m3, a UE8M0 scale per 32) are gathered where the table lives (host
memory if asked: the Flash tables are ~100 GB a layer) and gated into each mHC stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from .config import V41Config
from .numerics import QuantWeight, linear


def is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0 or n % 3 == 0:
        return n in (2, 3)
    f = 5
    while f * f <= n:
        if n % f == 0 or n % (f + 2) == 0:
            return False
        f += 6
    return True


def normalized_token_map(tokenizer) -> tuple[list[int], int]:
    """Token id -> normalized-token id, and how many normalized ids there are. A token is decoded alone and
    normalized NFKC, NFD, accents stripped, lowercased, whitespace runs collapsed to one space and stripped
    (a token that is exactly one space stays one space); tokens whose decoding is broken UTF-8 are keyed by
    their raw vocabulary form. `tokenizer` is a `tokenizers.Tokenizer`."""
    from tokenizers import Regex, normalizers

    lone_space = "\ue000"  # private use: survives Strip, then turns back into the space
    norm = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), lone_space),
        normalizers.Strip(), normalizers.Replace(lone_space, " "),
    ])
    ids: dict[str, int] = {}
    table = []
    for token_id in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tokenizer.id_to_token(token_id)
        else:
            key = norm.normalize_str(text) or text
        table.append(ids.setdefault(key, len(ids)))
    return table, len(ids)


@dataclass(frozen=True)
class EngramHasher:
    """Bucket layout and hash constants of every Engram layer; `hash(history, tokens)` gives row ids."""

    token_map: torch.Tensor  # int64 [vocab]
    pad_id: int  # normalized id used for missing history
    multipliers: torch.Tensor  # int64 [layers, max_ngram]
    primes: torch.Tensor  # int64 [layers, max_ngram - 1, heads]
    offsets: torch.Tensor  # int64 [layers, (max_ngram - 1) * heads]
    max_ngram: int

    @classmethod
    def build(cls, cfg: V41Config, tokenizer) -> "EngramHasher":
        table, size = normalized_token_map(tokenizer)
        if size != cfg.engram_compressed_vocab_size:
            raise ValueError(f"the tokenizer normalizes to {size} ids but engram_compressed_vocab_size is "
                             f"{cfg.engram_compressed_vocab_size}: every Engram hash depends on it")
        n, heads = cfg.engram_max_ngram_size, cfg.engram_n_heads
        seen: set[int] = set()
        primes = []
        for _ in cfg.engram_layer_ids:
            per_n = []
            for _ in range(n - 1):
                cur, row = cfg.engram_vocab_size - 1, []
                for _ in range(heads):
                    cur += 1
                    while not is_prime(cur) or cur in seen:
                        cur += 1
                    seen.add(cur)
                    row.append(cur)
                per_n.append(row)
            primes.append(per_n)
        p = torch.tensor(primes, dtype=torch.int64).view(len(cfg.engram_layer_ids), n - 1, heads)
        flat = p.flatten(1)
        offsets = torch.cumsum(flat, 1) - flat
        for li, rows in enumerate(cfg.engram_num_embeddings):
            if int(flat[li].sum()) > rows:
                raise ValueError(f"engram layer {cfg.engram_layer_ids[li]}: buckets need {int(flat[li].sum())} rows, "
                                 f"the table has {rows}")
        bound = max(1, (np.iinfo(np.int64).max // size) // 2)
        mult = torch.stack([torch.from_numpy(np.random.default_rng(10007 * lid).integers(
            0, bound, size=(n,), dtype=np.int64) * 2 + 1) for lid in cfg.engram_layer_ids])
        return cls(torch.tensor(table, dtype=torch.int64), table[cfg.engram_pad_id], mult, p, offsets, n)

    def hash(self, history: list[int], tokens: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Row ids int64 [len(tokens), layers, (max_ngram-1)*heads] for `tokens` following `history` (the
        normalized ids of up to max_ngram-1 earlier tokens, oldest first), and the history after them."""
        ids = self.token_map[tokens.cpu()].tolist()
        seq = history + ids
        start = len(history)
        rows = []
        for t in range(start, len(seq)):
            grams = [seq[t - s] if t - s >= 0 else self.pad_id for s in range(self.max_ngram)]
            rows.append(grams)
        g = torch.tensor(rows, dtype=torch.int64)  # [T, max_ngram]: current, previous, ...
        prod = g.unsqueeze(1) * self.multipliers  # [T, layers, max_ngram]
        rolling, out = prod[..., 0], []
        for i in range(1, self.max_ngram):
            rolling = torch.bitwise_xor(rolling, prod[..., i])
            out.append(rolling.unsqueeze(-1) % self.primes[:, i - 1])
        ids_out = torch.cat(out, dim=-1) + self.offsets
        return ids_out, seq[-(self.max_ngram - 1):] if self.max_ngram > 1 else []


class EngramTable(nn.Module):
    """One layer's FP8 table with its UE8M0 scales; rows are gathered where the table lives (`device`, e.g.
    "cpu" for host memory) and dequantized to bf16 on the caller's device."""

    def __init__(self, rows: int, dim: int):
        super().__init__()
        self.register_buffer("weight", torch.zeros(rows, dim, dtype=torch.float8_e4m3fn), persistent=False)
        self.register_buffer("scale", torch.ones(rows, dim // 32, dtype=torch.float32), persistent=False)

    def place(self, device) -> None:
        """Keep the table on `device` (host memory: "cpu") whatever device the model runs on."""
        self.weight = self.weight.to(device)
        self.scale = self.scale.to(device)
        self._pinned = torch.device(device)

    def _apply(self, fn, recurse=True):  # model.to(...) leaves a placed table where it was put
        if getattr(self, "_pinned", None) is not None:
            return self
        return super()._apply(fn, recurse)

    def gather(self, ids: torch.Tensor, device) -> torch.Tensor:
        ids = ids.to(self.weight.device)
        vals = self.weight[ids].float().unflatten(-1, (-1, 32)) * self.scale[ids].unsqueeze(-1)
        return vals.flatten(-2).to(torch.bfloat16).to(device)


class Engram(nn.Module):
    """Adds a gated projection of the fetched rows to each mHC stream, before the layer's attention."""

    def __init__(self, cfg: V41Config, layer: int):
        super().__init__()
        self.index = cfg.engram_layer_ids.index(layer)
        self.hc, self.dim, self.eps = cfg.hc_mult, cfg.dim, cfg.norm_eps
        self.table = EngramTable(cfg.engram_num_embeddings[self.index], cfg.engram_head_dim)
        self.wkv: QuantWeight | None = None  # [(max_ngram-1)*heads*head_dim -> dim*(hc+1)], FP8
        self.q_weight = nn.Parameter(torch.ones(cfg.hc_mult, cfg.dim, dtype=torch.bfloat16), requires_grad=False)
        self.k_weight = nn.Parameter(torch.ones(cfg.hc_mult, cfg.dim, dtype=torch.bfloat16), requires_grad=False)

    def forward(self, x: torch.Tensor, row_ids: torch.Tensor) -> torch.Tensor:
        """x [S, hc, D] bf16, row_ids [S, cols] -> x with each stream's gated value added."""
        kv = linear(self.table.gather(row_ids, x.device).flatten(-2), self.wkv)
        key, value = kv.split([self.hc * self.dim, self.dim], dim=-1)
        key = key.float().unflatten(-1, (self.hc, self.dim))
        h = x.float()
        w = self.q_weight.float() * self.k_weight.float()
        rstd = torch.rsqrt(h.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = (h * w * key).sum(-1) * rstd * self.dim**-0.5
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
        return (h + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(x.dtype)
