"""Per-sequence inference state of the V4 model, owned by the caller (spec section 4).

The model never keeps state between calls: every forward receives, for each sequence in the batch, a
`SequenceState` holding one state object per layer. Layers create their own state (`make_state`), so a new
layer kind (V4.1's CSA2 consumers, Engram) brings a new state owner without touching the others.

What a layer keeps, after a sequence's first t tokens:
- every layer: a ring of the last `window` raw KV rows (slot = position mod window);
- compressed layers: append-only compressed rows (CSA: one per 4 tokens plus the indexer's keys; HCA: one per
  128), and the *frontier*: projected kv and gate of the tokens in the open block, plus for CSA the previous
  block's "Ca" half, which the next entry pools with its own "Cb" half (the overlap).
Row stores grow by doubling here; the paged KV manager of the engine replaces them with page-table views.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


class RowStore:
    """Append-only rows of one stream of one sequence (compressed KV or indexer keys)."""

    __slots__ = ("_buf", "num_rows")

    def __init__(self, width: int, dtype: torch.dtype, device: str | torch.device, capacity: int = 16) -> None:
        self._buf = torch.empty((max(capacity, 1), width), dtype=dtype, device=device)
        self.num_rows = 0

    def append(self, rows: torch.Tensor) -> None:
        need = self.num_rows + rows.shape[0]
        if need > self._buf.shape[0]:
            grown = torch.empty((max(need, 2 * self._buf.shape[0]), self._buf.shape[1]),
                                dtype=self._buf.dtype, device=self._buf.device)
            grown[: self.num_rows] = self._buf[: self.num_rows]
            self._buf = grown
        self._buf[self.num_rows : need] = rows.to(self._buf.dtype)
        self.num_rows = need

    def view(self) -> torch.Tensor:
        return self._buf[: self.num_rows]

    def truncate(self, num_rows: int) -> None:
        """Drop rows past `num_rows` (rollback of rejected speculative tokens)."""
        if not 0 <= num_rows <= self.num_rows:
            raise ValueError(f"cannot truncate {self.num_rows} rows to {num_rows}")
        self.num_rows = num_rows


class WindowRing:
    """The last `window` raw KV rows of one layer; position p lives in slot p mod window. `codec` (a paged
    cache's, `kv_precision.RowCodec`): the ring holds the rows in its stored form, encoded as they are written
    and decoded as they are read; None: the ring holds the values."""

    __slots__ = ("ring", "codec")

    def __init__(self, ring: torch.Tensor, codec=None) -> None:
        self.ring = ring  # [window, width] (stored width); may be a view into a pool of per-sequence slots
        self.codec = codec

    def _slots(self, start: int, end: int) -> torch.Tensor:
        return torch.arange(start, end, device=self.ring.device) % self.ring.shape[0]

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """`rows` (values) in the ring's stored form."""
        return rows.to(self.ring.dtype) if self.codec is None else self.codec.encode(rows)

    def values(self) -> torch.Tensor:
        """The whole ring in slot order, decoded (the ring itself where it holds the values)."""
        return self.ring if self.codec is None else self.codec.decode(self.ring)

    def read(self, start: int, end: int) -> torch.Tensor:
        """Rows of positions [start, end); the caller guarantees they are still in the ring."""
        rows = self.ring[self._slots(start, end)]
        return rows if self.codec is None else self.codec.decode(rows)

    def write(self, start: int, rows: torch.Tensor) -> None:
        """Store rows of positions start, start+1, ...; only the last `window` of them can survive."""
        window = self.ring.shape[0]
        if rows.shape[0] > window:
            start += rows.shape[0] - window
            rows = rows[-window:]
        self.write_stored(start, self.encode(rows))

    def write_stored(self, start: int, stored: torch.Tensor) -> None:
        """Rows already in the stored form (a page's window snapshot) at positions start, start+1, ... (at most
        `window` of them)."""
        self.ring[self._slots(start, start + stored.shape[0])] = stored

    def save(self, start: int, end: int) -> torch.Tensor:
        """The rows (stored form) that writing positions [start, end) will overwrite (positions start - window
        ..), for `undo`."""
        return self.ring[self._slots(start, end)]  # advanced indexing: already a copy

    def undo(self, start: int, saved: torch.Tensor, keep_until: int) -> None:
        """Put back the rows `save(start, ..)` returned for the positions from `keep_until` on: rejected
        speculative writes leave the ring as it was for them."""
        if keep_until < start + saved.shape[0]:
            self.ring[self._slots(keep_until, start + saved.shape[0])] = saved[keep_until - start :]


class CompressorState:
    """Rows emitted so far plus the frontier of one compressor (main KV or indexer keys).

    `open_kv` / `open_gate` hold the projections of the open block's tokens (how many: position mod ratio),
    the gate already including the position bias. With overlap (CSA), `prev_kv` / `prev_gate` hold the Ca
    half of the last closed block. Frontier tensors are fp32, as in the official reference. `rows` is a
    `RowStore` or anything with its interface (the paged cache's page-table view).

    `snap_prev_kv` / `snap_prev_gate` ([pages, ratio, dim], optional) receive the overlap state at page
    boundaries that the batch asks to snapshot, for prefix-cache hits at those boundaries.

    `journal` is set while a speculative verify pass runs (`begin_journal`): the compressor then records the
    projections it pooled, so that `rollback` can rewind the frontier to any position inside that pass.
    """

    __slots__ = ("rows", "open_kv", "open_gate", "prev_kv", "prev_gate", "snap_prev_kv", "snap_prev_gate",
                 "journal")

    def __init__(self, rows, open_kv, open_gate, prev_kv=None, prev_gate=None, snap_prev_kv=None, snap_prev_gate=None):
        self.rows = rows
        self.open_kv, self.open_gate = open_kv, open_gate
        self.prev_kv, self.prev_gate = prev_kv, prev_gate
        self.snap_prev_kv, self.snap_prev_gate = snap_prev_kv, snap_prev_gate
        self.journal: FrontierJournal | None = None

    def begin_journal(self) -> None:
        """Start recording for a rollback: remember the row count and the overlap state as they are now."""
        self.journal = FrontierJournal(
            self.rows.num_rows,
            self.prev_kv.clone() if self.prev_kv is not None else None,
            self.prev_gate.clone() if self.prev_gate is not None else None,
        )

    def record(self, first_position: int, kv: torch.Tensor, gate: torch.Tensor) -> None:
        """Called by the compressor with the open block's projections followed by the new tokens' ones:
        positions `first_position ..`, fp32 [n, frontier_width]."""
        if self.journal is not None:
            self.journal.first_position, self.journal.kv, self.journal.gate = first_position, kv, gate

    def rollback(self, num_tokens: int, ratio: int) -> None:
        """Rewind to the state after the sequence's first `num_tokens` tokens, a length inside the journaled
        pass: rows past `num_tokens // ratio` are dropped, the open block and (CSA) the overlap half are rebuilt
        from the recorded projections or the state saved when the journal began. Ends the journal."""
        j, self.journal = self.journal, None
        if j is None or j.kv is None:
            raise RuntimeError("rollback needs a journal that recorded a pass (begin_journal, then a forward)")
        num_rows = num_tokens // ratio
        if num_rows < j.num_rows or num_tokens < j.first_position:
            raise ValueError(f"cannot roll back to {num_tokens} tokens: the journaled pass started later")
        self.rows.truncate(num_rows)
        block, rest = num_rows * ratio - j.first_position, num_tokens % ratio
        self.open_kv[:rest] = j.kv[block : block + rest]
        self.open_gate[:rest] = j.gate[block : block + rest]
        if self.prev_kv is None:
            return
        if num_rows > j.num_rows:  # the last kept block closed in this pass: its Ca half is in the record
            d = self.prev_kv.shape[-1]
            self.prev_kv.copy_(j.kv[block - ratio : block, :d])
            self.prev_gate.copy_(j.gate[block - ratio : block, :d])
        else:
            self.prev_kv.copy_(j.prev_kv)
            self.prev_gate.copy_(j.prev_gate)


@dataclass(slots=True)
class FrontierJournal:
    """What `CompressorState.rollback` needs: the row count and overlap half before a pass, and the projections
    of the pass (positions `first_position ..`, starting at the open block's first token)."""

    num_rows: int
    prev_kv: torch.Tensor | None
    prev_gate: torch.Tensor | None
    first_position: int = 0
    kv: torch.Tensor | None = None
    gate: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class StreamSpec:
    """One compressed row stream of a layer: `ratio` tokens per row, rows `dim` wide, CSA-style `overlap`."""

    ratio: int
    dim: int
    overlap: bool

    @property
    def frontier_width(self) -> int:
        return 2 * self.dim if self.overlap else self.dim


@dataclass(frozen=True, slots=True)
class LayerStateSpec:
    """What one attention layer keeps per sequence; the cache allocates it, contiguous or paged."""

    window: int
    width: int
    compressor: StreamSpec | None = None
    indexer: StreamSpec | None = None

    def streams(self) -> list[StreamSpec]:
        return [s for s in (self.compressor, self.indexer) if s is not None]


@dataclass(slots=True)
class AttentionState:
    """Everything one attention layer keeps for one sequence. `snap_window` ([pages, window, width],
    optional) receives the window rows at page boundaries the batch asks to snapshot.

    States from the paged cache also carry their `slot` and the layer's `pools` (`kv_cache._LayerPools`: one
    storage tensor holding every slot's ring and every page's compressed rows), which the batched decode path
    indexes directly; contiguous states leave both None and take the general path."""

    window: WindowRing
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None
    snap_window: torch.Tensor | None = None
    slot: int | None = None
    pools: Any = None


def new_frontier(spec: StreamSpec, rows, device) -> CompressorState:
    """A zeroed fp32 frontier around the given row store."""
    def zeros(width):
        return torch.zeros((spec.ratio, width), dtype=torch.float32, device=device)

    return CompressorState(rows, zeros(spec.frontier_width), zeros(spec.frontier_width),
                           zeros(spec.dim) if spec.overlap else None, zeros(spec.dim) if spec.overlap else None)


def contiguous_state(spec: LayerStateSpec, dtype: torch.dtype, device) -> AttentionState:
    """A self-contained state (own window ring, growing row stores): for tests and one-off runs."""
    def stream(s: StreamSpec | None) -> CompressorState | None:
        return None if s is None else new_frontier(s, RowStore(s.dim, dtype, device), device)

    ring = torch.zeros((spec.window, spec.width), dtype=dtype, device=device)
    return AttentionState(WindowRing(ring), stream(spec.compressor), stream(spec.indexer))


@dataclass(slots=True)
class SequenceState:
    """One sequence's state across the whole model.

    `num_tokens` counts the tokens whose effects are in the main layers' state (the next token's position).
    The MTP blocks lag one token behind (they need the next token's embedding), so they keep their own count.
    """

    layers: list[AttentionState]
    mtp_layers: list[AttentionState] = field(default_factory=list)
    num_tokens: int = 0
    mtp_num_tokens: int = 0
    #: the compressed streams' row stores grouped by ratio, made at the first `advance` (they never change)
    _rows_by_ratio: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def advance(self, num_tokens: int, streams: Sequence[tuple[int, str, int]]) -> None:
        """After a step whose state the device advanced without the host (a CUDA graph's): the main layers hold
        `num_tokens` tokens, so each compressed stream in `streams` (the model's: (layer, "compressor" or
        "indexer", ratio), the same list at every call) holds num_tokens // ratio rows. Runs for every sequence of
        every graphed step, for some 65 streams at V4-Flash's depth: the row stores are looked up once per
        sequence and set ratio by ratio (bench/investigations/static_row_counts.py)."""
        groups = self._rows_by_ratio
        if groups is None:
            by_ratio: dict[int, list] = {}
            for layer, name, ratio in streams:
                by_ratio.setdefault(ratio, []).append(getattr(self.layers[layer], name).rows)
            groups = self._rows_by_ratio = tuple((ratio, tuple(rows)) for ratio, rows in by_ratio.items())
        for ratio, rows in groups:
            count = num_tokens // ratio
            for store in rows:
                store.num_rows = count
        self.num_tokens = num_tokens
