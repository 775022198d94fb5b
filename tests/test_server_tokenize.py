"""vLLM's `/tokenize` and `/detokenize` (issue 25, item 5): a prompt's ids are the ones `/v1/completions` reads,
a chat's the ones `/v1/chat/completions` sends to the engine, and detokenizing gives the text back."""

from __future__ import annotations

from deepserve.server.state import MODEL as MODEL_INFO
from test_server import MODEL, USER, chat_dir, client  # noqa: F401 - fixtures


async def test_a_prompt_round_trips_and_matches_completions_usage(client):
    text = "the cat sat on the mat <｜User｜> hi"
    r = await client.post("/tokenize", json={"model": MODEL, "prompt": text, "return_token_strs": True})
    body = await r.json()
    assert r.status == 200, body
    assert body["tokens"] == client.app[MODEL_INFO].encoder.encode(text)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == client.app[MODEL_INFO].max_model_len
    assert len(body["token_strs"]) == body["count"]
    usage = (await (await client.post("/v1/completions", json={"model": MODEL, "prompt": text,
                                                                "max_tokens": 1})).json())["usage"]
    assert usage["prompt_tokens"] == body["count"]
    back = await (await client.post("/detokenize", json={"tokens": body["tokens"]})).json()
    assert back["prompt"] == text


async def test_a_chat_counts_what_chat_completions_sends(client):
    r = await client.post("/tokenize", json={"messages": USER})
    body = await r.json()
    assert r.status == 200, body and "token_strs" not in body
    usage = (await (await client.post("/v1/chat/completions", json={"model": MODEL, "messages": USER,
                                                                     "max_tokens": 1})).json())["usage"]
    assert usage["prompt_tokens"] == body["count"]


async def test_bad_requests_are_named(client):
    vocab = client.app[MODEL_INFO].vocab_size
    for path, body, param in (("/tokenize", {"prompt": 5}, "prompt"), ("/tokenize", {}, "prompt"),
                              ("/tokenize", {"prompt": "a", "messages": USER}, "prompt"),
                              ("/tokenize", {"prompt": "a", "extra": 1}, "extra"),
                              ("/detokenize", {"tokens": [vocab]}, "tokens"), ("/detokenize", {"tokens": "a"}, "tokens"),
                              ("/detokenize", {"tokens": [1], "model": "other"}, "model")):
        r = await client.post(path, json=body)
        data = await r.json()
        assert r.status in (400, 404) and data["error"]["param"] == param, (path, body, data)
