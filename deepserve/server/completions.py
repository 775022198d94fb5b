"""`POST /v1/completions`: OpenAI's legacy text completions, with plain tokenization (no chat template).

deepseek-recipe has no legacy-completions protocol, so this module parses the body itself; the engine applies
stop strings and detokenizes, and streams hold back a tail that could still become a stop string. Field names
beyond OpenAI's (`top_k`, `min_p`, `min_tokens`, `ignore_eos`, `stop_token_ids`, `skip_special_tokens`,
`include_stop_str_in_output`, and structured output: `response_format` as in chat, `structured_outputs`,
`guided_*`) are vLLM's. An unknown field is a 400 that names it.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

from aiohttp import web

from deepserve.core.sampling_params import SamplingParams
from deepserve.server.admission import Ticket, shutdown_error
from deepserve.server.completion_choices import Choice, finish_of, merged
from deepserve.server.engine_errors import engine_errors, failure_reason
from deepserve.server.errors import ApiError, error_body, sampling_error
from deepserve.server.http import check_text, json_type, open_sse, sse_message
from deepserve.server.pool import run_in_pool
from deepserve.server.sampling_options import CACHE_FIELDS, PENALTY_FIELDS, cache_fields, penalty_fields
from deepserve.server.session import session_of
from deepserve.server.state import CONFIG, ENGINE, METRICS, MODEL, ModelInfo
from deepserve.server.structured import EXTENSION_FIELDS, body_constraints, client_of, compile_grammar, \
    grammar_failure, response_format_constraint, single, to_spec

_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "min_tokens",
                    "ignore_eos", "skip_special_tokens", "include_stop_str_in_output")
def _is_not(value: int) -> Callable[[Any], bool]:
    """True unless the field is absent or the number `value` (a JSON boolean is not a number)."""
    return lambda v: v is not None and not (type(v) in (int, float) and v == value)


_UNSUPPORTED = {"suffix": lambda v: v is not None, "best_of": _is_not(1)}
KNOWN_FIELDS = frozenset({"model", "prompt", "max_tokens", "n", "stream", "stream_options", "logprobs", "echo",
                          "user", "response_format", "session_id", *EXTENSION_FIELDS, *_SAMPLING_FIELDS, *_UNSUPPORTED,
                          *PENALTY_FIELDS, *CACHE_FIELDS, "extra_body"})
MAX_LOGPROBS = 20
#: prompts one request may batch (each is its own choice and its own engine request)
MAX_PROMPTS = 64


def parse_completion(body: dict[str, Any], model: ModelInfo) \
        -> tuple[list[tuple[str | None, list[int]]], SamplingParams, str | None]:
    """Validate a completions body: ((text, ids) of each prompt, sampling parameters, the field that asked for
    structured output or None). Raises 400 `ApiError`s. Tokenizes the prompts: the server calls it on its pool."""
    for name in body:
        if name not in KNOWN_FIELDS:
            raise ApiError(400, f"unrecognized field '{name}'", param=name, code="unknown_field")
    for name, is_set in _UNSUPPORTED.items():
        if is_set(body.get(name)):
            raise ApiError(400, f"'{name}' is not supported by this server", param=name, code="unsupported")
    _check_type(body, "echo", bool)
    _check_type(body, "stream_options", dict)
    _check_type(body, "stop_token_ids", list)
    _check_type(body, "user", str)
    if body.get("stream_options") is not None:
        if not body.get("stream"):
            raise ApiError(400, "'stream_options' is only allowed with stream: true", param="stream_options")
        _check_type(body["stream_options"], "include_usage", bool, "stream_options.include_usage")
    logprobs = body.get("logprobs")
    if logprobs is not None and (type(logprobs) is not int or not 0 <= logprobs <= MAX_LOGPROBS):
        raise ApiError(400, f"'logprobs' must be an integer from 0 to {MAX_LOGPROBS}, got {logprobs!r}",
                       param="logprobs")
    echo = bool(body.get("echo"))
    prompts = _prompts(body.get("prompt"), model)
    # 0 only with echo (validation.py): the prompt alone, nothing sampled; unset: the model's default, else OpenAI's
    max_tokens = body.get("max_tokens", 16 if model.default_max_tokens is None else model.default_max_tokens)
    longest = max(len(ids) for _, ids in prompts)
    if type(max_tokens) is int and longest + max_tokens > model.max_model_len:
        raise ApiError(400, f"This model's maximum context length is {model.max_model_len} tokens. However, you "
                       f"requested {longest + max_tokens} tokens ({longest} in the prompt, {max_tokens} in the "
                       "completion).", param="max_tokens", code="context_length_exceeded")
    fields = model.default_fields | {name: body[name] for name in _SAMPLING_FIELDS if body.get(name) is not None} \
        | penalty_fields(body) | cache_fields(body)
    constraint = single([response_format_constraint(body.get("response_format")), *body_constraints(body)])
    spec = to_spec(constraint) if constraint is not None else None
    try:
        params = SamplingParams(max_tokens=max_tokens, logprobs=logprobs,
                                prompt_logprobs=logprobs if echo else None, structured_outputs=spec, **fields)
    except (ValueError, TypeError) as exc:
        raise sampling_error(exc) from None
    if params.stop and model.tokenizer is None:
        raise ApiError(400, "'stop' needs a tokenizer and this model has none", param="stop")
    return prompts, model.fit_params(params), constraint.field if constraint is not None else None


def _check_type(body: dict[str, Any], name: str, kind: type, label: str | None = None) -> None:
    value = body.get(name)
    if value is not None and not isinstance(value, kind):
        expected = {bool: "a boolean", dict: "an object", list: "an array", str: "a string"}[kind]
        raise ApiError(400, f"'{label or name}' must be {expected}, got {json_type(value)}", param=label or name)


def _prompts(prompt: Any, model: ModelInfo) -> list[tuple[str | None, list[int]]]:
    """One prompt (a string or token ids) or several (an array of them, at most `MAX_PROMPTS`)."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise ApiError(400, f"'prompt' holds {len(prompt)} prompts; at most {MAX_PROMPTS} are allowed",
                           param="prompt")
        return [_prompt(p, model, f"prompt[{i}]") for i, p in enumerate(prompt)]
    return [_prompt(prompt, model, "prompt")]


