"""Chat completions with `n` > 1: the server fans one request out into n engine requests (deepseek-recipe and
the engine make one choice each) and merges their protocol events into one response with n choices.

Choice j has its own stream processor and usage (`Prepared.sibling`) and, when seeded, `seed + j`. Choice 0
goes first and the others follow once it has produced its first output, so the prompt's full pages are in the
prefix cache and the siblings compute only what is left (`share_prompt`). Every event of choice j is written
with `index: j`; the usage is the prompt once and every choice's output, in one final usage chunk when the
client asked for streamed usage. An error ends the whole response, as it would a single choice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

from aiohttp import web

from deepserve.server.admission import Ticket
from deepserve.server.engine_errors import engine_errors, failure_reason
from deepserve.server.errors import ApiError
from deepserve.server.generation import Translator, fail_stream
from deepserve.server.http import open_sse, sse_message
from deepserve.server.recipe import Prepared
from deepserve.server.state import CONFIG, ENGINE, METRICS, MODEL
from deepserve.server.structured import client_of, compile_grammar

_DONE = object()


async def serve_choices(request: web.Request, prepared: Prepared, ticket: Ticket) -> web.StreamResponse:
    """Serve `prepared` (a chat request with `prepared.n` > 1) as n choices."""
    try:
        ticket.claim(prepared.n, param="n")
        spec = prepared.params.structured_outputs
        if spec is not None:
            await compile_grammar(request.app[ENGINE].engine, spec, prepared.constraint_field, client_of(request))
        siblings = [prepared] + [prepared.sibling(j) for j in range(1, prepared.n)]
    except BaseException:
        prepared.processor.close()
        raise
    eos = request.app[MODEL].eos_token_ids
    translators = [Translator(p, eos, request.app[METRICS].timer()) for p in siblings]
    failure = None
    try:
        return await _run(request, siblings, translators, ticket)
    except ApiError as error:
        failure = failure_reason(error)
        raise
    finally:
        for t in translators:
            if not t.done:
                t.processor.close()
            t.timer.finish(t.reason if t.done or t.failed else failure or "abort")


async def _run(request: web.Request, siblings: list[Prepared], translators: list[Translator],
               ticket: Ticket) -> web.StreamResponse:
    engine, model = request.app[ENGINE], request.app[MODEL]
    first = siblings[0]
    response_type = first.protocol.response_type
    core = engine.engine
    share = core.enable_prefix_caching and len(first.prompt_token_ids) > core.page_size
    queue: asyncio.Queue = asyncio.Queue()
    started = asyncio.Event()

    async def pump(j: int) -> None:
        try:
            if j and share:
                await started.wait()
            engine_id = f"{first.request_id}-{j}"
            ticket.start(engine_id)  # no await from here to the engine's add: see `Ticket.start`
            outs = engine.generate(first.prompt_token_ids, siblings[j].params, request_id=engine_id, views=True,
                                   session_id=first.session_id, stream_interval=request.app[CONFIG].stream_interval)
            async with contextlib.aclosing(outs):
                async for out in outs:
                    started.set()
                    queue.put_nowait((j, out))
                    if translators[j].done:
                        break  # a stop sequence ended its text: closing the stream aborts it in the engine
            queue.put_nowait(_DONE)
        except BaseException as exc:  # noqa: BLE001 - handed to the reader, which raises it
            queue.put_nowait(exc)
        finally:
            started.set()  # an error or an abort: the siblings go on (and meet the same fate) rather than hang

    sse: web.StreamResponse | None = None
    accumulated: list[Any] = [None] * len(siblings)
    usages: list[dict | None] = [None] * len(siblings)
    began = [False] * len(siblings)
    tasks = [asyncio.create_task(pump(j)) for j in range(len(siblings))]
    try:
        with engine_errors():
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is _DONE:
                    remaining -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                j, out = item
                t = translators[j]
                if t.done:
                    continue
                fresh, began[j] = not began[j], True
                events = t.first(out) if fresh else []
                events += t.events(out)
                if fresh and not first.stream:
                    accumulated[j] = response_type(first.request_id, model.name, int(time.time()),
                                                   t.num_prompt_tokens, out.num_cached_tokens)
                if first.stream:
                    if sse is None:
                        sse = await open_sse(request)
                    chunks = []
                    for event in events:
                        data = json.loads(t.usage.patch(event.to_json()) if t.done else event.to_json())
                        if isinstance(data.get("usage"), dict):
                            usages[j], data["usage"] = data["usage"], None  # one usage chunk for all, at the end
                            if not data.get("choices"):
                                continue
                        chunks.append(sse_message(json.dumps(_indexed(data, j), ensure_ascii=False)))
                    await sse.write(b"".join(chunks))
                else:
                    for event in events:
                        accumulated[j].accumulate(event)
    except ApiError as error:
        if sse is None:
            raise
        await fail_stream(sse, first, error, translators)
        await sse.write_eof()
        return sse
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if sse is None:
        bodies = [json.loads(t.usage.patch(a.to_json())) for t, a in zip(translators, accumulated)]
        body = bodies[0]
        body["choices"] = [_indexed(b, j)["choices"][0] for j, b in enumerate(bodies)]
        body["usage"] = _summed([b.get("usage") for b in bodies])
        return web.json_response(body, dumps=lambda x: json.dumps(x, ensure_ascii=False))
    if any(u is not None for u in usages):
        tail = {"id": first.request_id, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": model.name, "choices": [], "usage": _summed(usages)}
        await sse.write(sse_message(json.dumps(tail, ensure_ascii=False)))
    done = response_type.sse_done_data()
    if done is not None:
        await sse.write(sse_message(done))
    await sse.write_eof()
    return sse


def _indexed(data: dict, index: int) -> dict:
    for choice in data.get("choices") or ():
        choice["index"] = index
    return data


def _summed(usages: list[dict | None]) -> dict | None:
    """The prompt once (every choice read the same one), the choices' outputs added up."""
    present = [u for u in usages if isinstance(u, dict)]
    if not present:
        return None
    total = json.loads(json.dumps(present[0]))
    total["completion_tokens"] = sum(u.get("completion_tokens", 0) for u in present)
    total["total_tokens"] = total.get("prompt_tokens", 0) + total["completion_tokens"]
    details = [u.get("completion_tokens_details") for u in present]
    if all(isinstance(d, dict) for d in details) and "reasoning_tokens" in details[0]:
        total["completion_tokens_details"]["reasoning_tokens"] = sum(d.get("reasoning_tokens") or 0 for d in details)
    return total
