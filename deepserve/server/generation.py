"""One recipe-protocol request through the engine: outputs -> deepseek-recipe's stream processor -> the client,
as server-sent events (`stream: true`) or as one accumulated JSON response.

A constrained request's grammar is compiled before the engine sees it (an invalid one is a 400). The SSE
response starts with the first output, so anything the engine refuses before that is still a plain JSON error;
a grammar that fails while generating is a 422, or the protocol's error event once streaming; so is a request
the shutdown aborts (503, `deepserve.server.admission.shutdown_error`). Leaving early (a stop sequence ended
the text, the client disconnected, the handler was cancelled) closes the engine stream, which aborts the
request and frees its pages within one step.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Sequence

import deepseek_recipe as dr
from aiohttp import web

from deepserve.core.outputs import PositionLogprobs, RequestOutput
from deepserve.server.admission import Ticket, shutdown_error
from deepserve.server.engine_errors import engine_errors, failure_reason
from deepserve.server.errors import ERROR_TYPES, ApiError, error_body
from deepserve.server.http import open_sse, sse_message
from deepserve.server.metrics import RequestTimer
from deepserve.server.recipe import RESPONSES, Prepared
from deepserve.server.state import CONFIG, ENGINE, METRICS, MODEL
from deepserve.server.structured import client_of, compile_grammar, grammar_failure

_FINISH = {"stop": dr.InferenceFinishReason.Stop, "length": dr.InferenceFinishReason.Length}


async def serve_prepared(request: web.Request, prepared: Prepared, ticket: Ticket) -> web.StreamResponse:
    spec = prepared.params.structured_outputs
    try:
        if spec is not None:
            await compile_grammar(request.app[ENGINE].engine, spec, prepared.constraint_field, client_of(request))
        ticket.start(prepared.request_id)  # no await from here to the engine's add: see `Ticket.start`
    except BaseException:
        prepared.processor.close()
        raise
    timer = request.app[METRICS].timer()
    reason = "abort"  # unless the request ends normally: the client left or the handler was cancelled
    try:
        response, reason = await _run(request, prepared, Translator(prepared, request.app[MODEL].eos_token_ids, timer))
        return response
    except ApiError as error:
        reason = failure_reason(error)
        raise
    finally:
        timer.finish(reason)


class Translator:
    """Engine outputs (cumulative snapshots) -> the new tokens -> the processor's protocol events (one choice's:
    `deepserve.server.fanout` keeps one per choice of an `n` > 1 request)."""

    def __init__(self, prepared: Prepared, eos_token_ids: Sequence[int], timer: RequestTimer) -> None:
        self.processor, self.params = prepared.processor, prepared.params
        self.constraint_field = prepared.constraint_field
        self.eos_token_ids, self.timer = eos_token_ids, timer
        self.num_prompt_tokens = len(prepared.prompt_token_ids)
        self.num_sent = 0
        self.usage = prepared.usage
        self.reason = "stop"
        self.failed = False  # the response ended with the protocol's error event
        # the processor's `finished`, read once after each push: the native call releases the GIL, and getting it
        # back from the engine thread cost the event loop more than the call (twice per output at 256 streams)
        self.ended = False

    def first(self, out: RequestOutput) -> list:
        usage = dr.PromptUsage(prompt_tokens=self.num_prompt_tokens, prompt_cache_hit_tokens=out.num_cached_tokens)
        return self.processor.push(dr.InferenceChunk.ready(prompt_usage=usage))

    def events(self, out: RequestOutput) -> list:
        completion, events = out.outputs[0], []
        end = _num_text_tokens(out, self.eos_token_ids)
        if end > self.num_sent and not self.ended:
            logprobs = _logprobs(completion.token_ids, completion.logprobs, self.num_sent, end, self.params.logprobs)
            events += self.processor.push(dr.InferenceChunk.tokens(completion.token_ids[self.num_sent:end], logprobs))
            self.usage.add(completion.token_ids[self.num_sent:end])
            self.timer.tokens(end - self.num_sent)
            self.num_sent = end
            self.ended = self.processor.finished
        if out.finished and not self.ended:
            if completion.finish_reason not in _FINISH:
                failure = grammar_failure(completion, self.constraint_field)
                if failure is not None:
                    raise failure
                raise shutdown_error()  # only the server aborts a request whose handler still reads it
            self.reason = completion.finish_reason
            self.usage.add(completion.token_ids[end:], text=False)  # the final EOS
            events += self.processor.push(dr.InferenceChunk.finish(_FINISH[self.reason]))
            events += self.processor.finish()
            self.ended = self.processor.finished
        return events

    @property
    def done(self) -> bool:
        """The processor has ended the response (maybe at a stop sequence, before the engine finished)."""
        return self.ended


async def _run(request: web.Request, prepared: Prepared,
               translator: Translator) -> tuple[web.StreamResponse, str]:
    engine, model = request.app[ENGINE], request.app[MODEL]
    response_type = prepared.protocol.response_type
    sse: web.StreamResponse | None = None
    accumulated = None
    stream = engine.generate(prepared.prompt_token_ids, prepared.params, request_id=prepared.request_id, views=True,
                             session_id=prepared.session_id, stream_interval=request.app[CONFIG].stream_interval)
    async with contextlib.aclosing(stream):
        try:
            with engine_errors():
                async for out in stream:
                    first = sse is None and accumulated is None
                    events = translator.first(out) if first else []
                    events += translator.events(out)  # an error here, before the response starts, is plain JSON
                    if first and prepared.stream:
                        sse = await open_sse(request)
                    elif first:
                        accumulated = response_type(prepared.request_id, model.name, int(time.time()),
                                                    translator.num_prompt_tokens, out.num_cached_tokens)
                    if sse is not None:  # the usage is in the events that end the response
                        patch = translator.usage.patch if translator.done else _same
                        await sse.write(b"".join(sse_message(patch(e.to_json()), response_type.sse_event_name(e))
                                                 for e in events))
                    else:
                        for event in events:
                            accumulated.accumulate(event)
                    if translator.done:
                        break  # closing the engine stream aborts the request if the engine has not finished it
        except ApiError as error:
            if sse is None:
                raise
            await fail_stream(sse, prepared, error, [translator])
        finally:
            if not translator.done:
                prepared.processor.close()
    if sse is None:
        return web.Response(text=translator.usage.patch(accumulated.to_json()), content_type="application/json"), \
            translator.reason
    done = response_type.sse_done_data()
    if done is not None and not translator.failed:
        await sse.write(sse_message(done))
    await sse.write_eof()
    return sse, translator.reason


def _same(data: str) -> str:
    return data


def _num_text_tokens(out: RequestOutput, eos_token_ids: Sequence[int]) -> int:
    """Output tokens the processor should see: all but a final EOS (it ends the text, it is not part of it)."""
    completion = out.outputs[0]
    ids = completion.token_ids
    if out.finished and completion.finish_reason == "stop" and ids and ids[-1] in eos_token_ids:
        return len(ids) - 1
    return len(ids)


def _logprobs(token_ids: Sequence[int], entries: list[PositionLogprobs] | None, start: int, end: int,
              top_n: int | None) -> list[tuple[float, list[tuple[int, float]]]] | None:
    """The recipe's `(logprob, [(token id, logprob) of the top_n most likely])` per token in [start, end)."""
    if top_n is None or entries is None or len(entries) < end:
        return None
    result = []
    for position in range(start, end):
        entry = entries[position]
        ranked = sorted(entry.items(), key=lambda item: (item[1].rank is None, item[1].rank or 0))[:top_n]
        result.append((entry[token_ids[position]].logprob, [(tid, lp.logprob) for tid, lp in ranked]))
    return result


async def fail_stream(sse: web.StreamResponse, prepared: Prepared, error: ApiError,
                      translators: Sequence[Translator]) -> None:
    """End a started stream with `error` (the protocol's error event); its choices count as failed."""
    await sse.write(stream_error(prepared, error))
    for translator in translators:
        translator.failed, translator.reason = True, failure_reason(error)


def stream_error(prepared: Prepared, error: ApiError) -> bytes:
    """An error inside an already started stream, as the protocol spells one."""
    if prepared.protocol is RESPONSES:
        data = {"type": "error", "code": ERROR_TYPES.get(error.status, "server_error"), "message": error.message,
                "param": error.param}
        return sse_message(json.dumps(data), "error")
    path = "/v1/messages" if prepared.protocol.name == "messages" else "/v1/chat/completions"
    body = error_body(path, error.status, error.message, error.param, error.code)
    return sse_message(json.dumps(body), "error" if prepared.protocol.name == "messages" else None)
