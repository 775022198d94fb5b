"""The engine's failures as the client sees them, the same on every generation route (one mapping,
`deepserve/server/engine_errors.py`): a dead engine thread is a 503 before the response starts and the
protocol's error event after, a request the engine refuses is a 400 with the engine's message, and each counts
as `error` in `deepserve_requests_finished_total`. The one fake is the engine's `generate` (the edge)."""

from __future__ import annotations

import json

import pytest

from deepserve.core.async_engine import EngineDeadError
from deepserve.server import ENGINE
from test_server import MODEL, USER, chat_dir, client, parse_sse  # noqa: F401 - fixtures

ROUTES = [("/v1/chat/completions", {"messages": USER}), ("/v1/chat/completions", {"messages": USER, "n": 2}),
          ("/v1/completions", {"prompt": "hi"}), ("/v1/completions", {"prompt": ["hi", "there"]}),
          ("/v1/responses", {"input": "hi"}), ("/v1/messages", {"messages": USER})]


def failing_generate(engine, error: Exception, after: int = 0):
    """`engine.generate` that yields the real request's first `after` outputs, then raises `error`."""
    real = engine.generate

    async def generate(*args, **kwargs):
        if after:
            outs = real(*args, **kwargs)
            try:
                for _ in range(after):
                    yield await anext(outs)
            finally:
                await outs.aclose()
        raise error

    return generate


async def finished_errors(client) -> float:
    text = await (await client.get("/metrics")).text()
    line = next(x for x in text.splitlines() if x.startswith('deepserve_requests_finished_total{reason="error"}'))
    return float(line.rsplit(" ", 1)[1])


@pytest.mark.parametrize("path,body", ROUTES, ids=[f"{p}{'-n2' if b.get('n') else ''}"
                                                   f"{'-batch' if isinstance(b.get('prompt'), list) else ''}"
                                                   for p, b in ROUTES])
async def test_engine_failures_map_the_same_on_every_route(client, monkeypatch, path, body):
    engine = client.app[ENGINE]
    body = {"model": MODEL, "max_tokens": 4, **body}
    before = await finished_errors(client)
    cases = [(EngineDeadError("the engine thread has stopped"), 503, "the engine has stopped"),
             (ValueError("prompt_logprobs is not supported here"), 400, "prompt_logprobs is not supported here")]
    for error, status, message in cases:
        monkeypatch.setattr(engine, "generate", failing_generate(engine, error))
        r = await client.post(path, json=body)
        answer = await r.json()
        assert r.status == status, (path, answer)
        text = answer["error"]["message"]
        assert message in text, (path, answer)
    assert await finished_errors(client) >= before + 2  # every choice of the request counts


@pytest.mark.parametrize("n", [1, 2])
async def test_a_dead_engine_mid_stream_ends_the_stream_with_the_error_event(client, monkeypatch, n):
    engine = client.app[ENGINE]
    monkeypatch.setattr(engine, "generate", failing_generate(engine, EngineDeadError("stopped"), after=1))
    r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "max_tokens": 8,
                                                        "n": n, "stream": True})
    assert r.status == 200
    events = parse_sse(await r.text())
    last = json.loads(events[-1][1])
    assert "the engine has stopped" in last["error"]["message"] and last["error"]["type"] == "overloaded_error"
    assert all(data != "[DONE]" for _, data in events)
