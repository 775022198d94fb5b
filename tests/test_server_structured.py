"""Structured output over HTTP (issue 6, items 4-5), on the demo checkpoint (byte tokens: one token per character):
OpenAI `response_format`, the `structured_outputs` field and vLLM's `guided_*` fields on chat and completions,
Responses `text.format` and Anthropic `output_format` (streaming and not) give outputs that satisfy their
constraint; every way a constraint can fail is a 4xx naming the problem, in each protocol's error JSON or as an
error event; the OpenAPI document accepts the bodies used here. Constraints are bounded (enums, small ranges,
fixed-length regexes) so that the random model always finishes within a few tokens."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import pytest

import deepserve
from deepserve.core.hookspecs import hookimpl
from deepserve.core.plugins import collect_registrations, make_plugin_manager
from deepserve.core.grammar_compiler import GrammarCompiler
from deepserve.core.structured import GrammarBackend
from deepserve.server import ENGINE, ServerConfig
from fake_grammar import dead_end_backend
from test_server import MODEL, chat_dir, make_app, pages_all_free, parse_sse  # noqa: F401 - fixtures

jsonschema = pytest.importorskip("jsonschema")
lark = pytest.importorskip("lark")

ASK = [{"role": "user", "content": "answer in json"}]  # OpenAI's json_object needs the word in the prompt
POINT = {"type": "object", "additionalProperties": False, "required": ["n", "ok"], "properties": {
    "n": {"type": "integer", "minimum": 1, "maximum": 9}, "ok": {"type": "boolean"}}}
COLOR = {"type": "object", "additionalProperties": False, "required": ["c"], "properties": {
    "c": {"type": "string", "enum": ["red", "blue"]}}}
REGEX = r"\d{2}-[a-z]{2}"
CHOICES = ["red", "green", "blue"]
GBNF = 'root ::= "x=" [0-9] ";"'
LARK = 'start: "(" NAME ")"\nNAME: /[a-z]{2}/'


class SlowBackend(GrammarBackend):
    """Compiles nothing until the test lets it (a compile past the timeout)."""

    name = "slow"

    def __init__(self, tokenizer, gate: threading.Event) -> None:
        self.gate = gate

    def compile(self, spec):
        self.gate.wait(60)
        return spec

    def new_matcher(self, compiled):  # pragma: no cover - never reached: the request is refused first
        raise AssertionError("a request whose compile timed out must not run")

    def allocate_bitmask(self, num_rows):  # pragma: no cover
        raise AssertionError("a request whose compile timed out must not run")


DeadEndBackend = dead_end_backend("ok")


@pytest.fixture
def gate():
    gate = threading.Event()
    yield gate
    gate.set()


@pytest.fixture
async def client(aiohttp_client, chat_dir, gate):  # noqa: F811
    """The server (its compile timeout set through the server option) whose engine's grammar compiler also has two
    test backends, registered through `deepserve_register_grammar_backends` as any plugin's would be."""

    class TestBackends:
        @hookimpl
        def deepserve_register_grammar_backends(self, register):
            register("slow", lambda tokenizer: SlowBackend(tokenizer, gate))
            register("dead-end", DeadEndBackend)

    client = await aiohttp_client(make_app(chat_dir, grammar_compile_timeout=5.0,
                                           structured_outputs_backend="llguidance"))
    engine = client.app[ENGINE].engine
    builtin = engine.grammars
    pm = make_plugin_manager(load_entrypoints=False, plugins=[TestBackends()])
    engine.grammars = GrammarCompiler(collect_registrations(pm, "deepserve_register_grammar_backends"),
                                      builtin.tokenizer, builtin.default_backend, builtin.timeout)
    builtin.shutdown()
    return client


def check(constraint: dict, text: str) -> None:
    """`text` satisfies the `structured_outputs`-style `constraint`."""
    if "json" in constraint:
        jsonschema.validate(json.loads(text), constraint["json"])
    elif "json_object" in constraint:
        assert isinstance(json.loads(text), dict), text
    elif "regex" in constraint:
        assert re.fullmatch(constraint["regex"], text), (constraint["regex"], text)
    elif "choice" in constraint:
        assert text in constraint["choice"], text
    elif constraint["grammar"] == GBNF:
        assert re.fullmatch(r"x=[0-9];", text), text
    else:
        lark.Lark(constraint["grammar"]).parse(text)


def request_schema(doc: dict, name: str):
    """A validator for one request schema of the server's own OpenAPI document (3.1: JSON Schema 2020-12)."""
    return jsonschema.Draft202012Validator(doc["components"]["schemas"][name])