def _prompt(prompt: Any, model: ModelInfo, param: str) -> tuple[str | None, list[int]]:
    if isinstance(prompt, str):
        if model.encoder is None:
            raise ApiError(400, "this model has no tokenizer: send 'prompt' as token ids", param=param)
        model.check_prompt_text(check_text(prompt, param), param=param)
        text, ids = prompt, model.encoder.encode(prompt)
    elif isinstance(prompt, list) and all(type(t) is int for t in prompt):
        text, ids = None, list(prompt)
    else:
        raise ApiError(400, f"'{param}' must be a string or an array of token ids, got {json_type(prompt)}",
                       param=param)
    model.check_prompt(ids, param=param)
    return text, ids


async def handle_completions(request: web.Request, body: dict[str, Any], ticket: Ticket) -> web.StreamResponse:
    model, engine, metrics = request.app[MODEL], request.app[ENGINE], request.app[METRICS]
    prompts, params, constraint_field = await run_in_pool(request.app, parse_completion, body, model)
    session_id = session_of("completions", body)
    if session_id is not None and len(prompts) > 1:
        raise ApiError(400, "'session_id' names one conversation: send one prompt with it, not a batch",
                       param="session_id")
    if params.structured_outputs is not None:
        await compile_grammar(engine.engine, params.structured_outputs, constraint_field, client_of(request))
    stream, echo = bool(body.get("stream")), bool(body.get("echo"))
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": model.name}
    n = body.get("n") or 1  # validated: 1 to MAX_N
    ticket.claim(len(prompts) * n, "choices (prompts times n)", param="n" if n > 1 else "prompt")
    choices = [Choice(i * n + j, text, ids, _echoed(text, ids, model) if echo else "", body.get("max_tokens") == 0,
                      metrics.timer(), sibling=j) for i, (text, ids) in enumerate(prompts) for j in range(n)]
    salt = None  # the engine computes every prompt token of a request that wants their logprobs (no holes)
    # siblings wait for their prompt's pages only where there are full pages to share
    share = n > 1 and params.prompt_logprobs is None and engine.engine.enable_prefix_caching \
        and max(len(ids) for _, ids in prompts) > engine.engine.page_size
    # every chunk is `{**head, "choices": [delta], "usage": null?}`: the parts around the delta encoded once
    before = json.dumps(head, ensure_ascii=False)[:-1] + ', "choices": ['
    after = "]" + (', "usage": null' if include_usage else "") + "}"
    sse, failed = None, None
    try:
        with engine_errors():
            outs = merged(engine, choices, params, head["id"], ticket, salt, share_prompt=share, session_id=session_id,
                          stream_interval=request.app[CONFIG].stream_interval)
            async with contextlib.aclosing(outs):
                async for choice, out in outs:
                    choice.seen(out)
                    if out.finished and out.outputs[0].finish_reason == "abort":
                        failed = choice  # a failed grammar or the shutdown: a 4xx/503, or the error event below
                        break
                    if not stream:
                        continue
                    if sse is None:
                        sse = await open_sse(request)
                    delta = json.dumps(choice.delta(out, model, params), ensure_ascii=False)
                    await sse.write(sse_message(before + delta + after))
    except ApiError as error:
        _finish_timers(choices, failure_reason(error))
        if sse is None:
            raise
        # the engine died mid-stream (a 503): the stream ends with the error event, as the chat routes' do
        await sse.write(sse_message(json.dumps(error_body(request.path, error.status, error.message, error.param,
                                                          error.code))))
        return sse
    finally:
        for choice in choices:  # unless it ended normally, the client left ("abort")
            final = choice.final
            ended = final is not None and final.finished
            choice.timer.finish(("error" if grammar_failure(final.outputs[0]) is not None else finish_of(final))
                                if ended else "abort")
    if failed is not None:
        error = grammar_failure(failed.final.outputs[0], constraint_field) or shutdown_error()  # only the server
        if sse is None:
            raise error
        await sse.write(sse_message(json.dumps(error_body(request.path, error.status, error.message, error.param,
                                                          error.code))))
        return sse
    usage = _usage(choices)
    if sse is None:
        return web.json_response({**head, "choices": [c.whole(model, params) for c in choices], "usage": usage})
    if include_usage:
        await sse.write(sse_message(json.dumps({**head, "choices": [], "usage": usage})))
    await sse.write(sse_message("[DONE]"))
    await sse.write_eof()
    return sse


def _echoed(text: str | None, ids: list[int], model: ModelInfo) -> str:
    return text if text is not None else model.tokenizer.decode(ids) if model.tokenizer else ""


def _finish_timers(choices: list[Choice], reason: str) -> None:
    for choice in choices:
        choice.timer.finish(reason)


def _usage(choices: list[Choice]) -> dict[str, Any]:
    """Each prompt counted once whatever its `n` (as OpenAI and vLLM count), every choice's output."""
    firsts = [c for c in choices if c.sibling == 0]
    prompt = sum(len(c.ids) for c in firsts)
    generated = sum(c.num_output_tokens for c in choices)
    cached = sum(c.final.num_cached_tokens for c in firsts if c.final is not None)
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated,
            "prompt_tokens_details": {"cached_tokens": cached}}
