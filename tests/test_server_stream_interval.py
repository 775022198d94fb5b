"""`--stream-interval N` (SGLang's): a stream's first token comes at once, then one chunk per N tokens, and the
end; the text is the same as with one chunk per token. And the chat routes' engine requests skip the engine's
detokenizer (`SamplingParams(detokenize=False)`): deepseek-recipe decodes the ids itself."""

from __future__ import annotations

import json

import pytest

from deepserve import SamplingParams
from deepserve.server import ServerConfig
from deepserve.server.state import ENGINE
from test_server import MODEL, USER, chat_dir, make_app, parse_sse  # noqa: F401 - fixtures

N = 4


def data_chunks(text: str) -> list[dict]:
    return [json.loads(data) for _, data in parse_sse(text) if data != "[DONE]"]


async def test_completions_stream_one_chunk_per_interval_with_the_same_text(aiohttp_client, chat_dir):
    client = await aiohttp_client(make_app(chat_dir, stream_interval=N))
    body = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 11, "temperature": 0, "ignore_eos": True,
            "logprobs": 0}
    whole = (await (await client.post("/v1/completions", json=body)).json())["choices"][0]
    r = await client.post("/v1/completions", json={**body, "stream": True})
    choices = [c["choices"][0] for c in data_chunks(await r.text())]
    sizes = [len(c["logprobs"]["tokens"]) for c in choices]
    assert sizes[0] == 1 and all(s >= 4 for s in sizes[1:-1]) and sum(sizes) == 11, sizes
    assert "".join(c["text"] for c in choices) == whole["text"]
    assert choices[-1]["finish_reason"] == "length"


async def test_chat_stream_with_an_interval_says_what_the_whole_response_says(aiohttp_client, chat_dir):
    client = await aiohttp_client(make_app(chat_dir, stream_interval=N))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello there 0"}], "max_tokens": 13,
            "temperature": 0}  # (the random model's greedy answer to it is text, not a tool call)
    whole = (await (await client.post("/v1/chat/completions", json=body)).json())
    r = await client.post("/v1/chat/completions", json={**body, "stream": True})
    chunks = data_chunks(await r.text())
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    streamed = "".join(d.get("content") or "" for d in deltas)
    assert streamed == whole["choices"][0]["message"]["content"] and streamed
    assert chunks[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"] == 13
    assert len(chunks) <= 3 + -(-12 // 4)  # the role, the first token, one per 4 tokens, the end


async def test_chat_requests_skip_the_engines_detokenizer(aiohttp_client, chat_dir):
    client = await aiohttp_client(make_app(chat_dir))
    core = client.app[ENGINE].engine
    seen, add = [], core.add_request
    core.add_request = lambda rid, ids, params, *a, **kw: seen.append(params.detokenize) or add(rid, ids, params,
                                                                                                  *a, **kw)
    r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "max_tokens": 3})
    assert r.status == 200 and (await r.json())["choices"][0]["message"]
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
    assert r.status == 200
    assert seen == [False, True]  # completions return the engine's text
    engine = client.app[ENGINE]
    outs = []
    for detokenize in (True, False):
        params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, detokenize=detokenize)
        async for out in engine.generate([5, 6, 7], params):
            pass
        outs.append(out.outputs[0])
    assert outs[0].token_ids == outs[1].token_ids and outs[0].text and outs[1].text == ""


def test_stream_interval_and_detokenize_are_validated():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="stream_interval"):
            ServerConfig(model="m", stream_interval=bad)
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)
