"""Session ids over HTTP (issue 21): `session_id` on every generation route and the Responses API's
`conversation` reach the engine, so a conversation's next turn restores its SWA host slot (docs/cache.md) by its
session; a malformed one is a 400 that names the field."""

from __future__ import annotations

import asyncio
import random

import pytest

from deepserve.server.session import MAX_SESSION_ID_LENGTH
from deepserve.server.state import ENGINE
from test_server import MODEL, USER, chat_dir, make_app  # noqa: F401 - fixtures

P = 128


async def complete(client, prompt: list[int], session: str | None, max_tokens: int) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if session is not None:
        body["session_id"] = session
    r = await client.post("/v1/completions", json=body)
    assert r.status == 200, await r.text()
    return await r.json()


async def saved_slot(app, session: str, tries: int = 500):
    """The session's slot once the engine has saved it: the save runs with the step after the one that finished
    the request, which may come after the response."""
    directory = app[ENGINE].engine.swa_slots.directory
    for _ in range(tries):
        if (entry := directory.get(session)) is not None:
            return entry
        await asyncio.sleep(0.01)
    return None


async def test_a_sessions_next_turn_restores_its_slot_by_session_id(aiohttp_client, chat_dir):
    client = await aiohttp_client(make_app(chat_dir, engine={"swa_host_slots": 2}))
    rng = random.Random(0)
    first = [rng.randrange(3, 250) for _ in range(150)]
    await complete(client, first, "chat-1", 6)
    entry = await saved_slot(client.app, "chat-1")
    assert entry is not None, "the first turn's state is not saved under its session id"
    saved = first[: entry.location.num_tokens // P * P] + list(entry.tail)  # the prompt and the output so far
    assert saved[: len(first)] == first
    second = saved + [rng.randrange(3, 250) for _ in range(12)]
    other = await complete(client, second, "chat-2", 2)  # another session: its slot is not this one
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == P
    same = await complete(client, second, "chat-1", 2)
    assert same["usage"]["prompt_tokens_details"]["cached_tokens"] == entry.location.num_tokens > P


async def test_every_route_hands_its_session_to_the_engine(aiohttp_client, chat_dir):
    client = await aiohttp_client(make_app(chat_dir))
    core = client.app[ENGINE].engine
    seen, add = [], core.add_request

    def spy(*args, **kwargs):
        seen.append(kwargs.get("session_id"))
        return add(*args, **kwargs)

    core.add_request = spy
    asks = [("/v1/chat/completions", {"messages": USER, "session_id": "a"}),
            ("/v1/chat/completions", {"messages": USER, "n": 2, "session_id": "b"}),
            ("/v1/completions", {"prompt": [5, 6, 7], "session_id": "c"}),
            ("/v1/responses", {"input": "hi", "conversation": "d"}),
            ("/v1/responses", {"input": "hi", "conversation": {"id": "e"}, "session_id": "e"}),
            ("/v1/messages", {"messages": USER, "session_id": "f"}),
            ("/v1/chat/completions", {"messages": USER})]
    for path, body in asks:
        limit = {"max_output_tokens": 1} if path == "/v1/responses" else {"max_tokens": 1}
        r = await client.post(path, json={"model": MODEL, **limit, **body})
        assert r.status == 200, (path, await r.text())
    assert seen == ["a", "b", "b", "c", "d", "e", "f", None]


@pytest.mark.parametrize("path, field, value, param, message", [
    ("/v1/chat/completions", "session_id", 7, "session_id", "must be a string"),
    ("/v1/messages", "session_id", "", "session_id", "must not be empty"),
    ("/v1/completions", "session_id", "x" * (MAX_SESSION_ID_LENGTH + 1), "session_id", "at most 256"),
    ("/v1/responses", "conversation", {"name": "c"}, "conversation.id", "an object with an 'id'"),
    ("/v1/responses", "conversation", ["c"], "conversation", "must be a string"),
])
async def test_a_malformed_session_is_a_400_naming_its_field(aiohttp_client, chat_dir, path, field, value, param,
                                                             message):
    client = await aiohttp_client(make_app(chat_dir))
    body = {"model": MODEL, field: value, "max_tokens": 1}
    body.update({"input": "hi"} if path == "/v1/responses" else
                {"prompt": [5, 6]} if path == "/v1/completions" else {"messages": USER})
    if path == "/v1/responses":
        body["max_output_tokens"] = body.pop("max_tokens")
    r = await client.post(path, json=body)
    assert r.status == 400, await r.text()
    error = (await r.json())["error"]
    assert message in error["message"] and error.get("param", param) == param, error  # Anthropic's errors name none


async def test_two_sessions_in_one_request_or_one_session_for_a_batch_is_a_400(aiohttp_client, chat_dir):
    client = await aiohttp_client(make_app(chat_dir))
    r = await client.post("/v1/responses", json={"model": MODEL, "input": "hi", "session_id": "a",
                                                 "conversation": {"id": "b"}})
    assert r.status == 400 and "different sessions" in (await r.json())["error"]["message"]
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": [[5, 6], [7, 8]], "session_id": "a"})
    assert r.status == 400 and "one prompt" in (await r.json())["error"]["message"]
