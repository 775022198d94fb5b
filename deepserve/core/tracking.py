"""What the engine keeps per request besides the scheduler's `Request`: text, stop strings, logprobs, outputs,
and the grammar of a structured-output request."""

from __future__ import annotations

import itertools
from concurrent.futures import Future

from deepserve.core.outputs import CompletionOutput, PositionLogprobs, Prefix, RequestOutput
from deepserve.core.request import Request
from deepserve.core.stop_checker import StopStringMatch, StopStringTracker
from deepserve.core.structured import GrammarBackend, GrammarMatcher, GrammarSpec

#: `stop_reason` prefix of a request finished because of its structured-output constraint (finish_reason "abort")
GRAMMAR_ERROR_PREFIX = "structured output: "


class GrammarState:
    """A constrained request's grammar: first the compile in progress (`future`, `deadline` on the engine's
    monotonic clock), then its `matcher` (made by `backend`), which has consumed the first `num_consumed` output
    tokens."""

    __slots__ = ("spec", "future", "deadline", "backend", "matcher", "num_consumed")

    def __init__(self, spec: GrammarSpec, future: Future, deadline: float) -> None:
        self.spec, self.future, self.deadline = spec, future, deadline
        self.backend: GrammarBackend | None = None
        self.matcher: GrammarMatcher | None = None
        self.num_consumed = 0

    def advance(self, output_token_ids: list[int], end: int | None = None) -> tuple[str, str | None] | None:
        """Consume the tokens sampled since the last call (those before `end`, default all). Returns
        (finish_reason, stop_reason) when the request must finish: ("stop", None) when the grammar is complete,
        ("abort", why) when it rejected a token."""
        matcher = self.matcher
        for token in itertools.islice(output_token_ids, self.num_consumed, end):
            self.num_consumed += 1
            if not matcher.consume(token):
                return "abort", f"{GRAMMAR_ERROR_PREFIX}token {token} rejected: {matcher.error_message()}"
        return ("stop", None) if matcher.is_terminated() else None


class RequestTracker:
    """Turns the tokens the scheduler appends into text and logprobs, and finds stop strings in that text."""

    __slots__ = ("request", "prompt", "prompt_ids", "seed", "detok", "stops", "num_seen", "logprobs",
                 "cumulative_logprob", "prompt_logprobs", "stop_match", "flushed", "grammar", "final_only", "views",
                 "reads_output_history", "deferred", "num_text_tokens")

    def __init__(self, request: Request, prompt: str | None, seed: int, detok, stops: StopStringTracker,
                 final_only: bool = False, views: bool = False) -> None:
        """`final_only`: the engine reports this request only when it finishes; `views`: its outputs hold
        `Prefix` views of the tokens and logprobs instead of copies (`EngineCore.add_request`)."""
        params = request.sampling_params
        if not params.detokenize:  # the caller decodes the ids itself: no text, no per-token decode
            detok = None
        self.request, self.prompt, self.seed, self.detok, self.stops = request, prompt, seed, detok, stops
        self.final_only, self.views = final_only, views
        self.prompt_ids = list(request.prompt_token_ids)  # every snapshot's prompt_token_ids: copied once
        self.num_seen = 0
        self.logprobs: list[PositionLogprobs] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.prompt_logprobs: dict[int, PositionLogprobs] = {}
        self.stop_match: StopStringMatch | None = None
        self.flushed = False
        self.grammar: GrammarState | None = None
        self.reads_output_history = params.reads_output_history  # asked every step: a property over lists
        # reported once, when it finishes, and no stop string to look for: the text is decoded then, in one call,
        # instead of two decodes a token every step (`num_text_tokens`: the output tokens that make text)
        self.deferred = final_only and detok is not None and not stops.stop
        self.num_text_tokens = 0

    def absorb(self, logprobs: PositionLogprobs | None, sampled_logprob: float | None) -> bool:
        """Take the token the scheduler just appended (if it did). True when there was one."""
        request = self.request
        output = request.output_token_ids
        seen = self.num_seen
        if len(output) == seen:
            return False
        token = output[seen]
        self.num_seen = seen = seen + 1
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.append(logprobs)
            self.cumulative_logprob += sampled_logprob or 0.0
        if self.detok is None or self.stop_match is not None:
            return True
        params = request.sampling_params
        # the last token of a request finished by it (EOS, a stop id) adds no text
        if seen == len(output) and request.finish_reason == "stop" and not params.include_stop_str_in_output:
            return True
        if self.deferred:
            self.num_text_tokens = seen
            return True
        match = self.stops.append(self.detok.add(token), check=seen > params.min_tokens)
        if match is not None:
            self.stop_match = match
        return True

    def _deferred_text(self, token_ids: list[int]) -> str:
        """What the per-token deltas of `token_ids` would have joined to: one decode, unless the text ends in an
        unfinished UTF-8 character (U+FFFD), which the detokenizer then holds back whole; then token by token, so
        that exactly the same tail is held back (a request finished by EOS does not flush it)."""
        detok = self.detok
        text = detok.add(token_ids)
        if text or not detok.tokenizer.decode(detok.token_ids[detok.prefix_offset :],
                                              detok.skip_special_tokens).endswith("\ufffd"):
            return text
        del detok.token_ids[len(detok.token_ids) - len(token_ids) :]
        return "".join(detok.add(t) for t in token_ids)

    def add_prompt_logprobs(self, start: int, entries: list[PositionLogprobs]) -> None:
        """Entry j is the logprob of prompt token `start + 1 + j` (a recomputation after preemption overwrites
        it with the same value: the model is batch-invariant)."""
        for j, entry in enumerate(entries):
            self.prompt_logprobs[start + 1 + j] = entry

    def output(self) -> RequestOutput:
        request = self.request
        finished = request.finish_reason is not None
        if finished and not self.flushed:
            self.flushed = True
            if self.deferred and self.num_text_tokens:
                self.stops.append(self._deferred_text(request.output_token_ids[: self.num_text_tokens]), check=False)
            # a grammar's end is text the user wants whole, held-back bytes included
            grammar_end = self.grammar is not None and request.stop_reason is None
            if self.detok is not None and self.stop_match is None and (request.finish_reason != "stop" or grammar_end):
                self.stops.append(self.detok.flush(), check=False)
        prompt_logprobs = None
        if request.sampling_params.prompt_logprobs is not None:
            prompt_logprobs = [None] + [self.prompt_logprobs.get(p) for p in range(1, request.num_prompt_tokens)]
        tokens, logprobs = request.output_token_ids, self.logprobs
        if self.views and not finished:  # the engine only appends to both, cuts only past num_seen;
            # the final output is copied (once), so what outlives the stream (hooks, stored results) holds lists
            tokens = Prefix(tokens, self.num_seen)
            logprobs = Prefix(logprobs, len(logprobs)) if logprobs is not None else None
        else:
            tokens = tokens[: self.num_seen]
            logprobs = list(logprobs) if logprobs is not None else None
        completion = CompletionOutput(0, self.stops.text, tokens,
                                      self.cumulative_logprob if logprobs is not None else None, logprobs,
                                      request.finish_reason, request.stop_reason)
        return RequestOutput(request.request_id, self.prompt, self.prompt_ids, prompt_logprobs, [completion], finished,
                             request.num_cached_tokens, None, request.num_draft_tokens, request.num_verified_tokens,
                             request.num_accepted_tokens)
