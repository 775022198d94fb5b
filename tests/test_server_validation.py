"""One validation path: a field that several routes read gets the same answer on each (status, message,
`param`), image and file parts are refused by name, Anthropic's roles are Anthropic's, and a client's mistakes
are logged quietly (no ERROR, no traceback)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from test_server import MODEL, USER, chat_dir, make_app  # noqa: F401 - fixtures

BASE = {
    "/v1/chat/completions": {"model": MODEL, "messages": USER, "max_tokens": 4},
    "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 4},
    "/v1/responses": {"model": MODEL, "input": "hi", "max_output_tokens": 4},
    "/v1/messages": {"model": MODEL, "messages": USER, "max_tokens": 4},
}
EVERY_ROUTE = list(BASE)
#: (field on each route it is named differently on, value, the routes that read it)
SHARED = [
    ("seed", -1, EVERY_ROUTE), ("seed", 2**63, EVERY_ROUTE), ("seed", 1.5, EVERY_ROUTE),
    ("temperature", 2.5, EVERY_ROUTE), ("top_p", 0, EVERY_ROUTE), ("top_k", -2, EVERY_ROUTE),
    ("stream", "yes", EVERY_ROUTE),
    ("stop", ["x"] * 17, ["/v1/chat/completions", "/v1/completions", "/v1/messages"]),
    ("stop", [""], ["/v1/chat/completions", "/v1/completions", "/v1/messages"]),
    ("max_tokens", 0, EVERY_ROUTE),
]
RENAMED = {("/v1/messages", "stop"): "stop_sequences", ("/v1/responses", "max_tokens"): "max_output_tokens"}


@pytest.fixture
async def client(aiohttp_client, chat_dir):  # noqa: F811
    return await aiohttp_client(make_app(chat_dir))


async def error_of(response) -> tuple[int, str, str | None]:
    body = await response.json()
    if response.url.path == "/v1/messages":
        return response.status, body["error"]["message"], None
    return response.status, body["error"]["message"], body["error"]["param"]


@pytest.mark.parametrize("field, value, routes", SHARED, ids=[f"{f}={v!r:.12}" for f, v, _ in SHARED])
async def test_a_shared_field_gets_the_same_answer_on_every_route(client, field, value, routes):
    answers = {}
    for path in routes:
        name = RENAMED.get((path, field), field)
        status, message, param = await error_of(await client.post(path, json={**BASE[path], name: value}))
        assert status == 400 and f"'{name}" in message, (path, message)
        assert param in (None, name, f"{name}[0]"), (path, param)
        answers[path] = message.replace(f"'{name}", "'FIELD")
    assert len(set(answers.values())) == 1, answers


async def test_the_limits_are_the_same_on_every_route(client):
    for path in EVERY_ROUTE:
        body = {**BASE[path], "seed": 2**63 - 1, "temperature": 2, "top_p": 1, "top_k": -1}
        if path != "/v1/responses":
            body[RENAMED.get((path, "stop"), "stop")] = ["x" * 8] * 16
        r = await client.post(path, json=body)
        assert r.status == 200, (path, await r.text())


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
async def test_seed_is_honoured_where_the_protocol_has_none(client, path):
    def text_of(body: dict) -> str:
        if path == "/v1/messages":
            return "".join(block.get("text", "") for block in body["content"])
        return "".join(part.get("text", "") for item in body["output"] for part in item.get("content", []))

    texts = []
    for _ in range(2):
        r = await client.post(path, json={**BASE[path], "temperature": 1.0, "seed": 7, "max_tokens": 8,
                                          **({"max_output_tokens": 8} if path == "/v1/responses" else {})})
        assert r.status == 200, await r.text()
        texts.append(text_of(await r.json()))
    assert texts[0] == texts[1] and texts[0]  # the seed made the draws reproducible (unseeded, they differ)


IMAGE = "data:image/png;base64,iVBORw0KGgo="
MEDIA = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": IMAGE}}]}]},
     "image", "messages[0].content[1]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "file", "file": {"file_data": "AAAA", "filename": "a.pdf"}}]}]}, "file", "messages[0].content[0]"),
    ("/v1/responses", {"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "hi"}, {"type": "input_image", "image_url": IMAGE}]}]},
     "image", "input[0].content[1]"),
    ("/v1/messages", {"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]}, "image", "messages[0].content[0]"),
    ("/v1/messages", {"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}]}, "image", "messages[2].content[0].content[0]"),
]


@pytest.mark.parametrize("path, fields, kind, where", MEDIA, ids=[w for *_, w in MEDIA])
async def test_image_and_file_parts_are_refused_by_name(client, path, fields, kind, where):
    status, message, param = await error_of(await client.post(path, json={**BASE[path], **fields}))
    assert status == 400 and f"{kind} input is not supported yet" in message and where in message, message
    assert param in (None, where)


async def test_a_system_role_inside_anthropic_messages_is_refused(client):
    messages = [{"role": "system", "content": "be brief"}, *USER]
    status, message, _ = await error_of(await client.post("/v1/messages", json={**BASE["/v1/messages"],
                                                                                "messages": messages}))
    assert status == 400 and "messages[0].role" in message and "'system'" in message
    r = await client.post("/v1/messages", json={**BASE["/v1/messages"], "system": "be brief"})
    assert r.status == 200  # where Anthropic puts it


async def raw_request(client, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
    writer.write(data)
    await writer.drain()
    answer = await reader.read(200)
    writer.close()
    return answer


async def test_client_errors_are_logged_quietly(client, caplog):
    bad_requests = [b"GET /health HTTP/1.1\r\nHost: x\r\nX-Bad: a\x00b\r\n\r\n",
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n"]
    with caplog.at_level(logging.INFO):
        for data in bad_requests:
            assert (await raw_request(client, data)).startswith(b"HTTP/1.0 400")
        r = await client.post("/v1/completions", data=b"{\"model\": ", headers={"Authorization": "Bearer \u00e9"})
        assert r.status == 400
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    quiet = [r.getMessage() for r in caplog.records if r.name == "aiohttp.server"]
    assert len(quiet) == 2 and all("malformed HTTP request" in m for m in quiet), quiet
    assert not any(r.exc_info for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # a server logging warnings and up logs none of it
        await raw_request(client, bad_requests[0])
    assert not [r for r in caplog.records if r.name == "aiohttp.server"]
