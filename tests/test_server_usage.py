"""Usage that adds up and metrics that scrape as vLLM's do (issue 25, item 7): output counts from the engine's
token ids, `reasoning_tokens` never above `completion_tokens`, `HEAD` on `/health` and `/metrics`, the engine's
metrics also under vLLM's `vllm:` names."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

import deepserve
from deepserve.server.recipe import CHAT
from deepserve.server.state import ENGINE, MODEL as MODEL_INFO, RECIPE
from test_server import MODEL, USER, chat_dir, client, make_app, parse_sse  # noqa: F401 - fixtures

EMBEDDED = Path(deepserve.__file__).parent / "assets" / "deepserve-tiny-v4"
#: a request in the shape the embedded model was trained on, whose reasoning it ends with </think> within the tests'
#: max_tokens (greedy and at the seed the test samples with)
TRAINED_ASK = [{"role": "user", "content": "Write a Python function `greet(name)`.\n\nReturn a greeting for name."}]


async def scrape(client) -> dict[tuple[str, tuple], float]:
    text = await (await client.get("/metrics")).text()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def settled(client, name: str, value: float, tries: int = 500) -> dict[tuple[str, tuple], float]:
    """A scrape once the engine's snapshot shows `name` at `value` (the engine publishes its snapshot after it
    hands out a step's outputs, so a scrape right after an answer may miss that step: a race in the engine)."""
    for _ in range(tries):
        samples = await scrape(client)
        if samples.get((name, ())) == value:
            return samples
        await asyncio.sleep(0.01)
    return samples


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


async def test_usage_without_thinking_says_zero_reasoning_tokens(client):
    """OpenAI's usages always carry `reasoning_tokens` (the openai SDK's users read
    `usage.completion_tokens_details.reasoning_tokens` unguarded); the recipe left the object out without
    thinking (the server's default). Anthropic's usage has no such field and gets none."""
    for stream in (False, True):
        r = await client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": USER, "max_tokens": 3,
            **({"stream": True, "stream_options": {"include_usage": True}} if stream else {})})
        usage = json.loads(parse_sse(await r.text())[-2][1])["usage"] if stream else (await r.json())["usage"]
        assert usage["completion_tokens_details"] == {"reasoning_tokens": 0}, (stream, usage)
    answer = await (await client.post("/v1/responses", json={"model": MODEL, "input": "hi",
                                                             "max_output_tokens": 3})).json()
    assert answer["usage"]["output_tokens_details"]["reasoning_tokens"] == 0, answer["usage"]
    n2 = await (await client.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "max_tokens": 2,
                                                                "n": 2})).json()
    assert n2["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}, n2["usage"]
    message = await (await client.post("/v1/messages", json={"model": MODEL, "messages": USER,
                                                             "max_tokens": 3})).json()
    assert "output_tokens_details" not in message["usage"], message["usage"]


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


async def test_head_on_health_and_metrics(client):
    for path in ("/health", "/metrics"):
        r = await client.head(path)
        assert r.status == 200 and await r.read() == b"", path
    doc = await (await client.get("/openapi.json")).json()
    assert "head" in doc["paths"]["/health"] and "head" in doc["paths"]["/metrics"]


async def test_metrics_under_vllm_names(client):
    for _ in range(2):
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 200, "max_tokens": 3,
                                                        "ignore_eos": True})
        assert r.status == 200
    samples = await settled(client, "deepserve_generation_tokens_total", 6)
    ours = {name: value for (name, labels), value in samples.items() if not labels}
    vllm = {name: value for (name, labels), value in samples.items()
            if labels in ((("model_name", MODEL),), (("engine", "0"), ("model_name", MODEL)))}  # one engine: "0"
    assert vllm["vllm:generation_tokens_total"] == ours["deepserve_generation_tokens_total"] == 6
    assert vllm["vllm:prompt_tokens_total"] == 400  # both prompts, the prefix-cache hits included
    assert vllm["vllm:prefix_cache_queries_total"] == ours["deepserve_prefix_cache_queries_total"] == 400
    assert vllm["vllm:prefix_cache_hits_total"] == ours["deepserve_prefix_cache_hits_total"] >= 128
    assert vllm["vllm:num_requests_running"] == vllm["vllm:num_requests_waiting"] == 0
    assert vllm["vllm:kv_cache_usage_perc"] == 0.0
    assert vllm["vllm:time_to_first_token_seconds_count"] == ours["deepserve_time_to_first_token_seconds_count"] == 2
    assert vllm["vllm:e2e_request_latency_seconds_count"] == 2
    assert samples[("vllm:request_success_total", (("finished_reason", "length"), ("model_name", MODEL)))] == 2
