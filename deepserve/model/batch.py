"""The variable-length batch one forward pass computes: new tokens of several sequences, flattened, no padding."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .state import SequenceState


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
    """Token ids and positions [T] of all new tokens, the chunk layout, and which rows need logits."""

    token_ids: torch.Tensor
    positions: torch.Tensor
    chunks: tuple[SeqChunk, ...]
    logits_indices: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


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
    return ForwardBatch(
        token_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.tensor(pos, dtype=torch.long, device=device),
        chunks=tuple(chunks),
        logits_indices=torch.tensor(want, dtype=torch.long, device=device),
    )


def check_states(batch: ForwardBatch, states: Sequence[SequenceState]) -> None:
    """Every chunk must continue its sequence exactly where its state stops."""
    if len(states) != len(batch.chunks):
        raise ValueError(f"{len(batch.chunks)} chunks but {len(states)} sequence states")
    for i, (chunk, state) in enumerate(zip(batch.chunks, states)):
        if chunk.start != state.num_tokens:
            raise ValueError(f"sequence {i}: chunk starts at {chunk.start} but its state holds {state.num_tokens} tokens")