async def chat_text(client, body: dict, stream: bool) -> tuple[str, str]:
    """(content, finish_reason) of a chat completion, streamed or not."""
    r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 40,
                                                         "temperature": 0, "stream": stream, **body})
    assert r.status == 200, await r.text()
    if not stream:
        choice = (await r.json())["choices"][0]
        return choice["message"]["content"], choice["finish_reason"]
    events = parse_sse(await r.text())
    assert events[-1] == (None, "[DONE]")
    chunks = [json.loads(data)["choices"] for _, data in events[:-1]]
    text = "".join(c[0]["delta"].get("content") or "" for c in chunks if c)
    return text, [c[0]["finish_reason"] for c in chunks if c and c[0]["finish_reason"]][-1]


async def completion_text(client, body: dict, stream: bool) -> tuple[str, str]:
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "json:", "max_tokens": 40,
                                                    "temperature": 0, "stream": stream, **body})
    assert r.status == 200, await r.text()
    if not stream:
        choice = (await r.json())["choices"][0]
        return choice["text"], choice["finish_reason"]
    events = parse_sse(await r.text())
    assert events[-1] == (None, "[DONE]")
    choices = [json.loads(data)["choices"][0] for _, data in events[:-1]]
    return "".join(c["text"] for c in choices), choices[-1]["finish_reason"]


# -- outputs satisfy their constraint --------------------------------------------------------------------------------
# (request fields, the constraint they stand for)
CHAT_CASES = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "point", "schema": POINT, "strict": True}}},
     {"json": POINT}),
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"response_format": {"type": "regex", "regex": REGEX}}, {"regex": REGEX}),
    ({"guided_choice": CHOICES}, {"choice": CHOICES}),
    ({"guided_json": COLOR, "guided_decoding_backend": "llguidance"}, {"json": COLOR}),
    ({"structured_outputs": {"grammar": GBNF}}, {"grammar": GBNF}),
]
COMPLETION_CASES = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": COLOR}}}, {"json": COLOR}),
    ({"guided_regex": REGEX}, {"regex": REGEX}),
    ({"structured_outputs": {"choice": CHOICES, "backend": "llguidance"}}, {"choice": CHOICES}),
    ({"guided_grammar": LARK}, {"grammar": LARK}),
    ({"structured_outputs": {"json": json.dumps(POINT), "regex": None}}, {"json": POINT}),  # None: not given
]


async def test_chat_outputs_satisfy_their_constraint(client):
    doc = await (await client.get("/openapi.json")).json()
    validator = request_schema(doc, "ChatCompletionRequest")
    for fields, constraint in CHAT_CASES:
        validator.validate({"model": MODEL, "messages": ASK, **fields})  # the document accepts what is served
        text, reason = await chat_text(client, fields, stream=False)
        assert reason == "stop", (fields, text)
        check(constraint, text)
    for fields, constraint in (CHAT_CASES[0], CHAT_CASES[2]):
        assert await chat_text(client, fields, stream=True) == await chat_text(client, fields, stream=False)
    assert await pages_all_free(client.app)


async def test_completion_outputs_satisfy_their_constraint(client):
    doc = await (await client.get("/openapi.json")).json()
    validator = request_schema(doc, "CompletionRequest")
    for fields, constraint in COMPLETION_CASES:
        validator.validate({"model": MODEL, "prompt": "json:", **fields})
        text, reason = await completion_text(client, fields, stream=False)
        assert reason == "stop", (fields, text)
        check(constraint, text)
    fields, constraint = COMPLETION_CASES[0]
    streamed = await completion_text(client, fields, stream=True)
    assert streamed == await completion_text(client, fields, stream=False)
    check(constraint, streamed[0])
    body = {"response_format": {"type": "json_object"}, "max_tokens": 12}
    text, reason = await completion_text(client, body, stream=False)
    assert reason == "length" or isinstance(json.loads(text), dict)  # any object: the model may not finish it
    text, reason = await completion_text(client, {"response_format": {"type": "text"}, "max_tokens": 3}, False)
    assert reason == "length" and len(text) > 0  # "text": no constraint


