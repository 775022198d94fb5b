"""Forced tool calls (issue 25, item 4): `tool_choice` "required" / a named function (Anthropic `any` / `tool`)
make the embedded model write a well-formed V4 tool call through the grammar machinery, with thinking off and
after the thinking section when thinking is on; the recipe parses it into OpenAI `tool_calls` (streamed as
deltas), Anthropic `tool_use` blocks and Responses function-call items, and its arguments are an instance of
the tool's JSON schema. `auto` parses whatever the model writes; `parallel_tool_calls: false` allows one call."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

import deepserve
from test_server import MODEL, make_app, parse_sse

EMBEDDED = Path(deepserve.__file__).parent / "assets" / "deepserve-tiny-v4"
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "minLength": 1, "maxLength": 24}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}, "hourly": {"type": "boolean"}},
    "required": ["city", "days"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -999, "maximum": 999},
                                       "b": {"type": "integer", "minimum": -999, "maximum": 999}},
       "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast for a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]


@pytest.fixture
async def client(aiohttp_client):
    return await aiohttp_client(make_app(EMBEDDED))


async def chat(client, **body):
    r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "tools": TOOLS,
                                                         "max_tokens": 160, **body})
    data = await r.json()
    assert r.status == 200, data
    return data


def check_call(name: str, arguments: str | dict, allowed=tuple(SCHEMAS)) -> dict:
    assert name in allowed
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(args, SCHEMAS[name])
    return args


async def test_required_forces_a_call_whose_arguments_fit_the_schema(client):
    data = await chat(client, tool_choice="required", seed=0, temperature=1.0)
    choice = data["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    calls = choice["message"]["tool_calls"]
    assert calls and all(c["type"] == "function" and c["id"] for c in calls)
    for call in calls:
        check_call(call["function"]["name"], call["function"]["arguments"])


async def test_a_named_function_is_the_one_called_once_without_parallel_calls(client):
    data = await chat(client, tool_choice={"type": "function", "function": {"name": "add"}},
                      parallel_tool_calls=False, temperature=1.0, seed=3)
    calls = data["choices"][0]["message"]["tool_calls"]
    assert len(calls) == 1 and calls[0]["function"]["name"] == "add"
    check_call("add", calls[0]["function"]["arguments"])


async def test_thinking_then_a_forced_call(client):
    data = await chat(client, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                      thinking={"type": "enabled"}, max_tokens=250, temperature=0)
    choice = data["choices"][0]
    message = choice["message"]
    if choice["finish_reason"] == "length":  # the model may think until the limit: the gate held the call back
        assert not message.get("tool_calls") and message.get("reasoning_content")
        return
    assert choice["finish_reason"] == "tool_calls", choice
    assert message.get("reasoning_content") is not None
    check_call("get_weather", message["tool_calls"][0]["function"]["arguments"], ("get_weather",))


async def test_streamed_tool_call_deltas_add_up_to_the_call(client):
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 160, "tool_choice": "required",
            "temperature": 0, "stream": True}
    whole = await chat(client, **{k: v for k, v in body.items() if k not in ("model", "messages", "tools",
                                                                                "stream")})
    r = await client.post("/v1/chat/completions", json=body)
    events = parse_sse(await r.text())
    assert events[-1] == (None, "[DONE]")
    calls: dict[int, dict] = {}
    finish = None
    for _, data in events[:-1]:
        for choice in json.loads(data)["choices"]:
            finish = choice.get("finish_reason") or finish
            for delta in choice["delta"].get("tool_calls") or ():
                call = calls.setdefault(delta["index"], {"name": "", "arguments": ""})
                call["name"] += (delta.get("function") or {}).get("name") or ""
                call["arguments"] += (delta.get("function") or {}).get("arguments") or ""
    assert finish == "tool_calls" and calls
    expected = whole["choices"][0]["message"]["tool_calls"]
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == \
        [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in expected]


async def test_anthropic_any_and_tool_give_tool_use_blocks(client):
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    for choice, allowed in (({"type": "any"}, tuple(SCHEMAS)), ({"type": "tool", "name": "add"}, ("add",))):
        r = await client.post("/v1/messages", json={"model": MODEL, "messages": ASK, "tools": tools,
                                                    "tool_choice": choice, "max_tokens": 160, "temperature": 1.0})
        data = await r.json()
        assert r.status == 200, data
        uses = [b for b in data["content"] if b["type"] == "tool_use"]
        assert data["stop_reason"] == "tool_use" and uses, data
        for use in uses:
            check_call(use["name"], use["input"], allowed)


async def test_responses_required_gives_function_call_items(client):
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    r = await client.post("/v1/responses", json={"model": MODEL, "input": ASK[0]["content"], "tools": tools,
                                                 "tool_choice": "required", "max_output_tokens": 160})
    data = await r.json()
    assert r.status == 200, data
    items = [item for item in data["output"] if item["type"] == "function_call"]
    assert items, data
    for item in items:
        check_call(item["name"], item["arguments"])


async def test_auto_parses_a_call_the_model_writes_and_bad_choices_are_named(client):
    data = await chat(client, tool_choice="auto", temperature=0, max_tokens=16)
    message = data["choices"][0]["message"]
    for call in message.get("tool_calls") or ():
        assert call["function"]["name"] in SCHEMAS  # what the model wrote, parsed (it may also answer in text)
    r = await client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 8,
        "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert r.status == 400


@pytest.mark.parametrize("text, ok", [('{"a":1,"b":[1,2]}', True), ('{"a": 1, "b": [1, 2]}', True),
                                      ('{\n"a":1}', False), ('{"a":  1}', False), ('{"a":1 }', True)])
def test_argument_json_holds_at_most_one_space_between_tokens(text, ok):
    """A non-string argument's JSON allows one optional space where JSON allows whitespace, no newlines or runs (a
    small model filled a forced call's max_tokens with newlines inside it); a schema's own x-guidance wins."""
    import llguidance

    from deepserve.server.tool_calls import tool_call_grammar

    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array"}}, "required": ["a"]}
    lines = tool_call_grammar([{"name": "f", "parameters": {"type": "object", "properties": {"x": schema}}}], None,
                              False, False).splitlines()
    value = next(line.split(": ", 1)[1] for line in lines if "%json" in line)
    vocab = json.loads((EMBEDDED / "config.json").read_text())["vocab_size"]
    tokenizer = llguidance.LLTokenizer((EMBEDDED / "tokenizer.json").read_text(), n_vocab=vocab, eos_token=[1])
    ids = tokenizer.tokenize_str(text)
    matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_lark(f"start: {value}"))
    assert (matcher.try_consume_tokens(ids) == len(ids)) == ok
    own = {**schema, "x-guidance": {"whitespace_flexible": True}}
    lines = tool_call_grammar([{"name": "f", "parameters": {"type": "object", "properties": {"x": own}}}], None,
                              False, False).splitlines()
    assert '"x-guidance": {"whitespace_flexible": true}' in next(line for line in lines if "%json" in line)
