"""The HTTP server on a tiny random V4 checkpoint (CPU, fp32): every endpoint, streaming and not, through
`aiohttp_client`. The text is noise (random weights); the tests check the protocols, not the words."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from deepserve.core.hookspecs import hookimpl
from deepserve.core.plugins import make_plugin_manager
from deepserve.server import ENGINE, ServerConfig, create_app
from deepserve.server.completions import KNOWN_FIELDS
from deepserve.server.routes import ROUTES

MODEL = "tiny"
ENGINE_KWARGS = dict(dtype="float32", accelerator="cpu", max_model_len=1024, max_num_seqs=4, block_size=128)
USER = [{"role": "user", "content": "hi"}]


def build_chat_checkpoint(path: Path) -> Path:
    """The demo checkpoint: a random tiny V4 whose byte tokenizer also holds V4's chat special tokens."""
    from deepserve.tools.demo_checkpoint import build_demo_checkpoint

    return build_demo_checkpoint(path)


@pytest.fixture(scope="session")
def chat_dir(tmp_path_factory) -> Path:
    return build_chat_checkpoint(tmp_path_factory.mktemp("chat-v4"))


def make_app(model_dir: Path, plugins=(), engine=None, **options) -> web.Application:
    options.setdefault("default_thinking_mode", False)  # short prompts; one test turns it on
    config = ServerConfig(model=str(model_dir), served_model_name=MODEL,
                          engine_kwargs={**ENGINE_KWARGS, **(engine or {})}, **options)
    return create_app(config, plugin_manager=make_plugin_manager(load_entrypoints=False, plugins=plugins))


@pytest.fixture
async def client(aiohttp_client, chat_dir):
    return await aiohttp_client(make_app(chat_dir))


def parse_sse(text: str) -> list[tuple[str | None, str]]:
    """(event name, data) of each server-sent event."""
    events = []
    for block in text.strip().split("\n\n"):
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data.append(line[len("data: "):])
        events.append((name, "\n".join(data)))
    return events


async def pages_all_free(app: web.Application, timeout: float = 10.0) -> bool:
    engine = app[ENGINE]
    kv = engine.llm.kv_manager
    for _ in range(int(timeout / 0.02)):
        if engine.num_open_streams == 0 and kv.num_free_blocks == kv.pool.num_blocks \
                and not engine.engine.has_unfinished_requests():
            return True
        await asyncio.sleep(0.02)
    return False


def has_required(doc: dict, schema: str, body: dict) -> bool:
    """`body` carries every field the OpenAPI document's `schema` requires (a small schemathesis stand-in)."""
    return all(key in body for key in doc["components"]["schemas"][schema]["required"])


# -- OpenAI Chat Completions -----------------------------------------------------------------------------------------
async def test_chat_completion_reports_usage_and_length_finish(client):
    r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "max_tokens": 4})
    assert r.status == 200, await r.text()
    body = await r.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    assert body["choices"][0]["finish_reason"] == "length" and body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] == 4 and body["usage"]["prompt_tokens"] > 0
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    doc = await (await client.get("/openapi.json")).json()
    assert has_required(doc, "ChatCompletion", body)


async def test_chat_stream_is_sse_with_usage_and_done(client):
    r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "max_tokens": 5,
                                                         "stream": True, "stream_options": {"include_usage": True}})
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    events = parse_sse(await r.text())
    assert events[-1] == (None, "[DONE]")
    chunks = [json.loads(data) for _, data in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["usage"]["completion_tokens"] == 5
    assert all(c["usage"] is None for c in chunks[:-1])


async def test_repeated_prompt_reports_cached_tokens(client):
    long = [{"role": "user", "content": "the same long question " * 20}]  # > one 128-token page
    usages = []
    for _ in range(2):
        r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": long, "max_tokens": 2})
        usages.append((await r.json())["usage"])
    assert usages[0]["prompt_tokens_details"]["cached_tokens"] == 0
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] >= 128


async def test_thinking_mode_streams_reasoning_content(aiohttp_client, chat_dir):
    client = await aiohttp_client(make_app(chat_dir, default_thinking_mode=True))
    r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "max_tokens": 3})
    message = (await r.json())["choices"][0]["message"]
    assert "reasoning_content" in message  # the random model never closes </think>: all of it is reasoning


