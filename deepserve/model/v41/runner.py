"""The engine's V4.1 runner: `ModelRunner`'s step (placeholders, sampling, logprobs, grammar masks, speculative
verification) over V4.1's sequence states in pages (`paged.V41PagedStates`).

A step's prompt chunks run one sequence at a time through `DeepseekV41ForCausalLM.forward`; a chunk stops at
every page boundary the engine asks a snapshot for (a prefix hit there restores it), which changes nothing in
the result: a prompt in several chunks computes what one prefill does. Prompt chunks (those of a sequence that
has not sampled since its state was made) run with `prompt=True`, so their index sources read the keys one
prefill reads; a decode token keeps the reference's semantics (docs/v41.md).

The step's decode tokens, of every sequence, run in one `forward_decode` (batched; each row the bits of that
sequence's decode step alone). With a proposer (DSpark, `plugins/speculative/dspark_v41.py`) the step's streams
are the DSpark taps of every row, and a verifying chunk [token, drafts...] runs as decode steps: one token at a
time, the i-th tokens of all verifying chunks and the decode tokens in one forward, or (`one_forward_verify`)
every token of every chunk in the same `forward_decode`, each row the decode step after the chunk's rows before
it (`decode_rows.py`); either way its logits are those of plain decoding and greedy output with speculation
equals greedy output without it. The undo (`V41Undo`) keeps the state after each of its tokens and puts back
the one verification keeps.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from deepserve.core.interfaces import Backend, ChunkInput, StepInput, StepOutput

from ..batch import ForwardBatch
from ..deepseek_v4 import ForwardOutput
from ..runner import ModelRunner, _Seq
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

    def keep(self, num_tokens: int, saved: tuple) -> None:
        """The state after the pass's token that brought the sequence to `num_tokens`, saved by the forward
        that computed several of its tokens (`forward_decode`'s `saved`)."""
        self._saved[num_tokens] = saved

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
        # True: a verifying chunk's tokens in one forward; False: one forward per token, the chunks in lockstep.
        # The same bits on the CPU (tests/test_v41_verify.py, tests/test_v41_batched.py), where it is on; on a
        # device off until its path there (a ring copy between a sequence's rows) has run
        self.one_forward_verify = torch.device(backend.device).type == "cpu"

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

    # -- SWA host slots (docs/v41.md): V4.1's state past the last full page, kept exactly (`swa_slots.py`) -----
    @torch.inference_mode()
    def save_sequence(self, request_id: str) -> tuple[int, bytes] | None:
        """(tokens in its state, its slot payload) of a sequence the runner still holds; None when it holds none,
        it ends on a page boundary, or (with DSpark) the drafter's rings lag its tokens, which its next turn's
        drafting could not start from."""
        from .swa_slots import pack_state

        seq = self._seqs.get(request_id)
        if seq is None or seq.state.num_tokens % self.cache.page_size == 0:
            return None
        if self.proposer is not None and seq.state.dspark_num_tokens != seq.state.num_tokens:
            return None
        return seq.state.num_tokens, pack_state(self.cache, seq.state)

    @torch.inference_mode()
    def restore_sequence(self, request_id: str, table: list[int], num_tokens: int, payload: bytes) -> None:
        """Start a sequence at `num_tokens` tokens from its cached pages (`table`) and a slot payload; its first
        chunk, a prompt chunk (a new request), starts there."""
        from .swa_slots import unpack_state

        if request_id in self._seqs:
            raise ValueError(f"request {request_id!r} already has a sequence state")
        table = list(table)
        state, slot = unpack_state(self.cache, table, num_tokens, payload)
        self._seqs[request_id] = _Seq(state, slot, table)

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
        """The step's decode tokens and verifying chunks [token, drafts...] as decode steps: with
        `one_forward_verify`, every token of every such chunk in one `forward_decode` (unless a chunk is longer
        than its sequence's tokens so far), else the i-th tokens of all chunks in one, a forward per token; each
        row gets the bits of that sequence's decode step after the chunk's rows before it, so batching changes
        no output. A verifying chunk's state is kept after each of its tokens (its undo); a page boundary
        snapshot is taken where a sequence crosses one (past what verification keeps it is harmless: that page
        is not full, so no prefix hit reads it before the sequence crosses the boundary again and snapshots
        anew)."""
        if self.one_forward_verify and all(s.state.num_tokens >= s.ids.shape[0] for s in stepped):
            self._run_decode_rows(stepped, logits, taps)
        else:
            self._run_decode_lockstep(stepped, logits, taps)

    def _run_decode_rows(self, stepped: list["_Stepped"], logits: list, taps: list) -> None:
        rows = [(s, i) for s in stepped for i in range(s.ids.shape[0])]
        starts = {s.index: s.state.num_tokens for s in stepped}
        last = {s.index: s.ids.shape[0] - 1 for s in stepped}
        keep = [i < last[s.index] and (s.undo is not None or starts[s.index] + i + 1 in s.pages) for s, i in rows]
        res = self.model.forward_decode(torch.cat([s.ids for s in stepped]), [s.state for s, _ in rows], keep)
        out = {s.index: [] for s in stepped}
        for r, (s, i) in enumerate(rows):
            n = starts[s.index] + i + 1  # the sequence's tokens after this row
            if s.undo is not None:
                if i == last[s.index]:
                    s.undo.record()
                else:
                    s.undo.keep(n, res.saved[r])
            if n in s.pages:
                self._snapshot_at(s.pages[n], s.state, None if i == last[s.index] else res.saved[r])
            if i in s.want:
                out[s.index].append(r)
        first = 0  # the chunk's first row
        for s in stepped:
            logits[s.index] = res.logits[out[s.index]]
            taps[s.index] = res.main_hidden[first : first + s.ids.shape[0]] if res.main_hidden is not None else None
            first += s.ids.shape[0]

    def _snapshot_at(self, page: int, state: V41SequenceState, saved: tuple | None) -> None:
        """Page `page`'s boundary snapshot from `state`, or from `saved` (the state a row left, before the rows
        after it in the same forward)."""
        if saved is None:
            self.cache.snapshot(page, state)
            return
        now = state.save()
        state.load(saved)
        self.cache.snapshot(page, state)
        state.load(now)

    def _run_decode_lockstep(self, stepped: list["_Stepped"], logits: list, taps: list) -> None:
        """The i-th token of every chunk in one `forward_decode`, one forward per token."""
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
