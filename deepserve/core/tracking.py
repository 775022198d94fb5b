"""What the engine keeps per request besides the scheduler's `Request`: text, stop strings, logprobs, outputs."""

from __future__ import annotations

from deepserve.core.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from deepserve.core.request import Request
from deepserve.core.stop_checker import StopStringMatch, StopStringTracker


class RequestTracker:
    """Turns the tokens the scheduler appends into text and logprobs, and finds stop strings in that text."""

    __slots__ = ("request", "prompt", "seed", "detok", "stops", "num_seen", "logprobs", "cumulative_logprob",
                 "prompt_logprobs", "stop_match", "flushed")

    def __init__(self, request: Request, prompt: str | None, seed: int, detok, stops: StopStringTracker) -> None:
        self.request, self.prompt, self.seed, self.detok, self.stops = request, prompt, seed, detok, stops
        self.num_seen = 0
        params = request.sampling_params
        self.logprobs: list[PositionLogprobs] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.prompt_logprobs: dict[int, PositionLogprobs] = {}
        self.stop_match: StopStringMatch | None = None
        self.flushed = False

    def absorb(self, logprobs: PositionLogprobs | None, sampled_logprob: float | None) -> bool:
        """Take the token the scheduler just appended (if it did). True when there was one."""
        request = self.request
        if len(request.output_token_ids) == self.num_seen:
            return False
        token = request.output_token_ids[self.num_seen]
        self.num_seen += 1
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.append(logprobs)
            self.cumulative_logprob += sampled_logprob or 0.0
        params = request.sampling_params
        last = self.num_seen == len(request.output_token_ids) and request.is_finished
        token_stop = last and request.finish_reason == "stop" and not params.include_stop_str_in_output
        if self.detok is not None and not token_stop and self.stop_match is None:  # EOS / stop ids add no text
            match = self.stops.append(self.detok.add(token), check=self.num_seen > params.min_tokens)
            if match is not None:
                self.stop_match = match
        return True

    def add_prompt_logprobs(self, start: int, entries: list[PositionLogprobs]) -> None:
        """Entry j is the logprob of prompt token `start + 1 + j` (a recomputation after preemption overwrites
        it with the same value: the model is batch-invariant)."""
        for j, entry in enumerate(entries):
            self.prompt_logprobs[start + 1 + j] = entry

    def output(self) -> RequestOutput:
        request = self.request
        if request.is_finished and not self.flushed:
            self.flushed = True
            if self.detok is not None and self.stop_match is None and request.finish_reason != "stop":
                self.stops.append(self.detok.flush(), check=False)
        prompt_logprobs = None
        if request.sampling_params.prompt_logprobs is not None:
            prompt_logprobs = [None] + [self.prompt_logprobs.get(p) for p in range(1, request.num_prompt_tokens)]
        completion = CompletionOutput(
            index=0, text=self.stops.text, token_ids=list(request.output_token_ids[: self.num_seen]),
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            finish_reason=request.finish_reason, stop_reason=request.stop_reason,
        )
        return RequestOutput(request_id=request.request_id, prompt=self.prompt,
                             prompt_token_ids=list(request.prompt_token_ids), prompt_logprobs=prompt_logprobs,
                             outputs=[completion], finished=request.is_finished,
                             num_cached_tokens=request.num_cached_tokens)