def unique_pair(text: str) -> str | None:
    """A two-character piece of `text`, past its start, that occurs there first."""
    return next((text[i:i + 2] for i in range(3, len(text) - 2)
                 if text[i:i + 2].isprintable() and text.find(text[i:i + 2]) == i), None)


async def test_stop_sequence_cuts_the_text_and_frees_the_request(client):
    for seed in range(10):  # a seed whose 12 tokens make enough text (the random model may say EOS early)
        body = {"model": MODEL, "messages": USER, "max_tokens": 12, "seed": seed}
        choice = (await (await client.post("/v1/chat/completions", json=body)).json())["choices"][0]
        text, stop = choice["message"]["content"], unique_pair(choice["message"]["content"])
        if choice["finish_reason"] == "length" and stop:
            break
    r = await client.post("/v1/chat/completions", json={**body, "stop": [stop], "max_tokens": 200})
    choice = (await r.json())["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == text[: text.index(stop)]
    assert await pages_all_free(client.app)  # the engine request was aborted when the stop sequence ended it


async def test_chat_logprobs(client):
    r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "max_tokens": 3,
                                                         "logprobs": True, "top_logprobs": 2})
    content = (await r.json())["choices"][0]["logprobs"]["content"]
    assert 1 <= len(content) <= 3  # special tokens the random model samples are markup, not text tokens
    assert all(len(t["top_logprobs"]) == 2 and t["logprob"] <= 0 for t in content)


# -- OpenAI Responses and Anthropic Messages -------------------------------------------------------------------------
async def test_responses_non_streaming_and_streaming(client):
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 3}
    r = await client.post("/v1/responses", json=body)
    response = await r.json()
    assert r.status == 200 and response["object"] == "response" and response["status"] == "incomplete"
    assert response["usage"]["input_tokens"] > 0
    r = await client.post("/v1/responses", json={**body, "stream": True})
    names = [name for name, _ in parse_sse(await r.text())]
    assert names[0] == "response.created" and names[-1] == "response.incomplete"
    assert "response.output_text.delta" in names


async def test_messages_non_streaming_and_streaming(client):
    body = {"model": MODEL, "messages": USER, "max_tokens": 3}
    r = await client.post("/v1/messages", json=body)
    message = await r.json()
    assert r.status == 200 and message["type"] == "message" and message["stop_reason"] == "max_tokens"
    assert 1 <= message["usage"]["output_tokens"] <= 3 and "cache_read_input_tokens" in message["usage"]
    r = await client.post("/v1/messages", json={**body, "stream": True, "top_k": 5})
    events = parse_sse(await r.text())
    assert [n for n, _ in events][0] == "message_start" and events[-1][0] == "message_stop"
    assert all(json.loads(data)["type"] == name for name, data in events)


# -- OpenAI text completions -----------------------------------------------------------------------------------------
async def test_completions_with_text_and_token_prompts(client):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 4, "logprobs": 2,
                                                    "ignore_eos": True})
    body = await r.json()
    assert r.status == 200 and body["object"] == "text_completion"
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    logprobs = body["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == 4 and all(len(top) <= 2 for top in logprobs["top_logprobs"])
    ids = [18 + ord(c) for c in "ABC"]  # the byte tokenizer: BOS, EOS, 16 chat special tokens, then the 256 bytes
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 3, "echo": True})
    choice = (await r.json())["choices"][0]
    assert choice["text"].startswith("ABC")


