"""The server under bad input and real traffic: every error status in each protocol's error JSON, API keys,
the bounded queue (429), client disconnects (abort, pages freed), graceful shutdown, malformed bodies (always
4xx, never 5xx), and `deepserve serve` as a real process on loopback."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys

import aiohttp
import pytest

from deepserve.server import ADMISSION, ENGINE
from deepserve.server.errors import ApiError
from deepserve.server.state import Admission
from test_server import MODEL, USER, chat_dir, make_app, pages_all_free, parse_sse  # noqa: F401 - fixtures

CHAT = {"model": MODEL, "messages": USER, "max_tokens": 2}
BODIES = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 2},
    "/v1/responses": {"model": MODEL, "input": "hi", "max_output_tokens": 2},
    "/v1/messages": {"model": MODEL, "messages": USER, "max_tokens": 2},
}


@pytest.fixture
async def client(aiohttp_client, chat_dir):  # noqa: F811
    return await aiohttp_client(make_app(chat_dir, max_body_bytes=4096, engine={"max_model_len": 256}))


async def error_of(response) -> tuple[int, str, str | None]:
    """(status, message, param) from either protocol's error JSON."""
    body = await response.json()
    if response.url.path.startswith("/v1/messages"):
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
        return response.status, body["error"]["message"], None
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return response.status, body["error"]["message"], body["error"]["param"]


# -- errors, in each protocol's JSON ---------------------------------------------------------------------------------
@pytest.mark.parametrize("path", list(BODIES))
async def test_error_statuses_of_every_generation_endpoint(client, path):
    base = BODIES[path]
    status, message, _ = await error_of(await client.post(path, data=b'{"model": "tiny", '))
    assert status == 400 and "invalid JSON" in message
    status, message, _ = await error_of(await client.post(path, json={**base, "model": "gpt-5"}))
    assert status == 404 and "gpt-5" in message and MODEL in message
    status, message, _ = await error_of(await client.post(path, data=b"{" + b" " * 5000 + b"}"))
    assert status == 413 and "too large" in message
    long = "x" * 400  # 400 byte tokens, context 256
    too_long = {**base, "prompt": long} if path == "/v1/completions" else {**base, "input": long} \
        if path == "/v1/responses" else {**base, "messages": [{"role": "user", "content": long}]}
    status, message, _ = await error_of(await client.post(path, json=too_long))
    assert status == 400 and "256" in message and any(str(n) in message for n in range(400, 420))
    status, message, param = await error_of(await client.post(path, json={**base, "temperature": "hot"}))
    assert status == 400 and "temperature" in message and param in ("temperature", None)


async def test_unsupported_options_are_named(client):
    cases = [("/v1/chat/completions", {**CHAT, "prediction": {"type": "content", "content": "x"}}, "prediction"),
             ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
                 {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
              "messages[0].content[0]"),
             ("/v1/responses", {**BODIES["/v1/responses"], "previous_response_id": "resp_1"}, "previous_response_id"),
             ("/v1/completions", {**BODIES["/v1/completions"], "suffix": "!"}, "suffix"),
             ("/v1/completions", {**BODIES["/v1/completions"], "frobnicate": 1}, "frobnicate"),
             ("/v1/completions", {**BODIES["/v1/completions"], "best_of": 2}, "best_of")]
    for path, body, name in cases:
        status, message, param = await error_of(await client.post(path, json=body))
        assert (status, param) == (400, name) and name in message, (path, body, message)


async def test_wrong_route_and_method_get_json_errors(client):
    r = await client.get("/v1/nothing")
    assert r.status == 404 and "no route" in (await r.json())["error"]["message"]
    r = await client.get("/v1/chat/completions")
    assert r.status == 405 and "POST" in r.headers["Allow"]


# -- API keys --------------------------------------------------------------------------------------------------------
async def test_api_key_guards_v1_routes_only(aiohttp_client, chat_dir):  # noqa: F811
    client = await aiohttp_client(make_app(chat_dir, api_key="s3cret"))
    r = await client.post("/v1/chat/completions", json=CHAT)
    assert r.status == 401 and "missing API key" in (await r.json())["error"]["message"]
    r = await client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer wrong"})
    assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
    r = await client.post("/v1/messages", json=BODIES["/v1/messages"], headers={"x-api-key": "s3cre"})
    assert r.status == 401 and (await r.json())["error"]["type"] == "authentication_error"  # Anthropic's shape
    r = await client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer s3cret"})
    assert r.status == 200
    r = await client.post("/v1/messages", json=BODIES["/v1/messages"], headers={"x-api-key": "s3cret"})
    assert r.status == 200
    assert (await client.get("/health")).status == 200 and (await client.get("/metrics")).status == 200
    doc = await (await client.get("/openapi.json")).json()
    assert doc["paths"]["/v1/models"]["get"]["security"] and "401" in doc["paths"]["/v1/models"]["get"]["responses"]


