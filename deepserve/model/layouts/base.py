"""The contract between a layer's forward and the layout its state lives in (see the package docstring)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from deepserve.core.interfaces import VisibleRows

from ..batch import ForwardBatch, to_device


class LayerLayout(ABC):
    """One layer's state for one step, as the layer's forward reads and writes it. `positions` [T]: each new
    token's position; `backend`: the ops the layout's bookkeeping may call."""

    def __init__(self, batch: ForwardBatch, backend) -> None:
        self.batch, self.backend, self.positions = batch, backend, batch.positions

    @abstractmethod
    def emit(self, pooler, kv: torch.Tensor, gate: torch.Tensor, stream: str) -> None:
        """The compressor `pooler`'s raw projections of the step's tokens (kv, gate [T, F], before the position
        bias) into its `stream` ("compressor" or "indexer"): the open blocks' frontier, and one row for every
        block they close (`pooler.rows`)."""

    def rounds_on_store(self) -> bool:
        """Whether a token's kv row reaches the attention and the window only as the pools store it (encoded by
        their codec, which rounds it exactly as `KVPrecision.round_kv` does), so the forward need not round it
        first. False (the default): the layout reads the row's values as given."""
        return False

    def index_scored(self, indexer) -> bool:
        """Whether `index_topk` scores the keys for this step (else every row is chosen: `all_visible`)."""
        return True

    @abstractmethod
    def index_topk(self, indexer, q: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The indexer's top-k compressed rows per query (q [T, H, d] rotated, weights [T, H] fp32), numbered
        within the query's sequence, ascending, -1 unused: [T, topk]."""

    @abstractmethod
    def all_visible(self, pooler, stream: str) -> torch.Tensor | VisibleRows:
        """Every compressed row of `stream` that each query may see, in order: [T, K] (-1 padded) or its rule."""

    @abstractmethod
    def keys(self, kv: torch.Tensor, compressed: torch.Tensor | VisibleRows | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(pool [N, d], indices [T, W + K]): the key rows and, per query, its window keys (this step's `kv`
        included; -1 before position 0) then its `compressed` rows (-1 = none), for `sparse_attention`."""

    def attend(self, q: torch.Tensor, kv: torch.Tensor, compressed: torch.Tensor | VisibleRows | None,
               sinks: torch.Tensor, scale: float, inv_freq: torch.Tensor) -> torch.Tensor:
        """The layer's sparse attention (q [T, H, d]) over `keys(kv, compressed)`, the output's rotary dims turned
        back (`Backend.sparse_attention_rope`): [T, H, d]. The paged layouts pass keys kept packed as stored
        (`Backend.sparse_attention_packed`) instead of decoding them first."""
        pool, indices = self.keys(kv, compressed)
        return self.backend.sparse_attention_rope(q, pool, indices, sinks, scale, self.positions, inv_freq)

    @abstractmethod
    def store_window(self, kv: torch.Tensor) -> None:
        """The step's keys into the window rings, after the attention has read them."""


class StepLayout(ABC):
    """One forward's layout for one state owner's layers. `every_row_logits`: the step wants logits for every
    row, in order (a static decode step), so the final head needs no gather."""

    every_row_logits = False

    @abstractmethod
    def layer(self, index: int) -> LayerLayout:
        """Layer `index`'s layout for this step."""


def visible_rows(positions: torch.Tensor, rule: VisibleRows) -> torch.Tensor:
    """The index list `rule` stands for, [T, width]: column j holds j where the query at that position may see
    compressed row j, else -1."""
    visible = (positions + 1) // rule.ratio
    offs = torch.arange(rule.width, device=positions.device)
    return torch.where(offs[None, :] < visible[:, None], offs[None, :], torch.full_like(offs, -1)[None, :])


def chunk_visible(batch: ForwardBatch, ratio: int) -> torch.Tensor:
    """Every compressed row each query may see, as wide as the widest from the host's chunk ends (no sync)."""
    return visible_rows(batch.positions, VisibleRows(ratio, max((c.end // ratio for c in batch.chunks), default=0)))


def window_indices(positions, window: int, chunk_start, ring_base, new_base) -> torch.Tensor:
    """[T, W] pool rows of each query's window keys (-1 before position 0), when the pool holds each sequence's
    whole ring (position p at `ring_base + p % W`, for positions before its chunk) and its chunk's new rows
    (position p at `new_base + p - chunk_start`). The last three are per query, [T, 1]."""
    W = window
    key_pos = positions[:, None] - (W - 1) + torch.arange(W, device=positions.device)[None, :]
    rows = torch.where(key_pos < chunk_start, ring_base + key_pos % W, new_base + key_pos - chunk_start)
    return torch.where(key_pos >= 0, rows, torch.full_like(key_pos, -1))


def topk_in_sequences(indexer, batch: ForwardBatch, q, weights, keys, counts: list[int]) -> torch.Tensor:
    """`Backend.indexer_topk` over every sequence's keys concatenated (`counts` rows each), the chosen key
    numbers turned back into row numbers within each query's sequence."""
    device = q.device
    starts = [0]
    for n in counts[:-1]:
        starts.append(starts[-1] + n)
    lengths = to_device([c.length for c in batch.chunks], torch.long, device)
    key_start = to_device(starts, torch.long, device).repeat_interleave(lengths, output_size=q.shape[0])
    key_count = (batch.positions + 1) // indexer.ratio
    chosen = indexer.backend.indexer_topk(q, weights, keys, key_start, key_count, indexer.topk)
    return torch.where(chosen >= 0, chosen - key_start[:, None], chosen)
