"""A compressed soak (`bench/soak.py` is the long one, against a real process): hostile traffic all at once -
streams that finish, streams whose clients leave, clients that give up, oversized and malformed bodies,
pathological grammars beside trivial ones - and afterwards no 5xx was answered and nothing is left behind: no
open stream, no KV page, no sequence slot, no engine request. Nothing here asserts a time."""

from __future__ import annotations

import asyncio

import aiohttp

from deepserve.server import ENGINE
from test_server import MODEL, USER, chat_dir, make_app, pages_all_free  # noqa: F401 - fixtures

CHAT = "/v1/chat/completions"
PATHOLOGICAL = "([a-z]{1,30}[0-9]{1,30}){1500}"


async def test_hostile_mix_leaves_no_5xx_and_nothing_behind(aiohttp_client, chat_dir):  # noqa: F811
    app = make_app(chat_dir, max_waiting_requests=200, max_body_bytes=2**20, grammar_compile_timeout=2.0,
                   engine={"max_num_seqs": 16, "max_model_len": 256})
    client = await aiohttp_client(app, connector=aiohttp.TCPConnector(limit=0))
    chat = {"model": MODEL, "messages": USER, "max_tokens": 12}

    async def stream(leave_after: int | None) -> int:
        response = await client.post(CHAT, json={**chat, "stream": True})
        if leave_after is None:
            await response.read()
        else:
            for _ in range(leave_after):
                await response.content.readline()
            response.close()
        return response.status

    async def give_up() -> int:
        try:
            async with client.post(CHAT, json={**chat, "max_tokens": 40},
                                   timeout=aiohttp.ClientTimeout(total=0.05)) as response:
                await response.read()
                return response.status
        except asyncio.TimeoutError:
            return 0  # the client left: the server aborts the request

    async def post(body=None, data=None) -> int:
        response = await client.post(CHAT, json=body, data=data,
                                     headers=None if body is not None else {"Content-Type": "application/json"})
        await response.read()
        return response.status

    jobs = []
    for i in range(60):
        kind = i % 10
        if kind < 3:
            jobs.append(stream(None))
        elif kind < 5:
            jobs.append(stream(1 + i % 3))
        elif kind == 5:
            jobs.append(give_up())
        elif kind == 6:
            jobs.append(post({**chat, "messages": [{"role": "user", "content": "a " * 200_000}]}))  # > max_model_len
        elif kind == 7:
            jobs.append(post(data=[b"{", b'{"messages": 5}', b"\xff\xfe"][i % 3]))
        elif kind == 8:
            jobs.append(post({**chat, "structured_outputs": {"regex": PATHOLOGICAL, "backend": "outlines"}}))
        else:
            jobs.append(post({**chat, "structured_outputs": {"regex": "[0-9]{3}"}}))
    statuses = await asyncio.gather(*jobs)
    assert not [s for s in statuses if s >= 500], statuses
    assert statuses.count(200) >= 24  # every stream and every trivial grammar was served
    assert await pages_all_free(client.app)
    engine = client.app[ENGINE]
    assert engine.llm.runner.num_active_sequences == 0
    assert engine.llm.cache.num_free_slots == engine.llm.cache.num_slots
    assert (await client.get("/health")).status == 200
