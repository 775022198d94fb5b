"""When does a request stop, and what text does it return? Plain Python, called once per generated token.

Two kinds of stop, as in vLLM:

* token stops (`check_stop`): EOS (unless `ignore_eos`), a `stop_token_ids` hit, `max_tokens` reached, or the
  context window full. EOS and stop ids are ignored until `min_tokens` tokens exist; the caller also masks
  them out of the logits meanwhile (`min_tokens_blocked_ids`), so they are not even sampled.
* stop strings (`find_stop_string`, `StopStringTracker`): searched in the detokenized text, where one may span
  the deltas of several steps. The match that wins is the one *completed first* as if the text had arrived one
  character at a time (earliest end; on a tie, the longest), so the result does not depend on how the text was
  split into deltas. Streams hold back a tail that could still become a stop string (`hold_back_length`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from deepserve.core.outputs import FinishReason
from deepserve.core.sampling_params import SamplingParams


def min_tokens_blocked_ids(params: SamplingParams, eos_token_ids: Collection[int], num_output_tokens: int) -> list[int]:
    """Token ids to mask (-inf logit) before sampling output token number `num_output_tokens` (0-based):
    EOS and the stop token ids while fewer than `min_tokens` tokens have been generated, else none."""
    if num_output_tokens >= params.min_tokens:
        return []
    blocked = [] if params.ignore_eos else list(eos_token_ids)
    return sorted(set(blocked).union(params.stop_token_ids or ()))


def check_stop(
    token_id: int,
    num_output_tokens: int,
    num_tokens: int,
    params: SamplingParams,
    eos_token_ids: Collection[int],
    max_model_len: int,
) -> tuple[FinishReason | None, int | None]:
    """Decide after appending `token_id`, the request's `num_output_tokens`-th output token, which brings the
    sequence (prompt + output) to `num_tokens`. Returns `(finish_reason, stop_reason)`, `(None, None)` to go on.

    EOS gives `("stop", None)`, a stop token id `("stop", token_id)`, and `max_tokens` or a full context
    `("length", None)`. A token stop that coincides with the length limit reports "stop": the model did end.
    """
    if num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and token_id in eos_token_ids:
            return "stop", None
        if params.stop_token_ids and token_id in params.stop_token_ids:
            return "stop", token_id
    if params.max_tokens is not None and num_output_tokens >= params.max_tokens:
        return "length", None
    if num_tokens >= max_model_len:
        return "length", None
    return None, None


@dataclass(frozen=True, slots=True)
class StopStringMatch:
    """A stop string was found: `text` is the whole output text cut at it (kept only when included)."""

    stop: str
    text: str


def find_stop_string(
    text: str, num_new_chars: int, stop: Sequence[str], include_stop_str_in_output: bool = False
) -> StopStringMatch | None:
    """Search the whole output `text`, whose last `num_new_chars` characters arrived this step (the text before
    them was searched already), for the stop string completed first. None when there is none."""
    old_len = len(text) - num_new_chars
    best: tuple[int, int, str] | None = None  # (end, start, stop string)
    for s in stop:
        start = text.find(s, max(0, old_len - len(s) + 1))
        if start < 0:
            continue
        candidate = (start + len(s), start, s)
        if best is None or candidate[:2] < best[:2]:
            best = candidate
    if best is None:
        return None
    end, start, s = best
    return StopStringMatch(stop=s, text=text[:end] if include_stop_str_in_output else text[:start])


def hold_back_length(text: str, stop: Sequence[str]) -> int:
    """How many trailing characters of `text` a stream must not emit yet: the longest suffix that is a proper
    prefix of some stop string (it may still grow into one, and then it must be cut from the output)."""
    longest = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:k]):
                longest = k
                break
    return longest


class StopStringTracker:
    """The output text of one request with its stop strings: append each step's delta, read what may be streamed.

    `append` returns the match when a stop string completes (the tracker's text is then cut accordingly);
    `stream_delta` returns the text that became safe to show since its last call: everything but a tail that
    might turn into a stop string, or everything once `final=True` (the request finished).
    When `include_stop_str_in_output` is set nothing needs holding back: a stop string is shown anyway.
    """

    __slots__ = ("stop", "include_stop_str_in_output", "text", "num_streamed_chars", "match")

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        self.stop: tuple[str, ...] = tuple(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.text = ""
        self.num_streamed_chars = 0
        self.match: StopStringMatch | None = None

    def append(self, delta: str, check: bool = True) -> StopStringMatch | None:
        """Add this step's text. `check=False` appends without searching (vLLM skips stop strings while the
        output is shorter than `min_tokens`); text added unchecked is not searched again later."""
        if self.match is not None:
            raise RuntimeError(f"stop string {self.match.stop!r} already ended this output; nothing can follow")
        self.text += delta
        if not (check and self.stop and delta):
            return None
        self.match = find_stop_string(self.text, len(delta), self.stop, self.include_stop_str_in_output)
        if self.match is not None:
            self.text = self.match.text
        return self.match

    def stream_delta(self, final: bool = False) -> str:
        end = len(self.text)
        if not (final or self.match is not None or self.include_stop_str_in_output):
            end -= hold_back_length(self.text, self.stop)
        if end <= self.num_streamed_chars:
            return ""
        delta, self.num_streamed_chars = self.text[self.num_streamed_chars : end], end
        return delta
