"""The model runner: turns one step's plan (which sequences compute which new tokens) into a forward pass,
samples the next tokens, and gathers the logprobs requests asked for. One device-to-host copy per step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from deepserve.core.interfaces import Backend
from deepserve.core.outputs import PositionLogprobs, make_logprob_dict
from deepserve.core.sampling_params import SamplingParams
from deepserve.backends.reference.sampling import compute_logprobs, suppress_tokens, top_logprobs

from .batch import make_batch
from .deepseek_v4 import DeepseekV4ForCausalLM
from .state import SequenceState


@dataclass(slots=True)
class SeqWork:
    """One sequence's share of a step. `sample`: its last new token ends the prompt or is a decode token, so a
    token is drawn from its logits. `prompt_targets`: for prompt-logprob requests, the token that follows each
    new token inside the prompt (None past the prompt's end)."""

    state: SequenceState
    token_ids: list[int]
    start: int
    params: SamplingParams
    seed: int
    sample: bool = True
    blocked_ids: list[int] = field(default_factory=list)
    prompt_targets: list[int | None] | None = None


@dataclass(slots=True)
class SeqResult:
    token_id: int | None = None
    logprob: float | None = None
    logprobs: PositionLogprobs | None = None
    prompt_logprobs: list[PositionLogprobs | None] = field(default_factory=list)


class ModelRunner:
    def __init__(self, model: DeepseekV4ForCausalLM, backend: Backend, decode=None) -> None:
        self.model, self.backend = model, backend
        self.device = torch.device(backend.device)
        self.decode = decode  # token id -> text, for Logprob.decoded_token

    def new_state(self) -> SequenceState:
        return self.model.make_state()

    @torch.inference_mode()
    def step(self, work: Sequence[SeqWork]) -> list[SeqResult]:
        rows = [range(len(w.token_ids)) if w.prompt_targets is not None else [len(w.token_ids) - 1] for w in work]
        batch = make_batch([w.token_ids for w in work], [w.start for w in work], self.device, logits_rows=rows)
        logits = self.model(batch, [w.state for w in work]).logits
        last = torch.tensor([sum(map(len, rows[: i + 1])) - 1 for i in range(len(work))], device=self.device)
        sample_logits = logits[last]
        blocked = [(i, t) for i, w in enumerate(work) for t in w.blocked_ids]
        if blocked:
            r, t = zip(*blocked)
            sample_logits = suppress_tokens(sample_logits, torch.tensor(r), torch.tensor(t))
        p = [w.params for w in work]
        tokens = self.backend.sample(
            sample_logits,
            torch.tensor([x.temperature for x in p], device=self.device),
            torch.tensor([x.top_k for x in p], device=self.device),
            torch.tensor([x.top_p for x in p], device=self.device),
            torch.tensor([x.min_p for x in p], device=self.device),
            torch.tensor([w.seed for w in work], dtype=torch.long, device=self.device),
            torch.tensor([w.start + len(w.token_ids) for w in work], dtype=torch.long, device=self.device),
        )
        results = [SeqResult() for _ in work]
        want = [i for i, w in enumerate(work) if w.sample and w.params.logprobs is not None]
        host_tokens = tokens.tolist()  # the step's one planned device-to-host copy
        for i, w in enumerate(work):
            if w.sample:
                results[i].token_id = host_tokens[i]
        if want:
            k = max(work[i].params.logprobs for i in want)
            lp = compute_logprobs(logits[last[want]])
            values, ids, ranks = top_logprobs(lp, tokens[want], k)
            for row, i in enumerate(want):
                n = work[i].params.logprobs + 1
                results[i].logprobs = make_logprob_dict(ids[row, :n].tolist(), values[row, :n].tolist(),
                                                        [int(ranks[row])] + list(range(1, n)), self.decode)
                results[i].logprob = float(values[row, 0])
        self._prompt_logprobs(work, rows, logits, results)
        return results

    def _prompt_logprobs(self, work, rows, logits, results) -> None:
        offset = 0
        for i, w in enumerate(work):
            n = len(rows[i])
            if w.prompt_targets is not None:
                targets = [t for t in w.prompt_targets if t is not None]
                if targets:
                    k = w.params.prompt_logprobs or 0
                    lp = compute_logprobs(logits[offset : offset + len(targets)])
                    values, ids, ranks = top_logprobs(lp, torch.tensor(targets, device=self.device), k)
                    for r in range(len(targets)):
                        results[i].prompt_logprobs.append(make_logprob_dict(
                            ids[r].tolist(), values[r].tolist(), [int(ranks[r])] + list(range(1, k + 1)), self.decode))
            offset += n
