"""The variable-length batch one forward pass computes: new tokens of several sequences, flattened, no padding."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .state import AttentionState, SequenceState


@dataclass(frozen=True, slots=True)
class SeqChunk:
    """`length` new tokens of one sequence, at positions `start ..`; rows `offset ..` of the flat batch.

    `snapshots` lists (boundary, page) pairs: page boundaries inside (start, end] at which every layer saves its
    window tail and overlap state into the page's snapshot slot, for prefix-cache hits there.
    """

    offset: int
    start: int
    length: int
    snapshots: tuple[tuple[int, int], ...] = ()

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    """Token ids and positions [T] of all new tokens, the chunk layout, and which rows need logits.

    `memo` holds what every layer of one forward derives from the batch alone (the `PagedLayout`), built by the
    first layer that needs it. `static` marks a fixed-shape decode step (`StaticDecode`): no host-side chunks, one
    token per row, everything the layers need as device tensors."""

    token_ids: torch.Tensor
    positions: torch.Tensor
    chunks: tuple[SeqChunk, ...]
    logits_indices: torch.Tensor
    memo: dict = field(default_factory=dict, compare=False, repr=False)
    static: StaticDecode | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


def to_device(values, dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """`values` (numbers, nested lists of them, or a CPU tensor) as a `dtype` tensor on `device`, without waiting
    for the device's earlier work. A blocking copy first waits until the device has drained its stream, which
    would stall a host that launches the next step while the device computes this one; an asynchronous copy
    from ordinary (pageable) memory is staged by the driver before the call returns (so the host tensor may be
    dropped at once), but costs more host time. So: blocking when the stream is idle (nothing to wait for),
    asynchronous when it is busy. bench/investigations/h2d.py on the H200 compares the ways (pinning first was the
    slowest)."""
    host = torch.as_tensor(values, dtype=dtype)
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    if not torch.cuda.is_current_stream_capturing() and torch.cuda.current_stream(device).query():
        return host.to(device)
    return host.to(device, non_blocking=True)


def make_batch(
    token_lists: Sequence[Sequence[int]],
    starts: Sequence[int],
    device: str | torch.device,
    logits_rows: Sequence[Sequence[int]] | None = None,
    snapshots: Sequence[Sequence[tuple[int, int]]] | None = None,
) -> ForwardBatch:
    """Build a batch from each sequence's new tokens and the position of its first new token.

    `logits_rows[i]` lists which of sequence i's new tokens need logits (indices into its chunk); the default
    is its last token only.
    """
    if len(token_lists) != len(starts):
        raise ValueError("token_lists and starts differ in length")
    chunks, ids, pos, want = [], [], [], []
    offset = 0
    for i, (tokens, start) in enumerate(zip(token_lists, starts)):
        n = len(tokens)
        if n == 0:
            raise ValueError(f"sequence {i} has no new tokens")
        snaps = tuple(snapshots[i]) if snapshots is not None else ()
        if any(not start < b <= start + n for b, _ in snaps):
            raise ValueError(f"sequence {i}: snapshot boundaries {snaps} outside ({start}, {start + n}]")
        chunks.append(SeqChunk(offset=offset, start=int(start), length=n, snapshots=snaps))
        ids.extend(int(t) for t in tokens)
        pos.extend(range(start, start + n))
        rows = [n - 1] if logits_rows is None else list(logits_rows[i])
        want.extend(offset + r for r in rows)
        offset += n
    n = len(ids)
    flat = to_device(ids + pos + want, torch.long, device)  # one host-to-device copy for the three index tensors
    return ForwardBatch(token_ids=flat[:n], positions=flat[n : 2 * n], chunks=tuple(chunks),
                        logits_indices=flat[2 * n :])


def select_chunks(batch: ForwardBatch, which: Sequence[int], logits_rows: Sequence[Sequence[int]]) -> ForwardBatch:
    """The batch of chunks `which` of `batch` (in that order), their token ids and positions gathered on the device
    (placeholders already filled stay filled), with logits for `logits_rows[k]` (indices into chunk `which[k]`)."""
    chunks, src, want, offset = [], [], [], 0
    for k, i in enumerate(which):
        c = batch.chunks[i]
        chunks.append(SeqChunk(offset=offset, start=c.start, length=c.length, snapshots=c.snapshots))
        src.extend(range(c.offset, c.offset + c.length))
        want.extend(offset + r for r in logits_rows[k])
        offset += c.length
    device = batch.token_ids.device
    index = to_device(src, torch.long, device)
    return ForwardBatch(token_ids=batch.token_ids[index], positions=batch.positions[index], chunks=tuple(chunks),
                        logits_indices=to_device(want, torch.long, device))


def check_states(batch: ForwardBatch, states: Sequence[SequenceState]) -> None:
    """Every chunk must continue its sequence exactly where its state stops."""
    if len(states) != len(batch.chunks):
        raise ValueError(f"{len(batch.chunks)} chunks but {len(states)} sequence states")
    for i, (chunk, state) in enumerate(zip(batch.chunks, states)):
        if chunk.start != state.num_tokens:
            raise ValueError(f"sequence {i}: chunk starts at {chunk.start} but its state holds {state.num_tokens} tokens")


# The batched zero-copy path over the paged cache (decode, verify and prompt chunks) is taken whenever
# `paged_step_pools` allows it; False forces the general per-sequence path everywhere (the tests and
# bench/investigations/decode_host.py compare the two).
PAGED_DECODE = True


def paged_step_pools(batch: ForwardBatch, states: Sequence[AttentionState]):
    """The layer pools (`kv_cache._LayerPools`) shared by every state of the batch when the step qualifies for
    the batched path: all states paged in the same cache and the step's new rows fitting its scratch region
    (any chunk lengths: decode, speculative verify, prompt chunks). Else None. Host-side checks only."""
    if not PAGED_DECODE or not states:
        return None
    pools = states[0].pools
    if pools is None or any(st.pools is not pools for st in states):
        return None
    if batch.num_tokens > pools.scratch_rows:
        return None
    return pools


@dataclass(frozen=True, slots=True)
class PagedLayout:
    """Where a step's sequences live in the paged cache, as device tensors shared by every layer of a forward:
    per query (row of the batch) its sequence's slot, first new position and first row in the batch, [T, 1];
    per sequence its block table padded with page 0, [B, max pages] (`tables`), and per query that row
    (`query_tables`, [T, max pages]). The layers turn them into global row numbers of their pools."""

    slot: torch.Tensor
    chunk_start: torch.Tensor
    chunk_offset: torch.Tensor
    tables: torch.Tensor
    query_tables: torch.Tensor


def paged_layout(batch: ForwardBatch, states: Sequence[AttentionState]) -> PagedLayout:
    """The `PagedLayout` of paged `states` (one layer's), built once per forward and sequence set: later layers
    (the same slots and block tables) get the memoised one. Two asynchronous host-to-device copies."""
    tables = [block_table(st) for st in states]
    key = ("paged", tuple(st.slot for st in states), tuple(id(t) for t in tables), tuple(map(len, tables)))
    layout = batch.memo.get(key)
    if layout is None:
        device, T = batch.positions.device, batch.num_tokens
        width = max(map(len, tables), default=0) or 1
        per_seq = to_device([[st.slot, c.start, c.offset, c.length] for st, c in zip(states, batch.chunks)],
                            torch.long, device)
        padded = to_device([t + [0] * (width - len(t)) for t in tables], torch.long, device)
        seq = torch.arange(len(states), device=device).repeat_interleave(per_seq[:, 3], output_size=T)
        per_query = per_seq[seq]
        layout = PagedLayout(per_query[:, 0:1], per_query[:, 1:2], per_query[:, 2:3], padded, padded[seq])
        batch.memo[key] = layout
    return layout


def block_table(st: AttentionState) -> list[int]:
    """The block table of a paged layer state (its compressed streams read it); window-only layers have none."""
    for comp in (st.compressor, st.indexer):
        if comp is not None:
            return comp.rows.table
    return _NO_TABLE


_NO_TABLE: list[int] = []  # window-only layers: one shared empty table, so their layout is memoised too


@dataclass(frozen=True, slots=True)
class StaticDecode:
    """A decode step whose shapes depend only on its bucket (rows, table width), not on the sequences in it, so
    that a CUDA graph can replay it (`deepserve.model.cuda_graphs`): one new token per row, the rows' slots,
    positions and padded block tables as device tensors (`layout`, one query per row), and the cache's
    `layers` pools (`kv_cache._LayerPools`, one per main layer). Every row is a logits row, in order (the
    forward gathers none: `logits_indices` is all of them). Padding rows use the cache's padding slot;
    table entries past a sequence's pages, and every write a row does not want (a compressed block that did not
    close), go to `trash_page`. The host keeps the row counts (`PagedRows.num_rows`) itself."""

    layers: Sequence
    layout: PagedLayout
    pad_slot: int
    trash_page: int
