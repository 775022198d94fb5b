"""Structured outputs and forced tool calls behind the data-parallel front (issues 25 / 18), on CPU: two rank
processes (no expert parallelism, so no collectives) on the embedded model and its tokenizer. A JSON-schema
constrained request, through `LLM(data_parallel_size=2)` and through the HTTP server, and a forced tool call
(`tool_choice` named and "required") give outputs that satisfy their constraint and equal one process's
(greedy); an invalid schema gets one process's error (the `GrammarError`, the same 400 body)."""

from __future__ import annotations

import json
import threading

import jsonschema
import pytest

from deepserve import LLM, SamplingParams
from deepserve.core.env import default_model_dir
from deepserve.core.grammar_compiler import GrammarCompiler
from deepserve.core.plugins import make_plugin_manager
from deepserve.core.structured import GrammarError
from deepserve.distributed.front import DataParallelEngine
from deepserve.server import ENGINE, ServerConfig, create_app
from test_server_structured import SlowBackend  # compiles nothing until released: past the timeout

MODEL = str(default_model_dir())
OPTIONS = dict(max_num_seqs=4, kv_cache_bytes=2**24, block_size=128, max_model_len=512)
RECORD = {"type": "object", "additionalProperties": False, "required": ["color", "n", "tags"], "properties": {
    "color": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer", "minimum": -50, "maximum": 50},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3}}}
INVALID = {"type": "object", "properties": {"a": {"type": "nope"}}}
PROMPTS = ["Describe a thing as JSON: ", "A record: ", "x" * 40, "Colour and count? "]
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -999, "maximum": 999},
                                       "b": {"type": "integer", "minimum": -999, "maximum": 999}},
       "required": ["a", "b"], "additionalProperties": False}  # (else a small model may add keys until max_tokens)
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": ADD}},
         {"type": "function", "function": {"name": "pick", "description": "Pick a record", "parameters": RECORD}}]
SCHEMAS = {"add": ADD, "pick": RECORD}
ASK = [{"role": "user", "content": "Add 2 and 3, then answer in json."}]


def constrained(schema, max_tokens=60):
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs={"json": schema})


@pytest.fixture(scope="module")
def one():
    llm = LLM(**OPTIONS)
    yield llm
    llm.engine.shutdown()


@pytest.fixture(scope="module")
def dp2():
    llm = LLM(data_parallel_size=2, **OPTIONS)
    yield llm
    llm.engine.shutdown()


def test_json_schema_through_two_ranks_equals_one_process(one, dp2):
    assert isinstance(dp2.engine, DataParallelEngine) and dp2.engine.grammars is not None
    before = [s.num_steps for s in dp2.engine.rank_snapshots]
    outputs = dp2.generate(PROMPTS, constrained(RECORD), use_tqdm=False)
    want = one.generate(PROMPTS, constrained(RECORD), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in want]
    for out in outputs:
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), RECORD)  # the rank's engine masked its tokens
    assert all(s.num_steps > b for s, b in zip(dp2.engine.rank_snapshots, before))  # both ranks served


def test_an_invalid_schema_gets_one_process_error(one, dp2):
    errors = []
    for llm in (one, dp2):
        with pytest.raises(GrammarError) as caught:
            llm.generate(["x"], constrained(INVALID), use_tqdm=False)
        errors.append(str(caught.value))
    assert errors[0] == errors[1] and "nope" in errors[0]
    unknown = SamplingParams(max_tokens=4, structured_outputs={"json": RECORD, "backend": "no-such-backend"})
    with pytest.raises(GrammarError, match="no-such-backend"):  # refused at the front, as EngineCore refuses it
        dp2.engine.add_request("r", [5, 6, 7], unknown)
    assert not dp2.engine.has_unfinished_requests()


def make_app(**engine):
    config = ServerConfig(model=MODEL, served_model_name="tiny", default_thinking_mode=False,
                          engine_kwargs=dict(OPTIONS, max_model_len=1024, **engine))  # the tools' prompt: ~450
    return create_app(config, plugin_manager=make_plugin_manager(load_entrypoints=False))


async def answers(client, release: threading.Event) -> list:
    """The bodies (status, message or error) of a json_schema chat, two forced tool calls, an invalid schema and
    a compile past the timeout (the engine's compiler, the front's under data parallelism, given a stuck backend
    and a 0.5 s timeout, as tests/test_server_structured.py does)."""
    builtin = client.app[ENGINE].engine.grammars
    client.app[ENGINE].engine.grammars = GrammarCompiler(
        {**builtin.factories, "stuck": lambda tokenizer: SlowBackend(tokenizer, release)}, builtin.tokenizer,
        builtin.default_backend, 0.5)
    builtin.shutdown()
    bodies = [
        {"messages": ASK, "max_tokens": 80, "temperature": 0, "response_format": {
            "type": "json_schema", "json_schema": {"name": "pick", "schema": RECORD}}},
        {"messages": ASK, "tools": TOOLS, "max_tokens": 120, "temperature": 0,
         "tool_choice": {"type": "function", "function": {"name": "add"}}},
        {"messages": ASK, "tools": TOOLS, "max_tokens": 120, "temperature": 0, "tool_choice": "required"},
        {"messages": ASK, "max_tokens": 8, "structured_outputs": {"json": INVALID}},
        {"messages": ASK, "max_tokens": 8, "structured_outputs": {"regex": "a+", "backend": "stuck"}},
    ]
    results = []
    for body in bodies:
        r = await client.post("/v1/chat/completions", json={"model": "tiny", **body})
        data = await r.json()
        if r.status != 200:
            results.append((r.status, data))
            continue
        choice = data["choices"][0]
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"].get("tool_calls") or []]
        results.append((r.status, choice["finish_reason"], choice["message"]["content"], calls))
    return results


async def test_server_json_schema_and_forced_tool_calls_across_ranks(aiohttp_client):
    release = threading.Event()
    try:
        want = await answers(await aiohttp_client(make_app()), release)
        got = await answers(await aiohttp_client(make_app(data_parallel_size=2)), release)
    finally:
        release.set()
    assert got == want
    schema_answer, named, required, invalid, late = got
    jsonschema.validate(json.loads(schema_answer[2]), RECORD)
    assert named[1] == "tool_calls" and [name for name, _ in named[3]] == ["add"]
    assert required[1] == "tool_calls" and required[3]
    for name, arguments in named[3] + required[3]:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    assert invalid[0] == 400 and invalid[1]["error"]["code"] == "invalid_structured_output", invalid
    assert late[0] == 400 and late[1]["error"]["code"] == "grammar_compile_timeout", late
