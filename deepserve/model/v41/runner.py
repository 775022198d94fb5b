"""The engine's V4.1 runner: `ModelRunner`'s step (placeholders, sampling, logprobs, grammar masks) over V4.1's
sequence states in pages (`paged.V41PagedStates`).

A step's chunks run one sequence at a time through `DeepseekV41ForCausalLM.forward`; a chunk stops at every
page boundary the engine asks a snapshot for (a prefix hit there restores it), which changes nothing in the
result: a prompt in several chunks computes what one prefill does. Prompt chunks (those of a sequence that has
not sampled since its state was made) run with `prompt=True`, so their index sources read the keys one prefill
reads; a decode token keeps the reference's semantics (docs/v41.md).
"""

from __future__ import annotations

import torch

from deepserve.core.interfaces import Backend, ChunkInput, StepInput, StepOutput

from ..batch import ForwardBatch
from ..deepseek_v4 import ForwardOutput
from ..runner import ModelRunner
from .model import DeepseekV41ForCausalLM
from .paged import V41PagedStates
from .state import V41SequenceState


class V41ModelRunner(ModelRunner):
    def __init__(self, model: DeepseekV41ForCausalLM, backend: Backend, states: V41PagedStates, decode=None) -> None:
        super().__init__(model, backend, states, decode)
        self._decoding: set[str] = set()  # requests that sampled since their state was made
        self._step_chunks: list[ChunkInput] = []

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        self._decoding.difference_update(step.freed_request_ids)
        self._step_chunks = []
        out = super().execute(step)
        self._decoding.update(c.request_id for c in self._step_chunks if c.samples)
        return out

    def _state_for(self, chunk: ChunkInput) -> V41SequenceState:
        self._step_chunks.append(chunk)
        return super()._state_for(chunk)

    def _forward(self, batch: ForwardBatch, states, rows) -> ForwardOutput:
        logits = []
        for chunk, info, state, want in zip(self._step_chunks, batch.chunks, states, rows):
            ids = batch.token_ids[info.offset : info.offset + info.length]
            prompt = chunk.request_id not in self._decoding
            logits.append(self._run_chunk(ids, info.start, info.snapshots, state, list(want), prompt))
        return ForwardOutput(streams=None, logits=torch.cat(logits))

    def _run_chunk(self, ids, start: int, snapshots, state: V41SequenceState, want: list[int],
                   prompt: bool) -> torch.Tensor:
        """The logits of the chunk's rows `want` (indices into the chunk), stopping at each snapshot boundary."""
        if state.num_tokens != start:
            raise RuntimeError(f"a V4.1 sequence at token {state.num_tokens} got a chunk at {start}")
        cuts = sorted({b - start for b, _ in snapshots if start < b < start + len(ids)} | {len(ids)})
        pages = {b - start: page for b, page in snapshots}
        out, begin = [], 0
        for end in cuts:
            need = [i - begin for i in want if begin <= i < end]
            last_only = need == [end - begin - 1]
            res = self.model(ids[begin:end], state, all_logits=not last_only, prompt=prompt)
            if need:
                out.append(res.logits.unsqueeze(0) if last_only else res.logits[need])
            if end in pages:
                self.cache.snapshot(pages[end], state)
            begin = end
        return torch.cat(out)
