"""`Request`: one generation request as the scheduler tracks it. Plain Python, no torch.

The one counter that matters is `num_computed_tokens`: how many of the request's tokens (prompt, then output)
already have KV in the cache. It chases `num_tokens`; every step the scheduler gives a request some of the gap,
a prefix-cache hit closes part of it for free, and preemption by recompute resets it to 0.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from deepserve.core.outputs import FinishReason
from deepserve.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @classmethod
    def from_finish_reason(cls, reason: FinishReason) -> RequestStatus:
        return {"stop": cls.FINISHED_STOPPED, "length": cls.FINISHED_LENGTH, "abort": cls.FINISHED_ABORTED}[reason]


_FINISHED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED})


class TokenIds(Sequence[int]):
    """A request's tokens, prompt then output, read in place: `len`, indexing and slicing without first joining
    the two lists (a step reads a few tokens of each running request; joining copied its whole prompt each time,
    ~30 ms a step at 256 requests of 4K-token prompts: bench/engine_host.py)."""

    __slots__ = ("prompt", "output")

    def __init__(self, prompt: list[int], output: list[int]) -> None:
        self.prompt, self.output = prompt, output

    def __len__(self) -> int:
        return len(self.prompt) + len(self.output)

    def __getitem__(self, index):
        n = len(self.prompt)
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return list(self)[index]
            if stop <= n:
                return self.prompt[start:stop]
            if start >= n:
                return self.output[start - n : stop - n]
            return self.prompt[start:] + self.output[: stop - n]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"token {index} of {len(self)}")
        return self.prompt[index] if index < n else self.output[index - n]

    def __iter__(self):
        yield from self.prompt
        yield from self.output


class Request:
    """A live request, owned by the scheduler. Other layers see it through value objects (`SchedulerOutput`).

    `arrival_order` is set by the scheduler when the request is added (FIFO tie-breaks). `num_cached_tokens` is
    the prompt prefix found in the prefix cache at first admission (0 until then). `stop_reason` is the stop
    token id that ended the request, if one did. `awaiting_grammar`: its structured-output grammar is still
    compiling, so it may prefill but not sample yet (the engine clears it when the grammar is ready).

    Speculative decoding: `spec_token_ids` are drafts for the positions after the last token (with
    `spec_confidences`, when the drafter estimates them); the next step verifies them as extra tokens of the
    catch-up. `num_draft_tokens`, `num_verified_tokens`, `num_accepted_tokens` count drafts made, verified
    and kept over the request's life (drafts made: the drafter's, or, where `spec_forced`, the tokens the
    request's grammar forces next, which replace the drafter's for that step). With asynchronous scheduling, `num_pending_tokens` of a verify step in
    flight is an upper bound (1 + its drafts), as is `num_computed_tokens`; the update corrects both.
    """

    __slots__ = (
        "request_id", "prompt_token_ids", "sampling_params", "cache_salt", "arrival_order", "output_token_ids",
        "num_computed_tokens", "num_cached_tokens", "num_preemptions", "status", "finish_reason", "stop_reason",
        "num_pending_tokens", "awaiting_grammar", "spec_token_ids", "spec_confidences", "num_draft_tokens",
        "num_verified_tokens", "num_accepted_tokens", "next_drafts", "num_drafts_in_flight",
        "num_inflight_verifies", "spec_forced",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        cache_salt: str | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r} has an empty prompt; at least one token is needed")
        self.request_id = request_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.cache_salt = cache_salt
        self.arrival_order = 0
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_pending_tokens = 0  # sampled by a step still in flight: computed next step, id not yet known
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.awaiting_grammar = False
        self.spec_token_ids: list[int] = []
        self.spec_confidences: list[float] = []
        self.num_draft_tokens = self.num_verified_tokens = self.num_accepted_tokens = 0
        self.next_drafts: list[int] = []  # what the next chunk verifies (the scheduler's working list)
        self.num_drafts_in_flight = 0  # drafts the last launched step makes for it (asynchronous scheduling)
        self.num_inflight_verifies = 0  # launched steps verifying its drafts, not yet applied
        self.spec_forced = False  # spec_token_ids are tokens its grammar forces, not the drafter's

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens: where `num_computed_tokens` is heading."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> TokenIds:
        """Prompt then output tokens, a view (slices are lists)."""
        return TokenIds(self.prompt_token_ids, self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        # `finish` sets both; this is read several times per request per step, and an enum's hash is Python code
        return self.finish_reason is not None

    @property
    def num_tokens_with_pending(self) -> int:
        """`num_tokens` plus the tokens an in-flight step is sampling (asynchronous scheduling)."""
        return self.num_tokens + self.num_pending_tokens

    def finish(self, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        self.status = RequestStatus.from_finish_reason(reason)
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