# -- traffic: the bounded queue, disconnects, shutdown ---------------------------------------------------------------
async def read_first_event(response) -> bytes:
    line = b""
    while not line.startswith(b"data:"):
        line = await response.content.readline()
    return line


async def test_full_queue_answers_429_with_retry_after(aiohttp_client, chat_dir):  # noqa: F811
    client = await aiohttp_client(make_app(chat_dir, max_waiting_requests=1, engine={"max_num_seqs": 1}))
    long = {"model": MODEL, "prompt": "a", "max_tokens": 500, "ignore_eos": True}
    held = [asyncio.create_task(client.post("/v1/completions", json=long)) for _ in range(2)]  # running + waiting
    while client.app[ADMISSION].num_open < 2:
        await asyncio.sleep(0.01)
    r = await client.post("/v1/chat/completions", json=CHAT)
    assert r.status == 429 and r.headers["Retry-After"] == "1"
    assert (await r.json())["error"]["type"] == "rate_limit_error"
    assert "deepserve_requests_rejected_total 1.0" in await (await client.get("/metrics")).text()
    for task in held:
        task.cancel()  # the clients give up: both requests are aborted
    await asyncio.gather(*held, return_exceptions=True)
    assert await pages_all_free(client.app)
    assert (await client.post("/v1/chat/completions", json=CHAT)).status == 200


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_client_disconnect_aborts_and_frees_pages(client, path):
    body = {**BODIES[path], "max_tokens": 200, "stream": True}
    response = await client.post(path, json=body)
    await read_first_event(response)
    assert client.app[ENGINE].num_open_streams == 1
    response.close()  # the client goes away mid-stream
    assert await pages_all_free(client.app)
    metrics = await (await client.get("/metrics")).text()
    assert 'deepserve_requests_finished_total{reason="abort"} 1.0' in metrics


async def test_non_streaming_client_that_leaves_aborts_too(client):
    body = {"model": MODEL, "prompt": "a", "max_tokens": 200, "ignore_eos": True}
    with pytest.raises(asyncio.TimeoutError):
        await client.post("/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=0.3))
    assert await pages_all_free(client.app)


async def test_graceful_shutdown_lets_in_flight_streams_finish(aiohttp_client, chat_dir):  # noqa: F811
    client = await aiohttp_client(make_app(chat_dir))
    app, server = client.app, client.server
    response = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 25, "stream": True})
    first = await read_first_event(response)
    closing = asyncio.create_task(server.close())  # SIGTERM's path: stop listening, drain, clean up
    rest = (await response.read()).decode()
    await closing
    events = parse_sse(first.decode() + "\n" + rest)
    assert events[-1] == (None, "[DONE]")
    assert json.loads(events[-2][1])["choices"][0]["finish_reason"] == "length"
    assert app[ADMISSION].draining and app[ENGINE].num_open_streams == 0


async def test_concurrent_streams_with_disconnects_leave_nothing_behind(aiohttp_client, chat_dir):  # noqa: F811
    app = make_app(chat_dir, max_waiting_requests=200, engine={"max_num_seqs": 32})
    client = await aiohttp_client(app, connector=aiohttp.TCPConnector(limit=0))  # all 200 at once
    num_requests = 200  # 30% of them leave after their first event

    async def one(i: int) -> tuple[int, tuple | None]:
        path = "/v1/chat/completions" if i % 2 else "/v1/completions"
        response = await client.post(path, json={**BODIES[path], "max_tokens": 10, "stream": True})
        if i % 10 < 3:
            await read_first_event(response)
            response.close()
            return response.status, None
        return response.status, parse_sse(await response.text())[-1]

    results = await asyncio.gather(*(one(i) for i in range(num_requests)))
    assert [status for status, _ in results] == [200] * num_requests
    assert all(last == (None, "[DONE]") for _, last in results if last is not None)
    assert await pages_all_free(client.app) and (await client.get("/health")).status == 200
    metrics = await (await client.get("/metrics")).text()
    finished = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                   if line.startswith("deepserve_requests_finished_total{"))
    assert finished == num_requests