async def test_responses_and_messages_constraints(client):
    doc = await (await client.get("/openapi.json")).json()
    responses = {"model": MODEL, "input": "answer in json", "max_output_tokens": 40,
                 "text": {"format": {"type": "json_schema", "name": "color", "schema": COLOR, "strict": True}}}
    request_schema(doc, "ResponsesRequest").validate(responses)
    r = await client.post("/v1/responses", json=responses)
    body = await r.json()
    assert r.status == 200 and body["status"] == "completed", body
    check({"json": COLOR}, body["output"][-1]["content"][0]["text"])
    r = await client.post("/v1/responses", json={**responses, "stream": True})
    events = parse_sse(await r.text())
    assert events[-1][0] == "response.completed"
    check({"json": COLOR}, "".join(json.loads(d)["delta"] for n, d in events if n == "response.output_text.delta"))

    for fields in ({"output_format": {"type": "json_schema", "schema": POINT}},
                   {"output_config": {"format": {"type": "json_schema", "schema": POINT}}},
                   {"structured_outputs": {"regex": REGEX}}):
        messages = {"model": MODEL, "messages": ASK, "max_tokens": 40, **fields}
        request_schema(doc, "MessagesRequest").validate(messages)
        r = await client.post("/v1/messages", json=messages)
        body = await r.json()
        assert r.status == 200 and body["stop_reason"] == "end_turn", body
        check({"json": POINT} if "structured_outputs" not in fields else {"regex": REGEX}, body["content"][0]["text"])
    r = await client.post("/v1/messages", json={**messages, "stream": True})
    events = parse_sse(await r.text())
    text = "".join(json.loads(d)["delta"].get("text", "") for n, d in events if n == "content_block_delta")
    assert events[-1][0] == "message_stop" and re.fullmatch(REGEX, text), text


EMBEDDED = Path(deepserve.__file__).parent / "assets" / "deepserve-tiny-v4"
#: prompts in the shape the embedded model was trained on ("Write a Python function ..."), on which its reasoning
#: ends with </think> within the test's max_tokens: a thinking request samples (deepseek-recipe leaves its
#: temperature out, as DeepSeek's API ignores it when thinking), so the test seeds them
TRAINED_ASKS = ["Write a Python function `greet(name)`.\n\nReturn a greeting for name.",
                "Write a Python function `add(a, b)`.\n\nReturn the sum of a and b."]
#: one the model ends its reasoning for through the Anthropic endpoint, which samples a thinking request (at
#: temperature 1, as Anthropic's API does; seeded below) whatever the temperature asked
MESSAGES_ASK = [{"role": "user", "content": "Implement `join_words(words)`: join the words with spaces."}]
OP = {"type": "object", "additionalProperties": False, "required": ["name", "n"], "properties": {
    "name": {"type": "string", "enum": ["add", "sub"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}}}


async def test_a_constraint_with_thinking_applies_after_the_thinking_section(aiohttp_client):
    """The embedded model in thinking mode: free reasoning, then the answer follows the constraint."""
    client = await aiohttp_client(make_app(EMBEDDED, default_thinking_mode=True))
    asks = [[{"role": "user", "content": text}] for text in TRAINED_ASKS]
    for messages in asks:
        r = await client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": messages, "max_tokens": 80, "temperature": 0, "seed": 2,
            "thinking": {"type": "enabled"}, "structured_outputs": {"json": OP}})
        message = (await r.json())["choices"][0]["message"]
        assert r.status == 200 and message["reasoning_content"], message
        with pytest.raises(ValueError):  # the reasoning itself is free text, not forced into the schema
            json.loads(message["reasoning_content"])
        jsonschema.validate(json.loads(message["content"]), OP)
    r = await client.post("/v1/messages", json={
        "model": MODEL, "messages": MESSAGES_ASK, "max_tokens": 80, "temperature": 0, "seed": 2,
        "thinking": {"type": "enabled", "budget_tokens": 1024}, "output_format": {"type": "json_schema", "schema": OP}})
    body = await r.json()
    assert r.status == 200 and [block["type"] for block in body["content"]] == ["thinking", "text"], body
    jsonschema.validate(json.loads(body["content"][1]["text"]), OP)
    # a constrained request that does not ask for thinking runs without it (the server's default is thinking)
    r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": asks[0], "max_tokens": 20,
                                                         "temperature": 0, "guided_choice": CHOICES})
    message = (await r.json())["choices"][0]["message"]
    assert message["content"] in CHOICES and not message.get("reasoning_content")
    assert await pages_all_free(client.app)


async def test_a_request_picks_its_grammar_backend(client):
    """`structured_outputs.backend` or `guided_decoding_backend` picks a backend per request; the server option
    `structured_outputs_backend` is the default (llguidance here)."""
    pytest.importorskip("outlines_core")
    for fields, constraint in [({"structured_outputs": {"regex": REGEX, "backend": "outlines"}}, {"regex": REGEX}),
                               ({"guided_json": POINT, "guided_decoding_backend": "outlines"}, {"json": POINT})]:
        text, reason = await completion_text(client, fields, stream=False)
        assert reason == "stop", (fields, text)
        check(constraint, text)
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "guided_grammar": LARK,
                                                    "guided_decoding_backend": "outlines"})
    assert "outlines" in await error_message(r, 400, "guided_grammar", "invalid_structured_output")


