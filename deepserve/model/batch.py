"""The variable-length batch one forward pass computes: new tokens of several sequences, flattened, no padding."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .state import SequenceState


class SeqChunk(NamedTuple):
    """`length` new tokens of one sequence, at positions `start ..`; rows `offset ..` of the flat batch (a named
    tuple: one per sequence per step, built faster than a frozen dataclass).

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

    A fixed-shape decode step (`layouts.StaticStep`) has no host-side chunks: one token per row, every row a
    logits row."""

    token_ids: torch.Tensor
    positions: torch.Tensor
    chunks: tuple[SeqChunk, ...]
    logits_indices: torch.Tensor

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
        ids.extend(map(int, tokens))
        pos.extend(range(start, start + n))
        rows = (n - 1,) if logits_rows is None else logits_rows[i]
        if type(rows) is range and rows.step == 1:  # (the runner's: each chunk's last rows, or all of them)
            want.extend(range(offset + rows.start, offset + rows.stop))
        else:
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