async def test_admission_refuses_while_draining():
    admission = Admission(capacity=2, retry_after_seconds=3)
    with admission.admit():
        assert not await admission.drain(timeout=0.01)  # one still open
        with pytest.raises(ApiError) as refused:
            with admission.admit():
                pass
    assert refused.value.status == 503 and refused.value.headers == {"Retry-After": "3"}
    assert await admission.drain(timeout=0.01)


# -- malformed bodies: always 4xx ------------------------------------------------------------------------------------
RAW_JUNK = [b"", b"{", b"null", b"[]", b"42", b'"text"', b"\xff\xfe\x00\x01", b'{"model": NaN}',
            b'{"model": "tiny", "x": Infinity}', b'{"a": "\\ud800"}', b"[" * 100_000, b'{"a": ' * 3000,
            b'{"model": "tiny"}', b'{"model": "tiny", "messages": [], "input": 5, "prompt": {}}']
FIELD_JUNK = [None, True, -1, 0, 1.5, 2**63, 2**64 - 1, 10**30, -(10**30), 1e308, "", "x" * 3000,
              "\u202e\u0000\U0001f600", "\ud800",
              [], [None], [1, "a", {}], {}, {"nested": [[[{"deep": [None, {"x": -1e308}]}]]]}]
FIELDS = {"/v1/chat/completions": ["messages", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream",
                                   "stream_options", "logprobs", "top_logprobs", "tools", "tool_choice", "top_k",
                                   "logit_bias", "presence_penalty", "bad_words"],
          "/v1/completions": ["prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream",
                              "stream_options", "logprobs", "echo", "top_k", "min_tokens", "stop_token_ids",
                              "logit_bias", "frequency_penalty", "repetition_penalty", "bad_words"],
          "/v1/responses": ["input", "max_output_tokens", "temperature", "top_p", "stream", "tools", "text",
                            "reasoning", "instructions", "top_logprobs"],
          "/v1/messages": ["messages", "max_tokens", "temperature", "top_p", "top_k", "stream", "system",
                           "stop_sequences", "tools", "thinking"]}


@pytest.mark.parametrize("path", list(BODIES))
async def test_malformed_bodies_always_get_4xx(client, path):
    bodies = [(repr(raw[:40]), raw) for raw in RAW_JUNK]
    for field in ["model", *FIELDS[path]]:
        for value in FIELD_JUNK:
            if value is None and "max" in field:
                continue  # a valid "as many as the context holds": slow, and not junk
            bodies.append((f"{field}={value!r:.40}", json.dumps({**BODIES[path], field: value}).encode()))
    served_fine = []
    for label, raw in bodies:
        r = await client.post(path, data=raw, headers={"Content-Type": "application/json"})
        text = await r.text()
        assert r.status < 500, (label, r.status, text)
        if r.status == 200:
            served_fine.append(label)  # junk that is still a valid request (e.g. stop="", top_k=0)
        else:
            assert 400 <= r.status < 500 and json.loads(text), (label, text)
    assert len(served_fine) < len(bodies) // 3, served_fine
    assert await pages_all_free(client.app) and (await client.get("/health")).status == 200


# -- the real process ------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_serve_command_streams_and_exits_cleanly_on_sigint(chat_dir):  # noqa: F811
    port = free_port()
    cmd = [sys.executable, "-m", "deepserve", "serve", str(chat_dir), "--port", str(port), "--served-model-name",
           MODEL, "--accelerator", "cpu", "--dtype", "float32", "--max-model-len", "512", "--block-size", "128",
           "--max-num-seqs", "2", "--api-key", "k", "--thinking", "off", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as session:
            for _ in range(300):
                try:
                    if (await session.get("/health")).status == 200:
                        break
                except aiohttp.ClientConnectionError:
                    await asyncio.sleep(0.05)
            body = {**CHAT, "max_tokens": 3, "stream": True}
            r = await session.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer k"})
            assert r.status == 200 and parse_sse(await r.text())[-1] == (None, "[DONE]")
        proc.send_signal(signal.SIGINT)
        assert await asyncio.to_thread(proc.wait, 30) == 0, proc.stdout.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def test_serve_without_a_model_says_what_to_pass(monkeypatch, tmp_path, capsys):
    from deepserve import cli

    monkeypatch.setattr("deepserve.core.env.default_model_dir", lambda: None)  # as if the embedded model were absent
    monkeypatch.delenv("DEEPSERVE_MODEL", raising=False)
    monkeypatch.delenv("DEEPINFER_HF_MODEL_DIR", raising=False)
    assert cli.main(["serve"]) == 2
    assert "pass a checkpoint directory" in capsys.readouterr().err
