"""The model runner: executes the engine's steps on the device.

It owns the paged KV cache's tensors and each running request's `SequenceState` (a slot plus views into the
pages the request's block table names). A step flattens every chunk into one `ForwardBatch`, fills placeholder
ids from the previous step's samples without leaving the device, runs the model, samples every row in one call
and copies the sampled ids to the host once. Rows of structured-output requests are masked just before
sampling with the grammar bitmask the host filled while the forward ran (logprobs stay the model's own).

A plain step (no logprobs of either kind, no proposer) returns once it is launched: the copy of its samples to
the host is queued on the device and `StepOutput.resolve` waits for it, so the engine's worker launches the next
step while the device computes this one. So that launching never waits for the device, the runner's
host-to-device copies are asynchronous (`to_device`). Steps that read logits on the host stay synchronous: a
CUDA graph's next replay overwrites its logits.

With a speculative `Proposer`, a verifying chunk carries its drafts after its last token: the runner takes an
undo of the sequence's state and computes the chunk, and its `Speculation` (`speculation.py`) resolves the
chunks before the forward and verifies and drafts after it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepserve.sampling import argmax_lowest, compute_logprobs, suppress_tokens, top_logprobs
from deepserve.core.interfaces import (PLACEHOLDER, Backend, ChunkInput, ModelExecutor,
                                       StepInput, StepMasks, StepOutput)
from deepserve.core.outputs import make_logprob_dict

from .batch import make_batch, select_chunks, to_device
from .cuda_graphs import DecodeGraphs
from .deepseek_v4 import DeepseekV4ForCausalLM, ForwardOutput
from .kv_cache import PagedKVCache
from .grammar_mask import mask_bias
from .logits_processors import process_logits
from .speculation import Speculation
from .speculative import Proposer, RowSampling, SequenceUndo
from .state import SequenceState
from .verify_graphs import VerifyGraphs


_ONE_PLACEHOLDER, _ZERO = (PLACEHOLDER,), (0,)


@dataclass(slots=True)
class _Seq:
    state: SequenceState
    slot: int
    table: list[int]  # the cache's page-table views read this list; it grows as the request does


class ModelRunner(ModelExecutor):
    def __init__(self, model: DeepseekV4ForCausalLM, backend: Backend, cache: PagedKVCache, decode=None,
                 proposer: Proposer | None = None, graphs: DecodeGraphs | None = None,
                 verify_graphs: VerifyGraphs | None = None) -> None:
        """`graphs`: run the decode steps it supports as static forwards (CUDA graphs); not with a proposer,
        whose steps verify several tokens per sequence and need the drafter's inputs. `verify_graphs`: with a
        proposer, run the verify chunks it supports (up to its width in tokens a sequence, padded) that way."""
        if graphs is not None and proposer is not None:
            raise ValueError("decode graphs and a speculative proposer do not combine "
                             "(the graphs decode one token per step; verify steps take verify_graphs)")
        if verify_graphs is not None and proposer is None:
            raise ValueError("verify graphs run the verify steps of a speculative proposer: give one")
        self.model, self.backend, self.cache = model, backend, cache
        self.device = torch.device(backend.device)
        self.decode = decode  # token id -> text, for Logprob.decoded_token
        self.speculation = Speculation(self, proposer) if proposer is not None else None
        self.graphs, self.verify_graphs = graphs, verify_graphs
        # a relative chunk's page-boundary snapshots are found here (the engine plans the others): only where
        # prefix caching reads them (`build_engine` sets it from `enable_prefix_caching`)
        self.page_snapshots = True
        self._seqs: dict[str, _Seq] = {}
        self._prev: tuple[torch.Tensor, dict[str, int]] | None = None  # last step's samples and their rows
        self.warm_up_report = None  # what `warm_up` ran (`warm_up.WarmUpReport`), once it has

    @property
    def proposer(self) -> Proposer | None:
        """The speculative drafter (None: no speculation)."""
        return self.speculation.proposer if self.speculation is not None else None

    @proposer.setter
    def proposer(self, proposer: Proposer) -> None:
        if self.speculation is None:
            raise ValueError("this runner was built without speculation: give the proposer to its constructor")
        self.speculation.proposer = proposer

    @property
    def num_free_slots(self) -> int:
        return self.cache.num_free_slots

    @property
    def num_active_sequences(self) -> int:
        return len(self._seqs)

    # -- SWA host slots (deepserve.core.kv.swa_slots): a finished sequence's tail state out, a next turn's in --
    @torch.inference_mode()
    def save_sequence(self, request_id: str) -> tuple[int, bytes] | None:
        """(tokens in its state, its MXFP8 slot payload) of a sequence the runner still holds (a finished one, up
        to the step that frees it); None when it holds none or it ends on a page boundary."""
        from .swa_slots import pack_state

        seq = self._seqs.get(request_id)
        if seq is None or seq.state.num_tokens % self.cache.page_size == 0:
            return None
        return seq.state.num_tokens, pack_state(self.cache, seq.state)

    @torch.inference_mode()
    def restore_sequence(self, request_id: str, table: list[int], num_tokens: int, payload: bytes) -> None:
        """Start a sequence at `num_tokens` tokens from its cached pages (`table`) and a slot payload; its first
        chunk then starts there."""
        from .swa_slots import unpack_state

        if request_id in self._seqs:
            raise ValueError(f"request {request_id!r} already has a sequence state")
        table = list(table)
        state, slot = unpack_state(self.cache, table, num_tokens, payload)
        self._seqs[request_id] = _Seq(state, slot, table)

    def replay_snapshot(self, table: list[int], boundary: int, token_ids, length: int) -> int:
        """Rebuild page `table[boundary / P - 1]`'s window snapshot from the `length` tokens before `boundary`
        (`deepserve.model.swa_replay`); returns the tokens computed."""
        from .swa_replay import replay_snapshot

        return replay_snapshot(self.cache, table, boundary, token_ids, length)

    def warm_up(self, kv_manager, max_step_tokens: int, max_model_len: int, num_speculative_tokens: int = 0,
                progress: bool = True):
        """Run every kind of step the engine will meet (prompt chunks of each length class up to
        `max_step_tokens`, a chunk after a prefix and after a prefix hit, a mixed step, decode steps of the batch
        sizes no graph takes; with a proposer, verify steps of `num_speculative_tokens` drafts) once on scratch
        sequences whose pages come from `kv_manager` (`warm_up.py`), so that their kernels compile now and not in
        a request. The engine calls this at start-up, before it serves; every page and slot is free again after
        it. Returns a `warm_up.WarmUpReport`."""
        from .warm_up import run_warm_up

        try:
            self.warm_up_report = run_warm_up(self, kv_manager, max_step_tokens, max_model_len,
                                              num_speculative_tokens, progress)
            return self.warm_up_report
        finally:
            self._prev = None  # the scratch steps' samples: no request's placeholder may read them

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        clock = _StepClock(self.device)
        for request_id in step.freed_request_ids:
            seq = self._seqs.pop(request_id, None)
            if self.speculation is not None:
                self.speculation.free(request_id)
            if seq is not None:
                self.cache.free_sequence(seq.slot)
        if not step.chunks:
            return StepOutput(seconds=time.perf_counter() - clock.began)
        chunks = step.chunks
        if self.speculation is not None:  # placeholders and relative starts, from this runner's own last step
            chunks = tuple(self.speculation.resolve(c) for c in chunks)
        states = [self._state_for(c) for c in chunks]
        rows = [range(len(c.token_ids)) if c.prompt_targets else
                range(len(c.token_ids) - 1 - c.num_draft_tokens, len(c.token_ids)) for c in chunks]
        batch = make_batch([self._known_ids(c) for c in chunks], [c.start for c in chunks], self.device,
                           logits_rows=rows, snapshots=[c.snapshots for c in chunks])
        batch = self._fill_placeholders(batch, chunks)
        verify = self._verify_graph_chunks(batch, states, chunks)  # (their indices, their batch) or None
        if verify is None:
            undo = {i: self._undo(states[i], c) for i, c in enumerate(chunks) if c.num_draft_tokens}
            forward = self._forward(batch, states, rows)
        elif len(verify[0]) == len(chunks):  # one handle a chunk; the rollback runs batched
            undo = dict(enumerate(self.verify_graphs.begin(batch, states)))
            forward = self.verify_graphs.forward(batch, states)
        else:
            forward, undo = self._verify_beside_prompts(batch, states, chunks, rows, *verify)
        logits = forward.logits
        last_rows = [n - 1 for n in itertools.accumulate(map(len, rows))]  # each chunk's last logits row
        out = StepOutput()
        sampling = [i for i, c in enumerate(chunks) if c.samples]
        picked = [chunks[i] for i in sampling]
        # the step returns before its samples reach the host unless it reads its logits there (logprobs: a CUDA
        # graph's next replay overwrites them) or speculates (the drafter's batch depends on the kept counts)
        deferred = self.proposer is None and not any(c.prompt_targets for c in chunks) \
            and all(c.params.logprobs is None for c in picked)
        tokens = None
        if self.speculation is not None:
            self.speculation.step(step.masks, forward, batch, chunks, last_rows, sampling, undo, out)
        elif sampling:
            grammar = self._grammar_masks(step.masks, sampling, logits.shape[-1], out)
            sampled_rows = to_device([last_rows[i] for i in sampling], torch.long, self.device)
            tokens = self._sample(process_logits(self._masked(logits[sampled_rows], picked), picked, batch.token_ids,
                                                 [batch.chunks[i].offset for i in sampling]), picked, grammar)
            self._prev = (tokens, {c.request_id: row for row, c in enumerate(picked)})
            if not deferred:
                for c, token in zip(picked, tokens.tolist()):  # the step's one planned device-to-host copy
                    out.sampled[c.request_id] = token
                self._logprobs(logits[sampled_rows], tokens, picked, out)
        if deferred:
            out.pending = _read_back_later(out, tokens, [c.request_id for c in picked], clock)
            return out
        self._prompt_logprobs(logits, rows, chunks, out)
        clock.stop()
        out.seconds = clock.seconds()
        return out

    def _forward(self, batch, states, rows) -> ForwardOutput:
        """The step's forward (a verify step that `verify_graphs` takes runs there instead). A decode step
        replays a CUDA graph when `graphs` takes it. A mixed step (decode tokens beside prompt chunks: a request
        arriving while others decode) runs as two forwards, its one-token chunks (a graph, or the batched paged
        decode path) and the rest, instead of sending every decode token down the per-sequence path that long
        chunks need; the logits come back in chunk order. With a proposer the step stays whole here (the drafter
        reads every chunk's streams: `_verify_beside_prompts` splits it where the verify graphs take part)."""
        graphs = self.graphs
        if graphs is not None and graphs.supports(batch, states):
            return graphs.forward(batch, states)
        single = [i for i, c in enumerate(batch.chunks) if c.length == 1]
        rest = [i for i, c in enumerate(batch.chunks) if c.length != 1]
        if self.proposer is not None or len(single) < 2 or not rest:
            return self.model(batch, states)
        decode = select_chunks(batch, single, [range(1)] * len(single))
        decode_states = [states[i] for i in single]
        if graphs is not None and graphs.supports(decode, decode_states):
            first = graphs.forward(decode, decode_states)
        else:
            first = self.model(decode, decode_states)
        others = self.model(select_chunks(batch, rest, [rows[i] for i in rest]), [states[i] for i in rest])
        return self._merged(batch, rows, [(single, first), (rest, others)], streams=False)

    def _merged(self, batch, rows, parts, streams: bool) -> ForwardOutput:
        """Forwards over disjoint sets of the step's chunks (`parts`: (chunk indices, output)) as one output in the
        step's order: logits rows as `rows` lays them out and, with `streams`, every token row's streams."""
        start = [0]
        for r in rows:
            start.append(start[-1] + len(r))
        first = parts[0][1]
        logits = first.logits.new_empty((start[-1], first.logits.shape[1]))
        merged = first.streams.new_empty((batch.num_tokens, *first.streams.shape[1:])) if streams else None
        for which, out in parts:
            logits[to_device([start[i] + j for i in which for j in range(len(rows[i]))], torch.long, self.device)] = \
                out.logits
            if streams:
                spans = [range(batch.chunks[i].offset, batch.chunks[i].offset + batch.chunks[i].length) for i in which]
                merged[to_device([t for span in spans for t in span], torch.long, self.device)] = out.streams
        return ForwardOutput(streams=merged, logits=logits)

    def _verify_graph_chunks(self, batch, states, chunks):
        """(indices, batch) of the chunks `verify_graphs` runs in this step: every chunk that is a sampled token
        and its drafts (k or fewer, padded up to the graph's width) without prompt logprobs, when one of them
        verifies drafts and the graphs take them all (the rest, prompt chunks, run eagerly beside them). None: the
        step runs eagerly."""
        verify = self.verify_graphs
        if verify is None:
            return None
        which = [i for i, c in enumerate(chunks)
                 if c.samples and not c.prompt_targets and len(c.token_ids) == 1 + c.num_draft_tokens]
        if not any(chunks[i].num_draft_tokens for i in which):
            return None
        if len(which) == len(chunks):
            return (which, batch) if verify.supports(batch.chunks, states) else None
        if not verify.supports([batch.chunks[i] for i in which], [states[i] for i in which]):
            return None
        return which, select_chunks(batch, which, [range(batch.chunks[i].length) for i in which])

    def _verify_beside_prompts(self, batch, states, chunks, rows, which: list[int], verify_batch):
        """A step whose verify chunks (`which`, their `verify_batch`) the graphs take beside prompt chunks: the
        verify chunks through the graphs (their handles), the rest eagerly (their undos where they verify drafts),
        one output in the step's order, streams included (the drafter reads them). Returns (output, undo by chunk
        index)."""
        taken = set(which)
        rest = [i for i in range(len(chunks)) if i not in taken]
        verify_states = [states[i] for i in which]
        undo = dict(zip(which, self.verify_graphs.begin(verify_batch, verify_states)))
        undo.update({i: self._undo(states[i], chunks[i]) for i in rest if chunks[i].num_draft_tokens})
        verified = self.verify_graphs.forward(verify_batch, verify_states)
        others = self.model(select_chunks(batch, rest, [rows[i] for i in rest]), [states[i] for i in rest])
        return self._merged(batch, rows, [(which, verified), (rest, others)], streams=True), undo

    def _undo(self, state: SequenceState, chunk: ChunkInput) -> SequenceUndo:
        """The undo of a verifying chunk's pass, taken before it (a model with another state brings its own)."""
        return SequenceUndo(state, chunk.start, len(chunk.token_ids))

    def _state_for(self, chunk: ChunkInput) -> SequenceState:
        seq = self._seqs.get(chunk.request_id)
        if seq is None:
            table = list(chunk.block_table)
            state, slot = self.cache.new_sequence(table, chunk.start)
            seq = self._seqs[chunk.request_id] = _Seq(state, slot, table)
        elif len(chunk.block_table) > len(seq.table):
            seq.table.extend(chunk.block_table[len(seq.table):])
        return seq.state

    @staticmethod
    def _known_ids(chunk: ChunkInput) -> Sequence[int]:
        ids = chunk.token_ids
        if ids == _ONE_PLACEHOLDER:  # a decode step's token: the last step's sample, filled on the device
            return _ZERO
        return [0 if t == PLACEHOLDER else t for t in ids]

    def _fill_placeholders(self, batch, chunks):
        """The batch's placeholder ids from the previous step's samples, on the device: one copy when a decode
        step's rows are the previous step's samples in order (the common case), else one gather."""
        where = [(c_offset.offset + j, c.request_id) for c, c_offset in zip(chunks, batch.chunks)
                 if PLACEHOLDER in c.token_ids for j, t in enumerate(c.token_ids) if t == PLACEHOLDER]
        if not where:
            return batch
        if self._prev is None:
            raise RuntimeError("a step holds placeholder tokens but no step before it sampled any")
        tokens, row_of = self._prev
        positions = [p for p, _ in where]
        sources = [row_of[r] for _, r in where]
        n = len(positions)
        if n == batch.num_tokens == tokens.shape[0] and positions == sources == list(range(n)):
            batch.token_ids.copy_(tokens)
            return batch
        index = to_device(positions + sources, torch.long, self.device)
        batch.token_ids[index[:n]] = tokens[index[n:]]
        return batch

    @staticmethod
    def _wait_bitmask(masks: StepMasks | None, out: StepOutput):
        """The step's grammar bitmask once the host has filled it (None: no constrained rows), timing the wait."""
        if masks is None:
            return None
        began = time.perf_counter()
        bitmask = masks.bitmask.result()
        out.mask_wait_seconds = time.perf_counter() - began
        return bitmask

    def _grammar_masks(self, masks: StepMasks | None, sampling: list[int], vocab_size: int, out: StepOutput):
        """(sampling rows, their mask bias [rows, V] on the device), or None. Waits for the host to finish the
        bitmask: the forward has run meanwhile."""
        bitmask = self._wait_bitmask(masks, out)
        if bitmask is None:
            return None
        row_of = {chunk_index: row for row, chunk_index in enumerate(sampling)}
        rows = [row_of[i] for i in masks.chunk_indices]
        return rows, mask_bias(bitmask, vocab_size, self.device)

    def _row_sampling(self, chunks: list[ChunkInput]) -> RowSampling:
        p = [c.params for c in chunks]

        def col(values, dtype):
            return to_device(values, dtype, self.device)

        return RowSampling(col([x.temperature for x in p], torch.float32), col([x.top_k for x in p], torch.long),
                           col([x.top_p for x in p], torch.float32), col([x.min_p for x in p], torch.float32),
                           col([c.seed for c in chunks], torch.long), all(x.temperature == 0 for x in p))

    def _masked(self, logits: torch.Tensor, chunks: list[ChunkInput]) -> torch.Tensor:
        """The sampled rows' logits with min_tokens' blocked ids applied."""
        blocked = [(i, t) for i, c in enumerate(chunks) for t in c.blocked_token_ids]
        if not blocked:
            return logits
        r, t = zip(*blocked)
        return suppress_tokens(logits, to_device(r, torch.long, self.device), to_device(t, torch.long, self.device))

    def _sample(self, logits: torch.Tensor, chunks: list[ChunkInput], grammar=None) -> torch.Tensor:
        """`logits`: the sampled rows', min_tokens' blocked ids and the requests' logits processing applied."""
        if grammar is not None:  # `logits` is a gathered copy: masking it leaves the logprobs' logits alone
            rows, bias = grammar
            bias = bias.to(logits.dtype)
            if rows == list(range(len(chunks))):
                logits.add_(bias)
            else:
                logits.index_add_(0, to_device(rows, torch.long, self.device), bias)
        if all(c.params.temperature == 0 for c in chunks):
            # every row greedy: `Backend.sample`'s greedy rows are the argmax with the lowest id on ties; its
            # sampling path (filters, noise) would run for nothing
            return argmax_lowest(logits.float())
        rs = self._row_sampling(chunks)
        positions = to_device([c.start + len(c.token_ids) for c in chunks], torch.long, self.device)
        return self.backend.sample(logits, rs.temperature, rs.top_k, rs.top_p, rs.min_p, rs.seeds, positions)

    def _logprobs(self, logits, tokens, chunks: list[ChunkInput], out: StepOutput) -> None:
        want = [i for i, c in enumerate(chunks) if c.params.logprobs is not None]
        if not want:
            return
        k = max(chunks[i].params.logprobs for i in want)
        values, ids, ranks = top_logprobs(compute_logprobs(logits[want]), tokens[want], k)
        for row, i in enumerate(want):
            n = chunks[i].params.logprobs + 1
            rid = chunks[i].request_id
            out.logprobs[rid] = make_logprob_dict(ids[row, :n].tolist(), values[row, :n].tolist(),
                                                  [int(ranks[row])] + list(range(1, n)), self.decode)
            out.sampled_logprobs[rid] = float(values[row, 0])

    def _prompt_logprobs(self, logits, rows, chunks: tuple[ChunkInput, ...], out: StepOutput) -> None:
        offset = 0
        for chunk, r in zip(chunks, rows):
            if chunk.prompt_targets:
                n, k = len(chunk.prompt_targets), chunk.params.prompt_logprobs or 0
                targets = torch.tensor(chunk.prompt_targets, device=self.device)
                values, ids, ranks = top_logprobs(compute_logprobs(logits[offset : offset + n]), targets, k)
                out.prompt_logprobs[chunk.request_id] = [
                    make_logprob_dict(ids[j].tolist(), values[j].tolist(), [int(ranks[j])] + list(range(1, k + 1)),
                                      self.decode)
                    for j in range(n)
                ]
            offset += len(r)


class _StepClock:
    """How long a step took. On CUDA, the device's time between two events around the step's work on the
    current stream (the host launches a step while the one before it still runs, and may return before it
    ends); elsewhere the step's wall time on the host, which is the device's time there."""

    def __init__(self, device: torch.device) -> None:
        self.began, self.wall = time.perf_counter(), 0.0
        self.stream = self.events = None
        if device.type == "cuda":
            self.stream = torch.cuda.current_stream(device)
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self.events[0].record(self.stream)

    def stop(self) -> None:
        """The step's last launch is done (on CUDA, `seconds` then waits for everything launched before)."""
        self.wall = time.perf_counter() - self.began
        if self.events is not None:
            self.events[1].record(self.stream)

    def seconds(self) -> float:
        """The step's time, once its work is done (waits for it)."""
        if self.events is None:
            return self.wall
        start, end = self.events
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def _read_back_later(out: StepOutput, tokens: torch.Tensor | None, request_ids: list[str], clock: _StepClock):
    """Start copying a step's samples `tokens` (on the device; None: it samples nothing) to the host, and return
    the `StepOutput.pending` finalizer that waits for them and fills `out`'s samples and time."""
    host = None
    if tokens is not None:
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=tokens.is_cuda)
        host.copy_(tokens, non_blocking=True)
    clock.stop()  # after the copy: the clock's end event is also the copy's

    def read_back() -> None:
        out.seconds = clock.seconds()
        if host is not None:
            out.sampled.update(zip(request_ids, host.tolist()))

    return read_back
