"""Usage that adds up and metrics that scrape as vLLM's do (issue 25, item 7): output counts from the engine's
token ids, `reasoning_tokens` never above `completion_tokens`, `HEAD` on `/health` and `/metrics`, the engine's
metrics also under vLLM's `vllm:` names."""

from __future__ import annotations

import json
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

import deepserve
from deepserve.server.recipe import CHAT
from deepserve.server.state import ENGINE, MODEL as MODEL_INFO, RECIPE
from test_server import MODEL, USER, chat_dir, client, make_app, parse_sse  # noqa: F401 - fixtures

EMBEDDED = Path(deepserve.__file__).parent / "assets" / "deepserve-tiny-v4"
#: a prompt in the shape the embedded model was trained on: its greedy reasoning ends with </think> soon
TRAINED_ASK = [{"role": "user", "content": "Write a Python function `add(a, b)`.\n\nReturn the sum of a and b."}]


async def scrape(client) -> dict[tuple[str, tuple], float]:
    text = await (await client.get("/metrics")).text()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def engine_tokens(app, body: dict) -> list[int]:
    """The output the engine generates for a chat body, run on the engine directly."""
    prepared = app[RECIPE].prepare(CHAT, json.dumps(body).encode(), body, app[MODEL_INFO])
    prepared.processor.close()
    async for out in app[ENGINE].generate(prepared.prompt_token_ids, prepared.params):
        ids = list(out.outputs[0].token_ids)
    return ids


async def test_usage_counts_every_token_the_engine_generated(client):
    """The recipe counted decoded text: a final token ending inside a UTF-8 character was left out."""
    for max_tokens in range(1, 9):
        body = {"model": MODEL, "messages": USER, "temperature": 0, "max_tokens": max_tokens}
        usage = (await (await client.post("/v1/chat/completions", json=body)).json())["usage"]
        assert usage["completion_tokens"] == len(await engine_tokens(client.app, body)), (max_tokens, usage)
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


async def test_reasoning_tokens_never_exceed_the_output(aiohttp_client, chat_dir):
    """The random model never closes </think>: every output token is reasoning, no more (the recipe, counting the
    reasoning text, reported more reasoning tokens than output tokens)."""
    client = await aiohttp_client(make_app(chat_dir, default_thinking_mode=True))
    for seed in range(6):
        for path, body in (("/v1/chat/completions", {"messages": USER, "max_tokens": 12}),
                           ("/v1/responses", {"input": "hi", "max_output_tokens": 12})):
            r = await client.post(path, json={"model": MODEL, "seed": seed, **body})
            answer = await r.json()
            usage = answer["usage"]
            output, details = ("completion_tokens", "completion_tokens_details") if "choices" in answer \
                else ("output_tokens", "output_tokens_details")
            assert usage[output] == 12 and usage[details]["reasoning_tokens"] == 12, (path, seed, usage)


async def test_reasoning_tokens_end_at_the_end_of_thinking(aiohttp_client):
    """The embedded model closes its reasoning: reasoning tokens are the output tokens before </think>, as the
    engine generated them for the same prompt and parameters."""
    client = await aiohttp_client(make_app(EMBEDDED, default_thinking_mode=True))
    body = {"model": MODEL, "messages": TRAINED_ASK, "max_tokens": 80, "seed": 0}  # thinking: temperature 1
    ids = await engine_tokens(client.app, body)
    expected = (ids.index(client.app[RECIPE].thinking_end_ids[0]), len(ids))
    for stream in (False, True):
        r = await client.post("/v1/chat/completions", json={**body, "stream": stream})
        if stream:
            usage = json.loads(parse_sse(await r.text())[-2][1])["usage"]
        else:
            answer = await r.json()
            assert answer["choices"][0]["message"]["content"], answer  # the reasoning ended
            usage = answer["usage"]
        assert (usage["completion_tokens_details"]["reasoning_tokens"], usage["completion_tokens"]) == expected
