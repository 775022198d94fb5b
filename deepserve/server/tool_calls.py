"""Forced tool calls: `tool_choice` "required" (Anthropic `any`) or a named function, enforced as a grammar over
DeepSeek-V4's tool-call format, so the output is always a well-formed call that deepseek-recipe's stream
processor parses into OpenAI `tool_calls`, Anthropic `tool_use` blocks or Responses function-call items.

V4 writes a call as (｜DSML｜ is one special token of its tokenizer)::

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

`tool_call_grammar` makes an llguidance Lark grammar of that shape for the allowed tools: one invoke (or one or
more where parallel tool calls are allowed) of a tool by name, its parameters in the schema's property order,
the required ones always, the others optionally; a `string` parameter is raw text (without `<`; an `enum` is
one of its values, `minLength` / `maxLength` bound it; `pattern` and `format` are not enforced), any other is a JSON value of its schema (llguidance's `%json`). Without thinking the
recipe's prompt already opens the call block, so the grammar starts inside it; with thinking the request is
converted as `auto` and the grammar, opening the block itself, starts after `</think>` (`after_thinking`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from deepserve.core.structured import GrammarSpec
from deepserve.server.errors import ApiError

DSML = "｜DSML｜"
#: the grammar backend whose Lark dialect the grammar is written in (special tokens, `%json`)
BACKEND = "llguidance"


def forced_tools(protocol: str, body: Mapping[str, Any]) -> tuple[str, ...] | None:
    """The tool names a request's `tool_choice` forces: () for any tool, (name,) for one, None when nothing is
    forced (`auto`, `none`, or no tool_choice). `protocol`: the route's name."""
    choice = body.get("tool_choice")
    if protocol == "messages":
        if isinstance(choice, dict) and choice.get("type") == "any":
            return ()
        if isinstance(choice, dict) and choice.get("type") == "tool" and isinstance(choice.get("name"), str):
            return (choice["name"],)
        return None
    if choice == "required":
        return ()
    if isinstance(choice, dict) and choice.get("type") == "function":
        named = choice.get("function") if protocol == "chat.completions" else choice
        if isinstance(named, dict) and isinstance(named.get("name"), str):
            return (named["name"],)
    return None


def auto_choice(protocol: str) -> Any:
    """The `tool_choice` that lets the model choose, in `protocol`'s spelling."""
    return {"type": "auto"} if protocol == "messages" else "auto"


def parallel_allowed(protocol: str, body: Mapping[str, Any]) -> bool:
    """OpenAI's `parallel_tool_calls` (default true); Anthropic's `tool_choice.disable_parallel_tool_use`."""
    if protocol == "messages":
        choice = body.get("tool_choice")
        return not (isinstance(choice, dict) and choice.get("disable_parallel_tool_use") is True)
    return body.get("parallel_tool_calls") is not False


#: the whitespace a non-string argument's JSON may hold between its tokens (llguidance's `whitespace_pattern`)
ARGUMENT_WHITESPACE = "[ ]?"


def tool_call_spec(tools: Sequence[Mapping[str, Any]], names: Sequence[str], dsml_id: int | None, parallel: bool,
                   open_block: bool) -> GrammarSpec:
    """The grammar spec of a forced call among `tools` (OpenAI's `[{"type": "function", "function": {...}}]`, as
    deepseek-recipe reports them), limited to `names` when given. 400 when a named tool is not among them."""
    functions = [t.get("function", t) for t in tools]
    if names:
        known = {f.get("name") for f in functions}
        missing = [n for n in names if n not in known]
        if missing:
            raise ApiError(400, f"'tool_choice' names the function {missing[0]!r}, which is not in 'tools'",
                           param="tool_choice")
        functions = [f for f in functions if f.get("name") in names]
    if not functions:
        raise ApiError(400, "'tool_choice' forces a tool call but the request has no tools", param="tool_choice")
    return GrammarSpec("grammar", tool_call_grammar(functions, dsml_id, parallel, open_block), backend=BACKEND)


def tool_call_grammar(functions: Sequence[Mapping[str, Any]], dsml_id: int | None, parallel: bool,
                      open_block: bool) -> str:
    d = f"<[{dsml_id}]>" if dsml_id is not None else _lit(DSML)
    lines = [f"start: {_lit(chr(10) * 2 + '<')} {d} {_lit('tool_calls>' + chr(10))} calls" if open_block
             else "start: calls",
             f"calls: invoke{'+' if parallel else ''} {_lit('</')} {d} {_lit('tool_calls>')}",
             "invoke: " + " | ".join(f"invoke_{i}" for i in range(len(functions))),
             "RAW: /[^<]*/"]
    for i, function in enumerate(functions):
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ApiError(400, f"tool {i} has no function name", param="tools")
        params = function.get("parameters") or {}
        props = params.get("properties") or {} if isinstance(params, dict) else {}
        required = set(params.get("required") or ()) if isinstance(params, dict) else set()
        parts = []
        for j, (prop, schema) in enumerate(props.items()):
            rule = f"p_{i}_{j}"
            parts.append(rule if prop in required else f"{rule}?")
            lines += _parameter(rule, prop, schema if isinstance(schema, dict) else {}, d)
        head = _lit("<") + f" {d} " + _lit(f'invoke name="{name}">\n')
        tail = _lit("</") + f" {d} " + _lit("invoke>\n")
        lines.append(f"invoke_{i}: {head} {' '.join(parts)} {tail}")
    return "\n".join(lines) + "\n"


def _parameter(rule: str, prop: str, schema: Mapping[str, Any], d: str) -> list[str]:
    is_string = schema.get("type") == "string"
    head = _lit("<") + f" {d} " + _lit(f'parameter name="{prop}" string="{"true" if is_string else "false"}">')
    tail = _lit("</") + f" {d} " + _lit("parameter>\n")
    if is_string and isinstance(schema.get("enum"), list) and all(isinstance(v, str) for v in schema["enum"]):
        value = "(" + " | ".join(_lit(v) for v in schema["enum"]) + ")"
        return [f"{rule}: {head} {value} {tail}"]
    if is_string:
        low, high = schema.get("minLength"), schema.get("maxLength")
        if type(low) is int or type(high) is int:  # the text's length in characters, as JSON schema counts it
            low = low if type(low) is int and low >= 0 else 0
            bound = f"{low},{high}" if type(high) is int and high >= low else f"{low},"
            return [f"{rule}: {head} {rule}_text {tail}", f"{rule}_text: /[^<]{{{bound}}}/"]
        return [f"{rule}: {head} RAW {tail}"]
    # at most one space where JSON allows whitespace (as outlines' default): a call's arguments read as models
    # write them, and a small model cannot fill max_tokens with newlines inside them; a schema's own `x-guidance`
    # options win
    value = {"x-guidance": {"whitespace_pattern": ARGUMENT_WHITESPACE}, **schema}
    return [f"{rule}: {head} {rule}_value {tail}", f"{rule}_value: %json {json.dumps(value)}"]


def _lit(text: str) -> str:
    """A Lark string literal of `text`."""
    return json.dumps(text, ensure_ascii=False)