# -- errors ----------------------------------------------------------------------------------------------------------
async def error_message(r, status: int, param: str | None = None, code: str | None = None) -> str:
    """The message of an error answer, checking its status and the protocol's error JSON."""
    body = await r.json()
    assert r.status == status, body
    if r.url.path.startswith("/v1/messages"):
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
        return body["error"]["message"]
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error["message"]


BAD = [  # (path, fields, param, words the message must contain)
    ("/v1/completions", {"guided_json": {"type": "object", "properties": {"a": {"type": "nope"}}}}, "guided_json",
     ["invalid JSON schema"]),
    ("/v1/completions", {"response_format": {"type": "regex", "regex": "[a-"}}, "response_format", ["invalid regex"]),
    ("/v1/chat/completions", {"response_format": {"type": "regex", "regex": "(unclosed"}}, "response_format",
     ["regex"]),
    ("/v1/completions", {"structured_outputs": {"grammar": "start: ("}}, "structured_outputs", ["grammar"]),
    ("/v1/chat/completions", {"guided_grammar": "root ::= [0-9"}, "guided_grammar", ["grammar"]),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "backend": "nope"}}, "structured_outputs",
     ["'nope'", "not registered"]),
    ("/v1/chat/completions", {"guided_choice": ["a"], "guided_decoding_backend": "xgrammer"},
     "guided_choice", ["'xgrammer'", "not registered"]),
    ("/v1/completions", {"structured_outputs": {"choice": []}}, "structured_outputs", ["choice", "non-empty"]),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "frob": 1}}, "structured_outputs", ["frob"]),
    ("/v1/completions", {"structured_outputs": {}}, "structured_outputs", ["exactly one"]),
    ("/v1/completions", {"structured_outputs": "a+"}, "structured_outputs", ["must be an object"]),
    ("/v1/chat/completions", {"guided_json": 5}, "guided_json", ["'guided_json'", "JSON schema"]),
    ("/v1/completions", {"response_format": {"type": "xml"}}, "response_format", ["'xml'"]),
    ("/v1/completions", {"response_format": {"type": "json_schema"}}, "response_format", ["json_schema"]),
    ("/v1/completions", {"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
     ["'response_format'", "'guided_regex'", "more than one"]),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs", ["'response_format'", "'structured_outputs'", "more than one"]),
    ("/v1/responses", {"guided_json": POINT, "guided_choice": ["a"]}, "guided_choice",
     ["'guided_json'", "'guided_choice'"]),
    ("/v1/messages", {"output_format": {"type": "json_schema", "schema": {"type": "nope"}}}, None,
     ["invalid JSON schema"]),
    ("/v1/messages", {"output_format": {"type": "xml"}}, None, ["output_format"]),
    ("/v1/completions", {"guided_decoding_backend": 3, "guided_regex": "a"}, "guided_decoding_backend",
     ["guided_decoding_backend"]),
]
BASE = {"/v1/completions": {"prompt": "hi", "max_tokens": 2}, "/v1/chat/completions": {"messages": ASK},
        "/v1/responses": {"input": "hi"}, "/v1/messages": {"messages": ASK, "max_tokens": 2}}


async def test_an_invalid_constraint_is_a_400_naming_the_problem(client):
    for path, fields, param, words in BAD:
        r = await client.post(path, json={"model": MODEL, **BASE[path], **fields})
        message = await error_message(r, 400, param)
        assert all(w in message for w in words), (fields, message)
    assert client.app[ENGINE].num_open_streams == 0  # nothing reached the engine


async def test_a_compile_past_the_timeout_is_a_400(client, monkeypatch):
    grammars = client.app[ENGINE].engine.grammars
    assert grammars.timeout == 5.0  # the server option reached the engine
    monkeypatch.setattr(grammars, "timeout", 0.2)
    for path, fields, param in [("/v1/completions", {"structured_outputs": {"regex": "a+", "backend": "slow"}},
                                 "structured_outputs"),
                                ("/v1/messages", {"guided_regex": "b+", "guided_decoding_backend": "slow"}, None)]:
        r = await client.post(path, json={"model": MODEL, **BASE[path], **fields})
        message = await error_message(r, 400, param, code="grammar_compile_timeout" if param else None)
        assert "0.2 s grammar compile timeout" in message
    assert client.app[ENGINE].num_open_streams == 0


