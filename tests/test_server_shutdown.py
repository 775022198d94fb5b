"""Shutdown as docs/server.md says (new requests 503, open ones finish within --drain-timeout, the rest end
with the protocol's error event and are aborted in the engine) and the engine watchdog (/health 503 while the
engine has work and completes no step). The engine's steps are held at a gate, so what happens when is decided
by the test, never by timing."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from types import SimpleNamespace

import pytest

from deepserve.server import ADMISSION, ENGINE
from deepserve.server.admission import Admission
from deepserve.server.watchdog import WATCHDOG, EngineWatchdog
from test_server import MODEL, USER, chat_dir, make_app, parse_sse  # noqa: F401 - fixtures

BODIES = {
    "/v1/chat/completions": {"model": MODEL, "messages": USER, "max_tokens": 200, "temperature": 0},
    "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 200, "ignore_eos": True},
    "/v1/responses": {"model": MODEL, "input": "hi", "max_output_tokens": 200, "temperature": 0},
    "/v1/messages": {"model": MODEL, "messages": USER, "max_tokens": 200, "temperature": 0},
}


class StepGate:
    """While closed, the engine's next model step waits (on the runner's thread) until it opens."""

    def __init__(self, app) -> None:
        self.opened, self.holding = threading.Event(), threading.Event()
        self.opened.set()
        executor = app[ENGINE].engine.executor
        execute = executor.execute

        def gated(step):
            if not self.opened.is_set():
                self.holding.set()
                self.opened.wait(30)
            return execute(step)

        executor.execute = gated

    def close(self) -> None:
        self.holding.clear()
        self.opened.clear()


async def until(condition, what: str, tries: int = 1500) -> None:
    for _ in range(tries):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


async def read_first_event(response) -> str:
    lines = []
    while not lines or not lines[-1].startswith("data:"):
        lines.append((await response.content.readline()).decode().rstrip("\n"))
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("path", list(BODIES))
async def test_streams_open_at_the_drain_timeout_end_with_the_error_event(aiohttp_client, chat_dir, path):  # noqa: F811
    client = await aiohttp_client(make_app(chat_dir, drain_timeout=0))
    app, gate = client.app, StepGate(client.app)
    response = await client.post(path, json={**BODIES[path], "stream": True})
    first = await read_first_event(response)
    gate.close()  # the stream cannot reach its end before the shutdown aborts it
    await asyncio.to_thread(gate.holding.wait, 30)
    closing = asyncio.create_task(client.server.close())  # SIGTERM's path: stop listening, drain, clean up
    await until(lambda: app[ADMISSION].aborting, "the drain timed out and aborted")
    gate.opened.set()
    rest = (await response.read()).decode()
    await closing
    events = parse_sse(first + "\n" + rest)
    name, data = events[-1]
    error = json.loads(data)
    if path == "/v1/messages":
        assert name == "error" and error["type"] == "error" and error["error"]["type"] == "overloaded_error"
        assert "shutting down" in error["error"]["message"]
        assert "message_stop" not in [n for n, _ in events]
    elif path == "/v1/responses":
        assert name == "error" and error["type"] == "error" and error["code"] == "overloaded_error"
        assert "shutting down" in error["message"]
        assert not {"response.completed", "response.incomplete"} & {n for n, _ in events}
    else:
        assert name is None and error["error"]["code"] == "server_shutting_down", error
        assert error["error"]["type"] == "overloaded_error" and "shutting down" in error["error"]["message"]
        assert "[DONE]" not in [d for _, d in events]
    assert len(events) > 2  # it was streaming: the error ends a started stream
    assert app[ENGINE].num_open_streams == 0 and app[ADMISSION].num_open == 0


async def test_a_request_not_answered_at_the_drain_timeout_gets_503(aiohttp_client, chat_dir):  # noqa: F811
    client = await aiohttp_client(make_app(chat_dir, drain_timeout=0))
    app, gate = client.app, StepGate(client.app)
    gate.close()
    pending = asyncio.create_task(client.post("/v1/completions", json=BODIES["/v1/completions"]))
    await asyncio.to_thread(gate.holding.wait, 30)  # the engine is computing it
    closing = asyncio.create_task(client.server.close())
    await until(lambda: app[ADMISSION].aborting, "the drain timed out and aborted")
    gate.opened.set()
    response = await pending
    body = await response.json()
    await closing
    assert response.status == 503 and body["error"]["code"] == "server_shutting_down"
    assert app[ENGINE].num_open_streams == 0


async def test_while_draining_new_requests_get_503_and_open_streams_finish(aiohttp_client, chat_dir):  # noqa: F811
    client = await aiohttp_client(make_app(chat_dir))  # drain_timeout 30 s: plenty for 200 tokens
    app, gate = client.app, StepGate(client.app)
    response = await client.post("/v1/completions", json={**BODIES["/v1/completions"], "stream": True})
    first = await read_first_event(response)
    gate.close()
    await asyncio.to_thread(gate.holding.wait, 30)
    draining = asyncio.create_task(app.shutdown())  # on_shutdown alone: the listener stays, as keep-alive would
    await until(lambda: app[ADMISSION].draining, "draining")
    refused = await client.post("/v1/chat/completions", json=BODIES["/v1/chat/completions"])
    error = (await refused.json())["error"]
    assert refused.status == 503 and refused.headers["Retry-After"] == "1"
    assert error["code"] == "server_shutting_down" and "shutting down" in error["message"]
    health = await client.get("/health")
    assert health.status == 503 and (await health.json())["status"] == "draining"
    gate.opened.set()
    events = parse_sse(first + "\n" + (await response.read()).decode())
    assert events[-1] == (None, "[DONE]") and json.loads(events[-2][1])["choices"][0]["finish_reason"] == "length"
    await draining
    assert not app[ADMISSION].aborting  # nothing was aborted: the stream finished within the drain


async def test_a_stuck_engine_step_turns_health_to_503_until_it_moves(aiohttp_client, chat_dir, caplog):  # noqa: F811
    client = await aiohttp_client(make_app(chat_dir, engine_step_timeout=0.2))
    app, gate = client.app, StepGate(client.app)
    await asyncio.sleep(0.5)  # idle past the timeout: an idle engine is not a stuck one
    assert (await client.get("/health")).status == 200 and not app[WATCHDOG].stalled
    gate.close()
    with caplog.at_level(logging.WARNING, logger="deepserve.server.watchdog"):
        pending = asyncio.create_task(client.post("/v1/completions", json={**BODIES["/v1/completions"],
                                                                            "max_tokens": 4}))
        await asyncio.to_thread(gate.holding.wait, 30)  # its first step is stuck
        await until(lambda: app[WATCHDOG].stalled, "the watchdog saw the stuck step")
        health = await client.get("/health")
        assert health.status == 503 and (await health.json())["status"] == "engine stalled"
        gate.opened.set()
        assert (await pending).status == 200
        await until(lambda: not app[WATCHDOG].stalled, "the watchdog saw the engine move again")
    assert (await client.get("/health")).status == 200
    messages = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "deepserve.server.watchdog"]
    assert any(level == logging.ERROR and "no engine step has completed" in m for level, m in messages)
    assert any(level == logging.WARNING and "moved again" in m for level, m in messages)


class PublishingEngine:
    """The two things the watchdog reads of an `AsyncEngine`: its latest snapshot and its open streams."""

    def __init__(self) -> None:
        self.num_open_streams = 0
        self.publish(running=0)

    def publish(self, running: int) -> None:
        self.latest = SimpleNamespace(num_requests_running=running, num_requests_waiting=0)

    def snapshot(self):
        return self.latest


def test_the_watchdog_tells_a_stuck_engine_from_an_idle_one():
    engine, admission = PublishingEngine(), Admission(capacity=4, retry_after_seconds=1)
    watchdog = EngineWatchdog(engine, admission, timeout=0.001)

    def check_later() -> bool:
        time.sleep(0.01)  # past the timeout
        watchdog.check()
        return watchdog.stalled

    engine.num_open_streams = 1  # a finished request whose client is still reading: no work for the engine
    assert not check_later()
    with admission.admit() as ticket:
        ticket.start("r1")  # handed to the engine, which has published nothing since
        assert check_later()
    engine.publish(running=1)  # it moved
    assert not check_later()
    assert check_later()  # running, and nothing new published
    engine.publish(running=0)
    assert not check_later() and not check_later()  # idle again
