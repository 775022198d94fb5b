"""Sampling options clients send (issue 25, item 5) through the HTTP routes: `n` > 1 fanned out by the server,
the penalties, `logit_bias` and `bad_words`, and each choice counted against the 429 bound."""

from __future__ import annotations

import json

from deepserve.server.state import ADMISSION, ENGINE, MODEL as MODEL_INFO
from test_server import MODEL, USER, chat_dir, client, make_app, pages_all_free, parse_sse  # noqa: F401 - fixtures

PROMPT = "the cat sat on the mat and the dog sat on the log " * 12  # > one 128-token page of the byte tokenizer


async def post(client, path, **body):
    r = await client.post(path, json={"model": MODEL, **body})
    data = await r.json()
    return r.status, data


async def test_completions_n_gives_n_seeded_choices_per_prompt_and_usage_counts_the_prompt_once(client):
    body = dict(prompt=[PROMPT, "hello"], max_tokens=5, n=3, seed=11, temperature=1.0, ignore_eos=True)
    status, data = await post(client, "/v1/completions", **body)
    assert status == 200, data
    choices = data["choices"]
    assert [c["index"] for c in choices] == list(range(6))
    texts = [c["text"] for c in choices]
    assert len(set(texts[:3])) > 1  # the siblings sample with seed, seed + 1, seed + 2
    for j in range(3):  # choice j of a prompt is what seed + j gives alone
        _, alone = await post(client, "/v1/completions", prompt=PROMPT, max_tokens=5, seed=11 + j,
                              temperature=1.0, ignore_eos=True)
        assert alone["choices"][0]["text"] == texts[j]
    encode = client.app[MODEL_INFO].encoder.encode
    prompt_tokens = len(encode(PROMPT)) + len(encode("hello"))
    usage = data["usage"]
    assert usage["prompt_tokens"] == prompt_tokens and usage["completion_tokens"] == 6 * 5
    assert await pages_all_free(client.app)


async def test_completions_n_siblings_share_the_prompts_pages(client):
    before = client.app[ENGINE].snapshot()
    status, data = await post(client, "/v1/completions", prompt=PROMPT + "unique", max_tokens=2, n=4,
                              temperature=0.7)
    assert status == 200, data
    after = client.app[ENGINE].snapshot()
    # the three siblings found the first choice's full prompt pages in the prefix cache
    assert after.num_prefix_hits - before.num_prefix_hits >= 3 * 128


async def test_chat_n_returns_n_choices_streaming_and_not(client):
    body = dict(messages=USER, max_tokens=4, n=2, seed=5, temperature=1.0)
    status, data = await post(client, "/v1/chat/completions", **body)
    assert status == 200, data
    assert [c["index"] for c in data["choices"]] == [0, 1]
    assert 2 <= data["usage"]["completion_tokens"] <= 2 * 4
    r = await client.post("/v1/chat/completions", json={"model": MODEL, **body, "stream": True,
                                                         "stream_options": {"include_usage": True}})
    assert r.status == 200
    events = parse_sse(await r.text())
    assert events[-1] == (None, "[DONE]")
    chunks = [json.loads(d) for _, d in events[:-1]]
    text = {0: "", 1: ""}
    for chunk in chunks[:-1]:
        for choice in chunk["choices"]:
            text[choice["index"]] += choice["delta"].get("content") or ""
    assert [text[0], text[1]] == [c["message"]["content"] for c in data["choices"]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == data["usage"]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    assert await pages_all_free(client.app)


async def test_logit_bias_and_bad_words_on_completions_and_chat(client):
    tok = client.app[MODEL_INFO].tokenizer
    forced = tok.encode("z")[0]
    status, data = await post(client, "/v1/completions", prompt="hi", max_tokens=4, temperature=0,
                              logit_bias={str(forced): 100}, ignore_eos=True)
    assert status == 200, data
    assert data["choices"][0]["text"] == "zzzz"
    status, data = await post(client, "/v1/chat/completions", messages=USER, max_tokens=4, temperature=0,
                              logit_bias={str(forced): 100})
    assert status == 200, data
    assert data["choices"][0]["message"]["content"] == "zzzz"
    status, data = await post(client, "/v1/completions", prompt="hi", max_tokens=4, temperature=0,
                              logit_bias={str(forced): 100}, bad_words=["z"], ignore_eos=True)
    assert status == 200 and "z" not in data["choices"][0]["text"], data


async def test_penalties_change_a_greedy_answer_and_bad_values_are_named(client):
    base = dict(prompt=PROMPT, max_tokens=24, temperature=0, ignore_eos=True)
    _, plain = await post(client, "/v1/completions", **base)
    _, penalized = await post(client, "/v1/completions", **base, presence_penalty=2.0, frequency_penalty=2.0,
                              repetition_penalty=1.5)
    assert plain["choices"][0]["text"] != penalized["choices"][0]["text"]
    _, again = await post(client, "/v1/completions", **base, presence_penalty=2.0, frequency_penalty=2.0,
                          repetition_penalty=1.5)
    assert again["choices"][0]["text"] == penalized["choices"][0]["text"]
    vocab = client.app[MODEL_INFO].vocab_size
    for path, extra in (("/v1/completions", dict(prompt="hi")), ("/v1/chat/completions", dict(messages=USER))):
        for field, value in (("presence_penalty", 3), ("frequency_penalty", "x"), ("repetition_penalty", 0),
                             ("logit_bias", {"a": 1}), ("logit_bias", {str(vocab): 1}), ("logit_bias", {"1": 500}),
                             ("bad_words", [""]), ("n", 0), ("n", 1000)):
            status, data = await post(client, path, **extra, max_tokens=2, **{field: value})
            assert status == 400 and data["error"]["param"] == field, (path, field, value, data)


async def test_each_choice_counts_against_the_admission_bound(aiohttp_client, chat_dir):  # noqa: F811
    app = make_app(chat_dir, max_waiting_requests=0)
    client = await aiohttp_client(app)
    capacity = app[ADMISSION].capacity
    status, data = await post(client, "/v1/completions", prompt=["a"] * (capacity + 1), max_tokens=1)
    assert status == 400 and "split" in data["error"]["message"], data
    status, data = await post(client, "/v1/completions", prompt="a", n=capacity + 1, max_tokens=1)
    assert status == 400 and data["error"]["param"] == "n", data
    status, data = await post(client, "/v1/completions", prompt=["a"] * capacity, max_tokens=1)
    assert status == 200 and len(data["choices"]) == capacity
    assert app[ADMISSION].num_open == 0