async def test_completions_stream_matches_non_stream_and_ends_with_usage(client):
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 6, "seed": 1, "ignore_eos": True}
    whole = (await (await client.post("/v1/completions", json=body)).json())["choices"][0]["text"]
    r = await client.post("/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
    events = parse_sse(await r.text())
    assert events[-1] == (None, "[DONE]")
    chunks = [json.loads(d) for _, d in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == whole
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


async def test_completions_stop_string(client):
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 12, "seed": 3, "ignore_eos": True}
    text = (await (await client.post("/v1/completions", json=body)).json())["choices"][0]["text"]
    stop = unique_pair(text)
    for stream in (False, True):
        r = await client.post("/v1/completions", json={**body, "stop": stop, "stream": stream})
        if stream:
            chunks = [json.loads(d) for _, d in parse_sse(await r.text())[:-1]]
            got, reason = "".join(c["choices"][0]["text"] for c in chunks), chunks[-1]["choices"][0]["finish_reason"]
        else:
            choice = (await r.json())["choices"][0]
            got, reason = choice["text"], choice["finish_reason"]
        assert (got, reason) == (text[: text.index(stop)], "stop")


# -- models, health, metrics, openapi, plugins -----------------------------------------------------------------------
async def test_models_and_health(client):
    models = await (await client.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == [MODEL] and models["data"][0]["max_model_len"] == 1024
    assert (await (await client.get(f"/v1/models/{MODEL}")).json())["id"] == MODEL
    r = await client.get("/v1/models/other")
    assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
    health = await client.get("/health")
    assert health.status == 200 and (await health.json())["status"] == "ok"


async def test_metrics_count_tokens_requests_and_latencies(client):
    await client.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 200, "max_tokens": 3})
    await client.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 200, "max_tokens": 3})
    r = await client.get("/metrics")
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(await r.text()) for s in family.samples}
    value = lambda name, **labels: samples[(name, tuple(sorted(labels.items())))]  # noqa: E731
    assert value("deepserve_requests_finished_total", reason="length") == 2
    assert value("deepserve_generation_tokens_total") == 6
    assert value("deepserve_prompt_tokens_total") > 200  # the second prompt hit the prefix cache
    assert value("deepserve_prefix_cache_queries_total") == 400 and value("deepserve_prefix_cache_hits_total") >= 128
    assert value("deepserve_time_to_first_token_seconds_count") == 2
    assert value("deepserve_inter_token_latency_seconds_count") == 4
    assert value("deepserve_e2e_request_latency_seconds_count") == 2
    assert value("deepserve_num_requests_running") == 0 and value("deepserve_num_requests_waiting") == 0
    assert value("deepserve_kv_cache_pages_used") == 0 and value("deepserve_kv_cache_pages_total") > 0


class HelloRoutes:
    """A route plugin, registered through the real plugin manager."""

    @hookimpl
    def deepserve_register_routes(self, register):
        async def hello(request: web.Request) -> web.Response:
            return web.json_response({"hello": request.app[ENGINE].num_open_streams})

        register("hello", lambda app: app.router.add_get("/v1/hello", hello, allow_head=False))


async def test_route_plugin_is_served_documented_and_guarded(aiohttp_client, chat_dir):
    client = await aiohttp_client(make_app(chat_dir, plugins=[HelloRoutes()], api_key="k"))
    assert (await client.get("/v1/hello")).status == 401
    r = await client.get("/v1/hello", headers={"Authorization": "Bearer k"})
    assert r.status == 200 and await r.json() == {"hello": 0}
    doc = await (await client.get("/openapi.json")).json()
    assert "hello" in doc["paths"]["/v1/hello"]["get"]["summary"]


def resolve_refs(node, doc) -> None:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if ref is not None:
            target = doc
            for part in ref.removeprefix("#/").split("/"):
                target = target[part]
        for value in node.values():
            resolve_refs(value, doc)
    elif isinstance(node, list):
        for value in node:
            resolve_refs(value, doc)


async def test_openapi_documents_exactly_the_routes_served(client):
    doc = await (await client.get("/openapi.json")).json()
    assert doc["openapi"] == "3.1.0" and doc["info"]["title"] == "deepserve"
    served = {(r.method.lower(), r.resource.canonical) for r in client.app.router.routes()}
    documented = {(method, path) for path, ops in doc["paths"].items() for method in ops}
    assert served == documented == {(r.method.lower(), r.path) for r in ROUTES}
    resolve_refs(doc, doc)  # every $ref points somewhere
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            assert op["responses"] and all(code.isdigit() or code == "default" for code in op["responses"])
            if "{" in path:
                assert {p["name"] for p in op["parameters"]} == {"model_id"}
            if method == "post":  # generation routes are admission-gated (429); /tokenize, /detokenize are not
                assert {"200", "400", "404", "413"} | ({"429"} if path.startswith("/v1/") else set()) \
                    <= set(op["responses"])
    assert "securitySchemes" not in doc["components"]  # no key configured: no security claimed
    completion = doc["components"]["schemas"]["CompletionRequest"]
    assert set(completion["properties"]) == KNOWN_FIELDS and completion["additionalProperties"] is False
