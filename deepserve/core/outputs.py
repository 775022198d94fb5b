"""What `LLM.generate` returns: `RequestOutput` holding `CompletionOutput`s, with vLLM's field names.

User code written against vLLM's offline API (`out.outputs[0].text`, `.token_ids`, `.finish_reason`,
`.logprobs[i][token_id].logprob`, `out.prompt_logprobs`) runs unchanged. Plain Python: no torch here.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length", "abort"]
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")


@dataclass(slots=True)
class Logprob:
    """One token's log-probability; `rank` is 1 for the most likely token (1 + tokens strictly more likely)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None

    def __post_init__(self) -> None:
        if self.rank is not None and self.rank < 1:
            raise ValueError(f"rank must be >= 1 or None, got {self.rank}")


#: one position's logprobs: token id -> Logprob (the sampled or prompt token plus the top-k)
PositionLogprobs = dict[int, Logprob]


class Prefix(Sequence):
    """The first `n` items of a list that never changes below `n` afterwards (a request's output tokens and
    logprobs: the engine appends to them, and cuts only tokens no output has shown yet): a streaming snapshot
    made in O(1) where a copy is O(n). Read-only; indexing, `len`, iteration and comparison act on the n items,
    and a slice is a new list. For consumers that read each snapshot's new part (`AsyncEngine.generate(views=
    True)`, the server): copying every request's whole output into every step's snapshot made streaming 256
    requests 2,000 tokens in take ~3x the host time of final outputs (bench/engine_host.py)."""

    __slots__ = ("_items", "_n")

    def __init__(self, items: list, n: int) -> None:
        if not 0 <= n <= len(items):
            raise ValueError(f"a prefix of {n} items of a list of {len(items)}")
        self._items, self._n = items, n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            start, stop, step = index.indices(self._n)
            if step == 1:
                return self._items[start:stop]
            return [self._items[i] for i in range(start, stop, step)]  # (a negative stop of -1 means "none")
        i = index + self._n if index < 0 else index
        if not 0 <= i < self._n:
            raise IndexError(f"index {index} out of range for {self._n} items")
        return self._items[i]

    def __iter__(self) -> Iterator:
        return itertools.islice(self._items, self._n)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, (Prefix, list, tuple)):
            return NotImplemented
        return len(other) == self._n and all(a == b for a, b in zip(self, other))

    __hash__ = None  # like the list it stands for

    def __repr__(self) -> str:
        return repr(list(self))


def make_logprob_dict(
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    ranks: Sequence[int],
    decode: Callable[[int], str | None] | None = None,
) -> PositionLogprobs:
    """Build one position's dict from parallel lists (the chosen token first, then the top-k best first).

    A token listed twice (the chosen token is also among the top-k) keeps its first entry.
    """
    if not len(token_ids) == len(logprobs) == len(ranks):
        lengths = (len(token_ids), len(logprobs), len(ranks))
        raise ValueError(f"token_ids, logprobs and ranks must have equal lengths, got {lengths}")
    out: PositionLogprobs = {}
    for token_id, logprob, rank in zip(token_ids, logprobs, ranks):
        if token_id not in out:
            out[token_id] = Logprob(float(logprob), int(rank), decode(token_id) if decode else None)
    return out


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence. `stop_reason` is the stop string or stop token id that ended it (None for EOS or
    length); `logprobs` has one dict per generated token when the request asked for logprobs."""

    index: int
    text: str
    token_ids: list[int] | Prefix  # a Prefix while a stream that asked for views runs; lists once finished
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | Prefix | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None

    def __post_init__(self) -> None:
        if self.index < 0:
            raise ValueError(f"index must be >= 0, got {self.index}")
        if self.finish_reason is not None and self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason must be one of {list(FINISH_REASONS)} or None, got {self.finish_reason!r}")

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock timestamps (`time.time()` seconds) of one request's life; None until the event happens."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    """The state of one request as returned to the user (final, or a streaming snapshot when not `finished`).

    `prompt_logprobs` has one entry per prompt token and the first is None (nothing predicts the first token),
    as in vLLM. `num_cached_tokens` counts prompt tokens served from the prefix cache. With speculative decoding,
    `num_draft_tokens`, `num_verified_tokens` and `num_accepted_tokens` count the request's drafts made, checked
    by the target model, and kept (0 without speculation). A request's snapshots share one `prompt_token_ids`
    list (copying a long prompt into every step's snapshot was most of the engine's host time per step).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = field(default=None, repr=False)
    num_draft_tokens: int = 0
    num_verified_tokens: int = 0
    num_accepted_tokens: int = 0

    def __post_init__(self) -> None:
        if self.num_cached_tokens < 0:
            raise ValueError(f"num_cached_tokens must be >= 0, got {self.num_cached_tokens}")
        if self.prompt_logprobs and self.prompt_logprobs[0] is not None:
            raise ValueError("prompt_logprobs[0] must be None: the first prompt token has no logprob")
