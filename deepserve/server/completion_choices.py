"""The choices of one `/v1/completions` request: one engine request per prompt and per `n` (a batch of prompts
is submitted together), their outputs merged into one stream of `(choice index, output)` in arrival order, and
each choice's text, logprobs and finish as OpenAI's legacy completions spell them (`Choice`).

With `n` > 1 a prompt's first choice goes first and its siblings follow once it has produced its first token:
its prompt's full pages are in the prefix cache by then, so the siblings compute only the rest (vLLM's parent
request fans out the same way, as n engine requests). A seeded request's choice j samples with `seed + j`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from deepserve.core.async_engine import AsyncEngine
from deepserve.core.outputs import RequestOutput
from deepserve.core.sampling_params import SamplingParams
from deepserve.core.stop_checker import hold_back_length
from deepserve.server.admission import Ticket
from deepserve.server.legacy_logprobs import joined, output_logprobs, prompt_logprobs
from deepserve.server.metrics import RequestTimer
from deepserve.server.sampling_options import sibling_params
from deepserve.server.state import ModelInfo


@dataclass(slots=True)
class Choice:
    """One prompt's choice. `prefix` is the echoed prompt ("" without `echo`); `prompt_only`: `max_tokens: 0`
    with `echo`, whose one sampled token is not returned; `sibling`: which of the prompt's `n` choices it is."""

    index: int
    text: str | None
    ids: list[int]
    prefix: str
    prompt_only: bool
    timer: RequestTimer
    sibling: int = 0
    final: RequestOutput | None = None
    num_sent_chars: int = 0
    num_sent_tokens: int = 0
    num_seen_tokens: int = field(default=0)

    def seen(self, out: RequestOutput) -> None:
        """Record an output (cumulative) and time its new tokens."""
        self.final = out
        tokens = len(out.outputs[0].token_ids)
        self.timer.tokens(tokens - self.num_seen_tokens)
        self.num_seen_tokens = tokens

    def delta(self, out: RequestOutput, model: ModelInfo, params: SamplingParams) -> dict[str, Any]:
        """The streamed choice for what `out` adds (a tail that could still become a stop string held back)."""
        completion = out.outputs[0]
        generated = "" if self.prompt_only else completion.text
        end = len(generated)
        if not out.finished and params.stop and not params.include_stop_str_in_output:
            end -= hold_back_length(generated, params.stop)
        first = self.num_sent_tokens == 0 and self.num_sent_chars == 0
        choice = {"text": (self.prefix if first else "") + generated[self.num_sent_chars:end], "index": self.index,
                  "logprobs": self._logprobs(out, self.num_sent_tokens, first, model, params),
                  "finish_reason": finish_of(out) if out.finished else None}
        self.num_sent_chars, self.num_sent_tokens = max(self.num_sent_chars, end), len(completion.token_ids)
        return choice

    def whole(self, model: ModelInfo, params: SamplingParams) -> dict[str, Any]:
        out = self.final
        return {"text": self.prefix + ("" if self.prompt_only else out.outputs[0].text), "index": self.index,
                "finish_reason": finish_of(out), "logprobs": self._logprobs(out, 0, True, model, params)}

    @property
    def num_output_tokens(self) -> int:
        return 0 if self.prompt_only or self.final is None else len(self.final.outputs[0].token_ids)

    def _logprobs(self, out: RequestOutput, start: int, first: bool, model: ModelInfo,
                  params: SamplingParams) -> dict | None:
        """From output token `start` on; the prompt's before them in the `first` chunk of an echoed request
        (`params.prompt_logprobs` is set then); the prompt's alone for `max_tokens: 0`."""
        if params.logprobs is None:
            return None
        output = None if self.prompt_only else output_logprobs(out.outputs[0], start, model, params.logprobs)
        if params.prompt_logprobs is None or not first:
            return output
        return joined(prompt_logprobs(out, model, params.prompt_logprobs), output, len(self.prefix))


def finish_of(out: RequestOutput) -> str:
    return out.outputs[0].finish_reason or "abort"


_DONE = object()


async def merged(engine: AsyncEngine, choices: Sequence[Choice], params: SamplingParams, request_id: str,
                 ticket: Ticket, cache_salt: str | None,
                 share_prompt: bool = True, session_id: str | None = None,
                 stream_interval: int = 1) -> AsyncIterator[tuple[Choice, RequestOutput]]:
    """Every choice's outputs as they come. The first choice of each prompt is submitted in one pass of the
    event loop, its siblings (`n` > 1, when `share_prompt`) once it has its first output; leaving early (or an
    error) closes them all, which aborts what the engine has not finished. `session_id`: every choice continues
    that session's SWA host slot (one prompt's choices; the last to finish keeps the slot). `stream_interval`:
    `AsyncEngine.generate`'s."""
    def stream(choice: Choice, engine_id: str) -> AsyncIterator[RequestOutput]:
        ticket.start(engine_id)  # no await from here to the engine's add: see `Ticket.start`
        return engine.generate(choice.ids, sibling_params(params, choice.sibling), request_id=engine_id,
                               prompt=choice.text, cache_salt=cache_salt, views=True, session_id=session_id,
                               stream_interval=stream_interval)

    if len(choices) == 1:  # the common case: the engine's stream itself, without a task and a queue per output
        choice = choices[0]
        outs = stream(choice, request_id)
        async with contextlib.aclosing(outs):
            async for out in outs:
                yield choice, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    firsts = {c.index - c.sibling: asyncio.Event() for c in choices if c.sibling == 0}

    async def pump(choice: Choice) -> None:
        first = firsts.get(choice.index) if choice.sibling == 0 else None
        try:
            if choice.sibling and share_prompt:
                await firsts[choice.index - choice.sibling].wait()
            outs = stream(choice, f"{request_id}-{choice.index}")
            async with contextlib.aclosing(outs):
                async for out in outs:
                    if first is not None:
                        first.set()
                    queue.put_nowait((choice, out))
            queue.put_nowait(_DONE)
        except BaseException as exc:  # noqa: BLE001 - handed to the reader, which raises it
            queue.put_nowait(exc)
        finally:
            if first is not None:
                first.set()  # an error or an abort: the siblings go on (and meet the same fate) rather than hang

    tasks = [asyncio.create_task(pump(choice)) for choice in choices]
    try:
        for _ in range(len(tasks)):
            while (item := await queue.get()) is not _DONE:
                if isinstance(item, BaseException):
                    raise item
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
