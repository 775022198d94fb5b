"""Speculative decoding on the model side: the `Proposer` contract and the rollback of rejected drafts.

A verify pass computes a sequence's base token plus its drafts in one chunk, which advances every layer's state
past tokens that may be rejected. V4's state is not append-only (spec 4.5): the window ring overwrites old
rows, and a compressor's frontier (open block, CSA overlap half) moves with every token. `SequenceUndo` is
taken before the pass and rewinds a sequence to any length inside it afterwards, without recomputing:
- window rings: the rows the pass overwrote are saved first and put back for rejected positions;
- compressors: rows past the kept length are truncated (`RowStore` / `PagedRows`), and the open block and the
  overlap half are rebuilt from the projections the compressor recorded during the pass (`FrontierJournal`);
- the token counter is set back. Pages stay with the request (the scheduler reserved them for the drafts).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from .state import AttentionState, SequenceState


class SequenceUndo:
    """Taken just before a pass over positions [start, start + length) of one sequence's main layers."""

    __slots__ = ("state", "start", "length", "rings", "ratios")

    def __init__(self, state: SequenceState, start: int, length: int) -> None:
        if state.num_tokens != start:
            raise ValueError(f"undo taken at {start} but the state holds {state.num_tokens} tokens")
        self.state, self.start, self.length = state, start, length
        self.rings = [save_window(layer, start, length) for layer in state.layers]
        for layer in state.layers:
            for comp in (layer.compressor, layer.indexer):
                if comp is not None:
                    comp.begin_journal()

    def rollback(self, num_tokens: int) -> None:
        """Leave the state as if only the first `num_tokens` tokens of the sequence had ever been computed."""
        if not self.start < num_tokens <= self.start + self.length:
            raise ValueError(f"cannot roll back to {num_tokens}: the pass covered ({self.start}, "
                             f"{self.start + self.length}]")
        for layer, saved in zip(self.state.layers, self.rings):
            layer.window.undo(self.start, saved, num_tokens)
            for comp in (layer.compressor, layer.indexer):
                if comp is not None:
                    comp.rollback(num_tokens, _ratio(layer, comp))
        self.state.num_tokens = num_tokens

    def commit(self) -> None:
        """Keep everything the pass computed."""
        for layer in self.state.layers:
            for comp in (layer.compressor, layer.indexer):
                if comp is not None:
                    comp.journal = None


def save_window(layer: AttentionState, start: int, length: int) -> torch.Tensor:
    return layer.window.save(start, start + length)


def _ratio(layer: AttentionState, comp) -> int:
    return comp.open_kv.shape[0]  # the frontier holds one block: `ratio` rows


@dataclass(slots=True)
class DraftChunk:
    """One sequence of a step, as the proposer sees it after verification.

    The main model computed `num_committed` kept tokens at positions [start, start + num_committed); their
    final mHC streams are rows `stream_rows` of the step's streams. `next_token_ids` are the tokens at
    positions start + 1 .. start + num_committed (the MTP input pairs the streams at i with the token at i + 1;
    the last one is the token just sampled, or the next prompt token of a prefill chunk).
    `num_drafts`: how many tokens to draft for it now (0: only keep the MTP state up to date).
    `snapshots`: (page boundary, page) pairs inside (start, start + num_committed] to save prefix-hit state at.
    """

    state: SequenceState
    start: int
    num_committed: int
    stream_rows: range
    next_token_ids: list[int]
    num_drafts: int
    snapshots: tuple[tuple[int, int], ...] = ()


@dataclass(slots=True)
class Drafts:
    """Drafts of the chunks that asked for them, in chunk order: `token_ids` [D, k] int64, `probs` [D, k, V]
    fp32 (the distribution each draft was sampled from, under the request's sampling parameters; what the
    rejection rule divides by; None when every drafting request is greedy), `confidences` [D, k] fp32 or None
    (a confidence head's acceptance estimates)."""

    token_ids: torch.Tensor
    probs: torch.Tensor | None
    confidences: torch.Tensor | None = None


class Proposer(ABC):
    """Drafts speculative tokens on the device after each target step (what a `deepserve_register_proposers`
    factory builds). The model runner calls `propose` once per step, after verification and rollback, on the
    runner thread; the proposer keeps its per-sequence state inside each `SequenceState`, in the model's state
    owners it names in `state_owners` (for MTP, `mtp_layers`), which the paged cache then allocates beside the
    backbone's, so the runner frees it with the sequence.

    `planner`: the host-side verify planner (None for fixed-k), which the engine uses to trim each sequence's
    drafts before the next step; it has `plan(confidences) -> lengths` and `observe(num_tokens, seconds)`.
    """

    num_speculative_tokens: int
    planner: Any = None
    #: the model's state owners this proposer drafts with (`model.state_owners()` names them)
    state_owners: tuple[str, ...] = ()

    def capture_graphs(self, cache, max_batch: int, batch_sizes=None, capture: bool | None = None) -> int:
        """Capture the drafter's fixed-shape work over `cache` as CUDA graphs, every batch bucket (`batch_sizes`,
        default `cuda_graphs.batch_buckets(max_batch)`) now: the engine calls this at start-up where the backend
        has CUDA graphs and eager mode is off. Returns how many were made; the default drafts eagerly (0)."""
        return 0

    @abstractmethod
    def propose(self, streams: torch.Tensor, chunks: list[DraftChunk], sampling: "RowSampling") -> Drafts | None:
        """Bring every chunk's drafter state up to its committed length and draft `num_drafts` tokens for the
        chunks that ask (all ask for the same k, or 0). `sampling` holds the drafting chunks' sampling
        parameters, one row each. Returns None when no chunk drafts."""


@dataclass(slots=True)
class RowSampling:
    """Per-row sampling parameters on the device (as `Backend.sample` takes them): temperature, top_k, top_p,
    min_p, seeds; `all_greedy` (known on the host) says every temperature is 0."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    seeds: torch.Tensor
    all_greedy: bool = False

    def repeat_rows(self, num_drafts: list[int]) -> RowSampling:
        """Row i repeated 1 + num_drafts[i] times in place: one row per verified position."""
        n = torch.tensor(num_drafts, device=self.seeds.device) + 1
        return RowSampling(*(t.repeat_interleave(n) for t in (self.temperature, self.top_k, self.top_p,
                                                                self.min_p, self.seeds)), self.all_greedy)