async def test_a_model_without_grammar_backend_refuses_constraints(client, monkeypatch):
    monkeypatch.setattr(client.app[ENGINE].engine, "grammars", None)  # what a model without tokenizer.json has
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": [5, 6], "guided_regex": "a"})
    message = await error_message(r, 400, "guided_regex", code="structured_outputs_unavailable")
    assert "tokenizer" in message
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": [5, 6], "max_tokens": 2})
    assert r.status == 200  # unconstrained requests still work


async def test_a_grammar_dead_end_is_a_422_or_an_error_event(client):
    dead = {"structured_outputs": {"regex": "ok", "backend": "dead-end"}}
    for path in BASE:
        limit = {"max_output_tokens" if path == "/v1/responses" else "max_tokens": 10}
        r = await client.post(path, json={"model": MODEL, **BASE[path], **dead, **limit})
        message = await error_message(r, 422, "structured_outputs" if path != "/v1/messages" else None,
                                      "structured_output_failed" if path != "/v1/messages" else None)
        assert "structured output: dead end: nothing may follow 'ok'" in message, (path, message)
    # streaming: the tokens before the dead end, then the protocol's error event (no [DONE])
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 10, "stream": True,
                                                    **dead})
    events = parse_sse(await r.text())
    assert r.status == 200 and events[-1][1] != "[DONE]"
    error = json.loads(events[-1][1])["error"]
    assert error["code"] == "structured_output_failed" and "dead end" in error["message"]
    assert "".join(json.loads(d)["choices"][0]["text"] for _, d in events[:-1]) in ("", "o", "ok")
    r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 10,
                                                         "stream": True, **dead})
    events = parse_sse(await r.text())
    assert "dead end" in json.loads(events[-1][1])["error"]["message"]
    r = await client.post("/v1/messages", json={"model": MODEL, **BASE["/v1/messages"], "max_tokens": 10,
                                                "stream": True, **dead})
    name, data = parse_sse(await r.text())[-1]
    assert name == "error" and "dead end" in json.loads(data)["error"]["message"]
    r = await client.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 10,
                                                 "stream": True, **dead})
    name, data = parse_sse(await r.text())[-1]
    assert name == "error" and json.loads(data)["code"] == "invalid_request_error" and "dead end" in data
    assert await pages_all_free(client.app)
    metrics = await (await client.get("/metrics")).text()
    assert 'deepserve_requests_finished_total{reason="error"}' in metrics


# -- options and the document ----------------------------------------------------------------------------------------
def test_server_options_reach_the_engine_options():
    config = ServerConfig(model="m", structured_outputs_backend="llguidance", grammar_compile_timeout=2.5,
                          engine_kwargs={"dtype": "float32"})
    assert config.engine_options == {"dtype": "float32", "structured_outputs_backend": "llguidance",
                                     "grammar_compile_timeout": 2.5}
    assert ServerConfig(model="m").engine_options == {}
    for bad in ({"grammar_compile_timeout": 0}, {"grammar_compile_timeout": "5"}, {"structured_outputs_backend": ""},
                {"grammar_compile_timeout": 1.0, "engine_kwargs": {"grammar_compile_timeout": 2.0}}):
        with pytest.raises(ValueError, match="structured_outputs_backend|grammar_compile_timeout"):
            ServerConfig(model="m", **bad)


async def test_openapi_documents_the_structured_output_fields(client):
    doc = await (await client.get("/openapi.json")).json()
    schemas = doc["components"]["schemas"]
    for name in ("ChatCompletionRequest", "CompletionRequest", "ResponsesRequest", "MessagesRequest"):
        assert {"structured_outputs", "guided_json", "guided_regex", "guided_grammar", "guided_choice",
                "guided_decoding_backend"} <= set(schemas[name]["properties"]), name
    assert "response_format" in schemas["CompletionRequest"]["properties"]
    assert "output_format" in schemas["MessagesRequest"]["properties"]
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"):
        assert "422" in doc["paths"][path]["post"]["responses"]
    completion = request_schema(doc, "CompletionRequest")
    assert not completion.is_valid({"model": MODEL, "prompt": "x", "response_format": {"type": "xml"}})
    assert not completion.is_valid({"model": MODEL, "prompt": "x", "structured_outputs": {"frob": 1}})
    assert completion.is_valid({"model": MODEL, "prompt": "x", "structured_outputs": {"regex": "a", "after_token": 6}})
