"""The engine's V4.1 runner: `ModelRunner`'s step (placeholders, sampling, logprobs, grammar masks, speculative
verification) over V4.1's sequence states in pages (`paged.V41PagedStates`).

A step's prompt chunks run one sequence at a time through `DeepseekV41ForCausalLM.forward`; a chunk stops at
every page boundary the engine asks a snapshot for (a prefix hit there restores it), which changes nothing in
the result: a prompt in several chunks computes what one prefill does. Prompt chunks (those of a sequence that
has not sampled since its state was made) run with `prompt=True`, so their index sources read the keys one
prefill reads; a decode token keeps the reference's semantics (docs/v41.md).

The step's decode tokens, of every sequence, run in one `forward_decode` (batched; each row the bits of that
sequence's decode step alone). With a proposer (DSpark, `plugins/speculative/dspark_v41.py`) the step's streams
are the DSpark taps of every row, and a verifying chunk [token, drafts...] runs one token at a time, each a
decode step batched with the other sequences' (the i-th tokens of all verifying chunks and the decode tokens
in one forward), so that its logits are those of plain decoding and greedy output with speculation equals
greedy output without it; the undo (`V41Undo`) keeps the state after each of its tokens and puts back the one
verification keeps.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from deepserve.core.interfaces import Backend, ChunkInput, StepInput, StepOutput

from ..batch import ForwardBatch
from ..deepseek_v4 import ForwardOutput
from ..runner import ModelRunner
from .model import DeepseekV41ForCausalLM
from .paged import V41PagedStates
from .state import V41SequenceState


#: requests whose prompt end the runner remembers for a recompute after preemption (a few ints each)
PROMPT_ENDS_KEPT = 65536


class V41Undo:
    """The rollback of one verifying pass over [start, start + length): the state after each of its tokens."""

    def __init__(self, state: V41SequenceState, start: int, length: int) -> None:
        if state.num_tokens != start:
            raise ValueError(f"undo taken at {start} but the state holds {state.num_tokens} tokens")
        self.state, self.start, self.length = state, start, length
        self._saved: dict[int, tuple] = {}

    def record(self) -> None:
        """Called by the pass after each token it computed."""
        self._saved[self.state.num_tokens] = self.state.save()

    def rollback(self, num_tokens: int) -> None:
        """Leave the state as if only the first `num_tokens` tokens of the sequence had been computed."""
        if num_tokens not in self._saved:
            raise ValueError(f"cannot roll back to {num_tokens}: the pass covered ({self.start}, "
                             f"{self.start + self.length}]")
        self.state.load(self._saved[num_tokens])
        self._saved.clear()

    def commit(self) -> None:
        self._saved.clear()


@dataclass(slots=True)
class _Stepped:
    """A chunk the step runs as decode steps (`V41ModelRunner._run_decode_steps`)."""

    index: int  # the chunk's place in the step
    ids: torch.Tensor
    pages: dict[int, int]  # token count -> the page whose boundary snapshot it takes
    want: set[int]  # rows (indices into the chunk) whose logits the step reads
    state: V41SequenceState
    undo: V41Undo | None  # a verifying chunk's


class V41ModelRunner(ModelRunner):
    def __init__(self, model: DeepseekV41ForCausalLM, backend: Backend, states: V41PagedStates, decode=None,
                 proposer=None) -> None:
        super().__init__(model, backend, states, decode, proposer=proposer)
        if proposer is not None and hasattr(proposer, "bind"):
            proposer.bind(states)  # the drafter saves its rings into the page snapshots
        self._decoding: set[str] = set()  # requests that sampled since their state was made
        # where each request's prompt ended (its first sample), kept past a preemption so that the recompute
        # runs its generated tokens as the decode steps that made them; the oldest are forgotten past the bound
        self._prompt_ends: OrderedDict[str, int] = OrderedDict()
        self._step_chunks: list[ChunkInput] = []
        self._undos: list[V41Undo] = []  # this step's, in chunk order

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        self._decoding.difference_update(step.freed_request_ids)
        self._step_chunks, self._undos = [], []
        out = super().execute(step)
        for c in self._step_chunks:
            if c.samples and c.request_id not in self._decoding and c.request_id not in self._prompt_ends:
                self._prompt_ends[c.request_id] = c.start + len(c.token_ids)
                if len(self._prompt_ends) > PROMPT_ENDS_KEPT:
                    self._prompt_ends.popitem(last=False)
        self._decoding.update(c.request_id for c in self._step_chunks if c.samples)
        return out

    def replay_snapshot(self, table: list[int], boundary: int, token_ids, length: int) -> int:
        """Rebuild page `table[boundary / P - 1]`'s snapshot from the rows the pages of `table` hold and the
        `length` tokens before `boundary` (fewer where the prefix is shorter; `replay.replay_state`); returns the
        tokens computed. The backbone only: DSpark's rings are not replayed (the engine refuses a drafter with a
        store that keeps no snapshots). A prompt's state: pages that decode steps filled are replayed as prompt."""
        from .replay import replay_state

        length = min(length, boundary)
        state = replay_state(self.model, token_ids, boundary, length, self.cache.prefix_state(table, boundary))
        self.cache.snapshot(table[boundary // self.cache.page_size - 1], state)
        return length

    def _state_for(self, chunk: ChunkInput) -> V41SequenceState:
        self._step_chunks.append(chunk)
        return super()._state_for(chunk)

    def _undo(self, state: V41SequenceState, chunk: ChunkInput) -> V41Undo:
        self._undos.append(V41Undo(state, chunk.start, len(chunk.token_ids)))
        return self._undos[-1]

    def _forward(self, batch: ForwardBatch, states, rows) -> ForwardOutput:
        n = len(self._step_chunks)
        logits, taps = [None] * n, [None] * n
        stepped: list[_Stepped] = []  # decode tokens and verifying chunks: one batched forward a token
        undos = iter(self._undos)
        for k, (chunk, info, state, want) in enumerate(zip(self._step_chunks, batch.chunks, states, rows)):
            ids = batch.token_ids[info.offset : info.offset + info.length]
            if chunk.num_draft_tokens or (info.length == 1 and chunk.request_id in self._decoding):
                if state.num_tokens != info.start:
                    raise RuntimeError(f"a V4.1 sequence at token {state.num_tokens} got a chunk at {info.start}")
                undo = next(undos) if chunk.num_draft_tokens else None
                stepped.append(_Stepped(k, ids, dict(info.snapshots), set(want), state, undo))
            else:
                # a prompt chunk, or a preempted request's recompute (decode steps from where its prompt ended)
                decode_from = info.start if chunk.request_id in self._decoding else \
                    self._prompt_ends.get(chunk.request_id, info.start + info.length)
                logits[k], taps[k] = self._run_chunk(ids, info.start, info.snapshots, state, list(want), decode_from)
        if stepped:
            self._run_decode_steps(stepped, logits, taps)
        streams = torch.cat(taps) if self.proposer is not None and taps[0] is not None else None
        return ForwardOutput(streams=streams, logits=torch.cat(logits))

    def _run_decode_steps(self, stepped: list["_Stepped"], logits: list, taps: list) -> None:
        """The step's decode tokens and verifying chunks [token, drafts...] as decode steps in lockstep: the
        i-th token of every such chunk in one `forward_decode`, which gives each row the bits of that sequence's
        decode step alone, so batching changes no output. A verifying chunk's state is recorded after each of
        its tokens (its undo); a page boundary snapshot is taken where a sequence crosses one (past what
        verification keeps it is harmless: that page is not full, so no prefix hit reads it before the
        sequence crosses the boundary again and snapshots anew)."""
        out = {s.index: [] for s in stepped}
        tap = {s.index: [] for s in stepped}
        for i in range(max(s.ids.shape[0] for s in stepped)):
            active = [s for s in stepped if i < s.ids.shape[0]]
            res = self.model.forward_decode(torch.stack([s.ids[i] for s in active]), [s.state for s in active])
            for r, s in enumerate(active):
                if s.undo is not None:
                    s.undo.record()
                if s.state.num_tokens in s.pages:
                    self.cache.snapshot(s.pages[s.state.num_tokens], s.state)
                if i in s.want:
                    out[s.index].append(res.logits[r : r + 1])
                tap[s.index].append(res.main_hidden[r : r + 1] if res.main_hidden is not None else None)
        for s in stepped:
            logits[s.index] = torch.cat(out[s.index])
            taps[s.index] = torch.cat(tap[s.index]) if tap[s.index][0] is not None else None

    def _run_chunk(self, ids, start: int, snapshots, state: V41SequenceState, want: list[int], decode_from: int):
        """The logits of the chunk's rows `want` (indices into the chunk) and every row's DSpark taps, stopping
        at each snapshot boundary: positions before `decode_from` as prompt, the rest one-token decode steps."""
        if state.num_tokens != start:
            raise RuntimeError(f"a V4.1 sequence at token {state.num_tokens} got a chunk at {start}")
        n, first_decode = len(ids), max(decode_from - start, 0)
        cuts = {b - start for b, _ in snapshots if start < b < start + n} | {n} | set(range(first_decode, n))
        cuts.discard(0)
        pages = {b - start: page for b, page in snapshots}
        out, taps, begin = [], [], 0
        for end in sorted(cuts):
            need = [i - begin for i in want if begin <= i < end]
            last_only = need == [end - begin - 1]
            res = self.model(ids[begin:end], state, all_logits=not last_only, prompt=begin < first_decode)
            if need:
                out.append(res.logits.unsqueeze(0) if last_only else res.logits[need])
            taps.append(res.main_hidden)
            if end in pages:
                self.cache.snapshot(pages[end], state)
            begin = end
        return torch.cat(out), (torch.cat(taps) if taps[0] is not None else None)
