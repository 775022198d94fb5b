"""`/v1/completions` as lm-eval's `local-completions` uses it (issue 25, item 2): `echo` with `logprobs` returns the
prompt's logprobs before the output's, and `max_tokens: 0` with `echo` the prompt alone with its logprobs (a
loglikelihood request). Checked against the engine's own prompt logprobs (`SamplingParams.prompt_logprobs`)."""

from __future__ import annotations

import asyncio
import json
import math

from deepserve import SamplingParams
from deepserve.server.state import ENGINE
from test_server import MODEL, chat_dir, client, parse_sse  # noqa: F401 - fixtures

PROMPT = "the cat sat on the mat"


async def engine_prompt_logprobs(app, ids: list[int]) -> list[float | None]:
    async for out in app[ENGINE].generate(ids, SamplingParams(max_tokens=1, prompt_logprobs=1), cache_salt="ref"):
        final = out
    return [None] + [final.prompt_logprobs[i][t].logprob for i, t in enumerate(ids) if i > 0]


async def test_echo_with_logprobs_returns_the_prompts_logprobs_then_the_outputs(client):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "echo": True,
                                                    "logprobs": 2, "temperature": 0, "ignore_eos": True})
    body = await r.json()
    assert r.status == 200, body
    choice, usage = body["choices"][0], body["usage"]
    logprobs = choice["logprobs"]
    assert choice["text"].startswith(PROMPT) and usage["completion_tokens"] == 3
    n = usage["prompt_tokens"]
    assert len(logprobs["tokens"]) == n + 3 and "".join(logprobs["tokens"][:n]) == PROMPT
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert all(lp <= 0 for lp in logprobs["token_logprobs"][1:])
    assert all(len(top) <= 2 for top in logprobs["top_logprobs"][1:])
    assert logprobs["text_offset"][n] == len(PROMPT)  # the output's offsets follow the echoed prompt


async def test_max_tokens_0_with_echo_is_the_prompt_and_its_logprobs(client):
    """lm-eval's loglikelihood: the sum of the continuation's logprobs, with no output; twice, to see that a
    prefix-cache hit does not leave holes."""
    ids = [18 + b for b in PROMPT.encode()]  # the byte tokenizer: BOS, EOS, 16 chat special tokens, the bytes
    expected = await engine_prompt_logprobs(client.app, ids)
    for stream in (False, True, False):
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 0,
                                                        "echo": True, "logprobs": 1, "stream": stream})
        assert r.status == 200, await r.text()
        if stream:
            chunks = [json.loads(d) for _, d in parse_sse(await r.text())[:-1]]
            (choice,) = [c["choices"][0] for c in chunks if c["choices"]]
        else:
            body = await r.json()
            (choice,) = body["choices"]
            assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == len(ids)
        assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
        got = choice["logprobs"]["token_logprobs"]
        assert got[0] is None and len(got) == len(ids)
        assert all(math.isclose(g, e, abs_tol=1e-5) for g, e in zip(got[1:], expected[1:])), (got, expected)


async def test_max_tokens_0_without_echo_is_refused(client):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 0})
    body = await r.json()
    assert r.status == 400 and body["error"]["param"] == "max_tokens", body


# -- several prompts in one request ----------------------------------------------------------------------------------
async def test_several_prompts_are_choices_in_order_equal_to_single_requests(client):
    prompts = ["abc", "hello there", [18 + ord(c) for c in "XYZ"]]
    base = {"model": MODEL, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    alone = []
    for prompt in prompts:
        body = await (await client.post("/v1/completions", json={**base, "prompt": prompt})).json()
        alone.append((body["choices"][0]["text"], body["usage"]))
    r = await client.post("/v1/completions", json={**base, "prompt": prompts})
    body = await r.json()
    assert r.status == 200, body
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["text"] for c in body["choices"]] == [text for text, _ in alone]
    assert body["usage"]["prompt_tokens"] == sum(u["prompt_tokens"] for _, u in alone)
    assert body["usage"]["completion_tokens"] == 12
    # streamed: each choice's deltas, by index, add up to its text; each choice finishes once
    r = await client.post("/v1/completions", json={**base, "prompt": prompts, "stream": True, "echo": True})
    chunks = [json.loads(d) for _, d in parse_sse(await r.text())[:-1]]
    texts, finishes = {}, {}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"]:
            finishes[choice["index"]] = finishes.get(choice["index"], 0) + 1
    echoed = ["abc", "hello there", "XYZ"]
    assert texts == {i: echoed[i] + alone[i][0] for i in range(3)} and finishes == {0: 1, 1: 1, 2: 1}


async def test_a_bad_prompt_in_a_batch_is_named(client):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": ["ok", [1, "x"]], "max_tokens": 2})
    body = await r.json()
    assert r.status == 400 and body["error"]["param"] == "prompt[1]", body
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": ["x"] * 65, "max_tokens": 2})
    assert r.status == 400 and (await r.json())["error"]["param"] == "prompt"


async def test_the_shutdown_aborts_every_prompt_of_a_batch(aiohttp_client, chat_dir):  # noqa: F811
    from test_server_shutdown import StepGate, read_first_event, until

    from deepserve.server import ADMISSION
    from test_server import make_app

    client = await aiohttp_client(make_app(chat_dir, drain_timeout=0))
    app, gate = client.app, StepGate(client.app)
    aborted, abort = [], app[ENGINE].abort
    app[ENGINE].abort = lambda request_id: (aborted.append(request_id), abort(request_id))[1]
    response = await client.post("/v1/completions", json={"model": MODEL, "prompt": ["hi", "yo"], "max_tokens": 200,
                                                           "ignore_eos": True, "stream": True})
    first = await read_first_event(response)
    gate.close()
    await asyncio.to_thread(gate.holding.wait, 30)
    closing = asyncio.create_task(client.server.close())
    await until(lambda: app[ADMISSION].aborting, "the drain timed out and aborted")
    gate.opened.set()
    rest = (await response.read()).decode()
    await closing
    name, data = parse_sse(first + "\n" + rest)[-1]
    assert json.loads(data)["error"]["code"] == "server_shutting_down"
    assert len(aborted) == 2 and len(set(aborted)) == 2, aborted
