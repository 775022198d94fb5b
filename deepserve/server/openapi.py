"""`/openapi.json`: an OpenAPI 3.1 document built from the live router, so it lists exactly the routes served.

Request schemas say what the server checks itself; the recipe endpoints also accept the rest of their protocol
(`additionalProperties: true`: deepseek-recipe ignores fields it does not know), `/v1/completions` refuses
unknown fields. Structured output is documented where each protocol asks for it (`response_format`,
`text.format`, `output_format`) and as the `structured_outputs` / `guided_*` extension on every generation route.
Every operation lists the statuses it can answer.
"""

from __future__ import annotations

import re
from typing import Any

from aiohttp import web

from deepserve import __version__
from deepserve.core.kv.store import TTL_DAYS
from deepserve.server.completions import MAX_PROMPTS
from deepserve.server.config import ServerConfig
from deepserve.server.session import MAX_SESSION_ID_LENGTH
from deepserve.server.validation import MAX_N, MAX_SEED, MAX_STOP_STRINGS

_STR, _INT, _BOOL, _NUM = {"type": "string"}, {"type": "integer"}, {"type": "boolean"}, {"type": "number"}
_OBJ = {"type": "object"}


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def _object(required: list[str], properties: dict[str, Any], extra: bool = True) -> dict:
    return {"type": "object", "required": required, "properties": properties, "additionalProperties": extra}


_TEXT = {"type": "string", "minLength": 1}
_STOP = _nullable({"anyOf": [_TEXT, {"type": "array", "items": _TEXT, "maxItems": MAX_STOP_STRINGS}]})
# every generation route's rules (deepserve.server.validation: deepseek-recipe's ranges for chat)
_SAMPLING = {"temperature": _nullable({"type": "number", "minimum": 0, "maximum": 2}),
             "top_p": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
             "top_k": _nullable({"type": "integer", "minimum": -1, "description": "deepserve extension"}),
             "seed": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_SEED - 1}),
             "stream": _nullable(_BOOL)}

_N = _nullable({"type": "integer", "minimum": 1, "maximum": MAX_N,
                "description": "choices; the server runs one engine request per choice"})
# deepserve.server.sampling_options: OpenAI's penalties and logit_bias, vLLM's repetition_penalty and bad_words
_PENALTIES = {"presence_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
              "frequency_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
              "repetition_penalty": _nullable({"type": "number", "exclusiveMinimum": 0,
                                               "description": "vLLM extension; 1 is off"}),
              "logit_bias": _nullable({"type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
                                       "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
                                       "description": "token id -> bias added to its logit"}),
              "bad_words": _nullable({"type": "array", "items": _TEXT, "description": "vLLM extension"})}


# structured output (deepserve.server.structured): exactly one constraint per request, else a 400 naming the fields
_SCHEMA_OBJ = {"type": ["object", "boolean"], "description": "a JSON schema"}
_CHOICES = {"type": "array", "items": _STR, "minItems": 1}
_STRUCTURED_OUTPUTS = {
    "type": "object", "minProperties": 1, "additionalProperties": False,
    "description": "deepserve/vLLM extension: exactly one of json, json_object, regex, grammar, choice "
                   "(docs/structured.md); an invalid one, or a compile past the server's grammar compile timeout, "
                   "is a 400",
    "properties": {key: _nullable(value) for key, value in {  # null: as if not given
        "json": {"anyOf": [_SCHEMA_OBJ, {"type": "string", "description": "the schema as JSON"}]},
        "json_object": {"const": True}, "regex": _TEXT,
        "grammar": dict(_TEXT, description="Lark (`start:`) or GBNF (`root ::=`)"), "choice": _CHOICES,
        "backend": dict(_TEXT, description="a registered grammar backend (default: the server's)"),
        "compact_json": _BOOL, "ascii_classes": _BOOL,
        "after_token": {"type": "integer", "minimum": 0,
                        "description": "the constraint starts after this token id is generated"}}.items()}}
_GUIDED = {"structured_outputs": {"anyOf": [_STRUCTURED_OUTPUTS, {"type": "null"}]},
           "guided_json": _nullable({"anyOf": [_SCHEMA_OBJ, {"type": "string"}],
                                     "description": "vLLM's older name for structured_outputs.json"}),
           "guided_regex": _nullable(dict(_TEXT, description="structured_outputs.regex")),
           "guided_grammar": _nullable(dict(_TEXT, description="structured_outputs.grammar")),
           "guided_choice": _nullable(dict(_CHOICES, description="structured_outputs.choice")),
           "guided_decoding_backend": _nullable(dict(_TEXT, description="structured_outputs.backend"))}
_RESPONSE_FORMAT = _nullable({"oneOf": [
    _object(["type"], {"type": {"const": "text"}}),
    _object(["type"], {"type": {"const": "json_object"}}),
    _object(["type", "json_schema"], {"type": {"const": "json_schema"}, "json_schema": _object(["schema"], {
        "name": _STR, "description": _STR, "schema": _SCHEMA_OBJ, "strict": _nullable(_BOOL)})}),
    _object(["type", "regex"], {"type": {"const": "regex"}, "regex": _TEXT})]})
_TEXT_FORMAT = _object([], {"format": _nullable({"oneOf": [
    _object(["type"], {"type": {"const": "text"}}),
    _object(["type"], {"type": {"const": "json_object"}}),
    _object(["type", "name", "schema"], {"type": {"const": "json_schema"}, "name": _STR, "description": _STR,
                                 "schema": _SCHEMA_OBJ, "strict": _nullable(_BOOL)})]})})
_ANTHROPIC_FORMAT = _nullable(_object(["type", "schema"], {"type": {"const": "json_schema"}, "schema": _SCHEMA_OBJ}))


def _messages(roles: list[str]) -> dict:
    return {"type": "array", "minItems": 1, "items": _object(["role"], {"role": {"enum": roles}})}


_CHAT_MESSAGES = _messages(["system", "user", "assistant", "tool", "latest_reminder"])
_USAGE = _object([], {"prompt_tokens": _INT, "completion_tokens": _INT, "total_tokens": _INT,
                      "prompt_tokens_details": _object([], {"cached_tokens": _INT})})
_SESSION_ID = {"type": "string", "minLength": 1, "maxLength": MAX_SESSION_ID_LENGTH}
_SESSION = _nullable({**_SESSION_ID, "description": "the conversation whose SWA host slot this turn continues "
                                                    "(docs/cache.md)"})
_CACHE_TTL = _nullable({"enum": sorted(TTL_DAYS), "description": "the retention class of the KV blocks this request "
                        "writes to the block store (agent: 3 days, chat: 7); default --kv-store-ttl-class "
                        "(docs/cache.md)"})
#: deepserve's per-request cache fields, top-level or (as vLLM's docs show) inside a literal `extra_body`
_CACHE = {"cache_ttl": _CACHE_TTL, "extra_body": _nullable(_object([], {"cache_ttl": _CACHE_TTL}))}

SCHEMAS: dict[str, Any] = {
    "Error": _object(["error"], {"error": _object(["message", "type"], {
        "message": _STR, "type": _STR, "param": _nullable(_STR), "code": _nullable(_STR)})}),
    "AnthropicError": _object(["type", "error"], {
        "type": {"const": "error"}, "error": _object(["type", "message"], {"type": _STR, "message": _STR})}),
    "ChatCompletionRequest": _object(["model", "messages"], {
        "model": _STR, "messages": _CHAT_MESSAGES, **_SAMPLING, **_PENALTIES, "stop": _STOP,
        "stream_options": _nullable(_object([], {"include_usage": _BOOL})),
        "max_tokens": _nullable({"type": "integer", "minimum": 1}), "n": _N,
        "logprobs": _nullable(_BOOL), "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": 20}),
        "tools": _nullable({"type": "array", "items": _OBJ}), "tool_choice": {},
        "thinking": _nullable(_object([], {"type": {"enum": ["enabled", "disabled"]}})),
        "reasoning_effort": _nullable({"enum": ["low", "medium", "high", "xhigh", "max"]}),
        "response_format": _RESPONSE_FORMAT, "session_id": _SESSION, **_CACHE, **_GUIDED}),
    "ChatCompletion": _object(["id", "object", "created", "model", "choices"], {
        "id": _STR, "object": {"const": "chat.completion"}, "created": _INT, "model": _STR,
        "choices": {"type": "array", "items": _object(["index", "message", "finish_reason"], {
            "index": _INT, "message": _OBJ, "finish_reason": _nullable(_STR)})}, "usage": _USAGE}),
    "CompletionRequest": _object(["model", "prompt"], {
        "model": _STR, "prompt": {"anyOf": [_STR, {"type": "array", "items": _INT, "minItems": 1},
                                            {"type": "array", "maxItems": MAX_PROMPTS, "minItems": 1,
                                             "items": {"anyOf": [_STR, {"type": "array", "items": _INT}]}}]},
        **_SAMPLING, "stop": _STOP, "max_tokens": _nullable({
            "type": "integer", "minimum": 0, "description": "0 only with echo: the prompt and its logprobs alone"}),
        "n": _N, "echo": _nullable(_BOOL),
        "logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": 20}),
        "stream_options": _nullable(_object([], {"include_usage": _BOOL})), "user": _nullable(_STR),
        "min_p": _nullable({"type": "number", "minimum": 0, "maximum": 1}),
        "min_tokens": _nullable({"type": "integer", "minimum": 0}), "ignore_eos": _nullable(_BOOL),
        "stop_token_ids": _nullable({"type": "array", "items": {"type": "integer", "minimum": 0}}),
        "skip_special_tokens": _nullable(_BOOL), "include_stop_str_in_output": _nullable(_BOOL),
        "suffix": {"type": "null"}, "best_of": _nullable({"const": 1}), **_PENALTIES,
        "response_format": _RESPONSE_FORMAT, "session_id": _SESSION, **_CACHE, **_GUIDED}, extra=False),
    "Completion": _object(["id", "object", "created", "model", "choices", "usage"], {
        "id": _STR, "object": {"const": "text_completion"}, "created": _INT, "model": _STR,
        "choices": {"type": "array", "items": _object(["text", "index", "finish_reason"], {
            "text": _STR, "index": _INT, "finish_reason": _nullable(_STR), "logprobs": _nullable(_OBJ)})},
        "usage": _USAGE}),
    "ResponsesRequest": _object(["model"], {
        "model": _STR, "input": {"anyOf": [_STR, {"type": "array", "items": _OBJ}]}, **_SAMPLING,
        "instructions": _nullable(_STR), "max_output_tokens": _nullable({"type": "integer", "minimum": 1}),
        "tools": _nullable({"type": "array", "items": _OBJ}), "reasoning": _nullable(_OBJ),
        "text": _nullable(_TEXT_FORMAT), "session_id": _SESSION, **_CACHE,
        "conversation": _nullable({"anyOf": [_SESSION_ID, _object(["id"], {"id": _SESSION_ID})],
                                   "description": "names the session (as session_id); no items are stored: send "
                                                  "the whole conversation as input"}), **_GUIDED}),
    "Response": _object(["id", "object", "status", "model", "output"], {
        "id": _STR, "object": {"const": "response"}, "status": _STR, "model": _STR,
        "output": {"type": "array", "items": _OBJ}, "usage": _nullable(_OBJ)}),
    "MessagesRequest": _object(["model", "messages", "max_tokens"], {
        "model": _STR, "messages": _messages(["user", "assistant"]),
        "max_tokens": {"type": "integer", "minimum": 1},
        "system": {"anyOf": [_STR, {"type": "array", "items": _OBJ}]}, **_SAMPLING,
        "stop_sequences": _nullable({"type": "array", "items": _TEXT, "maxItems": MAX_STOP_STRINGS}),
        "thinking": _nullable(_OBJ),
        "tools": _nullable({"type": "array", "items": _OBJ}), "output_format": _ANTHROPIC_FORMAT,
        "output_config": _nullable(_object([], {"format": _ANTHROPIC_FORMAT})), "session_id": _SESSION, **_CACHE, **_GUIDED}),
    "Message": _object(["id", "type", "role", "content", "model"], {
        "id": _STR, "type": {"const": "message"}, "role": {"const": "assistant"}, "model": _STR,
        "content": {"type": "array", "items": _OBJ}, "stop_reason": _nullable(_STR), "usage": _OBJ}),
    "Model": _object(["id", "object", "created", "owned_by"], {
        "id": _STR, "object": {"const": "model"}, "created": _INT, "owned_by": _STR, "max_model_len": _INT,
        "type": {"const": "model"}, "display_name": _STR, "created_at": _STR}),
    "ModelList": _object(["object", "data"], {
        "object": {"const": "list"}, "data": {"type": "array", "items": {"$ref": "#/components/schemas/Model"}},
        "has_more": _BOOL, "first_id": _STR, "last_id": _STR}),
    "Health": _object(["status"], {"status": {"enum": ["ok", "draining", "engine stopped", "engine stalled"]}}),
    "TokenizeRequest": {"oneOf": [
        _object(["prompt"], {"model": _STR, "prompt": _STR, "add_special_tokens": {"const": True},
                             "return_token_strs": _BOOL}, extra=False),
        _object(["messages"], {"model": _STR, "messages": _CHAT_MESSAGES, "return_token_strs": _BOOL})],
        "description": "vLLM's: a completions prompt, or a chat (with any chat field) rendered as chat renders it"},
    "TokenizeResponse": _object(["count", "max_model_len", "tokens"], {
        "count": _INT, "max_model_len": _INT, "tokens": {"type": "array", "items": _INT},
        "token_strs": {"type": "array", "items": _nullable(_STR)}}),
    "DetokenizeRequest": _object(["tokens"], {"model": _STR, "tokens": {"type": "array", "items": {
        "type": "integer", "minimum": 0}}}, extra=False),
    "DetokenizeResponse": _object(["prompt"], {"prompt": _STR}),
}

_ERRORS = {"400": "invalid JSON, an invalid or unsupported field (named in the error), a prompt longer than "
                  "the context, or a structured-output constraint that is invalid, asked for twice, or compiles "
                  "past the grammar compile timeout", "404": "unknown model",
           "413": "request body too large",
           "422": "the structured-output grammar failed while generating (`structured_output_failed`: a dead end "
                  "where no token is allowed); in a stream this is an error event instead",
           "429": "waiting queue full (see Retry-After)",
           "503": "shutting down (see Retry-After) or the engine has stopped"}


def _json(ref: str) -> dict:
    return {"schema": {"$ref": f"#/components/schemas/{ref}"}}


# OpenAPI 3.1 tools read an event-stream schema as the schema of one server-sent event
_SSE_EVENT = {"type": "object", "description": "one server-sent event; `data` holds the protocol's JSON chunk "
              "(or `[DONE]` for OpenAI chat and completions)",
              "properties": {"event": {"type": "string"}, "data": {"type": "string"}, "id": {"type": "string"},
                             "retry": {"type": "integer"}}}


def _generation(summary: str, request: str, response: str, error: str, stream: str) -> dict:
    responses = {"200": {"description": f"the result, or with `stream: true` {stream}",
                         "content": {"application/json": _json(response),
                                     "text/event-stream": {"schema": _SSE_EVENT}}}}
    responses.update({code: {"description": text, "content": {"application/json": _json(error)}}
                      for code, text in _ERRORS.items()})
    return {"summary": summary, "requestBody": {"required": True, "content": {"application/json": _json(request)}},
            "responses": responses}


def _tokenization(summary: str, request: str, response: str) -> dict:
    errors = {"400": "an invalid field (named), a token id outside the vocabulary, or a chat the recipe refuses",
              "404": "unknown model", "413": "request body too large"}
    responses = {"200": {"description": "the result", "content": {"application/json": _json(response)}}}
    responses.update({code: {"description": text, "content": {"application/json": _json("Error")}}
                      for code, text in errors.items()})
    return {"summary": summary, "requestBody": {"required": True, "content": {"application/json": _json(request)}},
            "responses": responses}


OPERATIONS: dict[str, dict] = {
    "chat": _generation("OpenAI Chat Completions (deepseek-recipe)", "ChatCompletionRequest", "ChatCompletion",
                        "Error", "`chat.completion.chunk` events ending with `data: [DONE]`"),
    "completions": _generation("OpenAI text completions, prompt as text or token ids", "CompletionRequest",
                               "Completion", "Error", "`text_completion` events ending with `data: [DONE]`"),
    "responses": _generation("OpenAI Responses (deepseek-recipe)", "ResponsesRequest", "Response", "Error",
                             "named `response.*` events"),
    "messages": _generation("Anthropic Messages (deepseek-recipe)", "MessagesRequest", "Message", "AnthropicError",
                            "named Messages events ending with `message_stop`"),
    "models": {"summary": "The served model", "responses": {
        "200": {"description": "a list of one model", "content": {"application/json": _json("ModelList")}}}},
    "model": {"summary": "One model by id", "responses": {
        "200": {"description": "the model", "content": {"application/json": _json("Model")}},
        "404": {"description": "unknown model", "content": {"application/json": _json("Error")}}}},
    "health": {"summary": "Liveness", "responses": {
        "200": {"description": "serving", "content": {"application/json": _json("Health")}},
        "503": {"description": "draining, the engine has stopped, or it has work and completes no step",
                "content": {"application/json": _json("Health")}}}},
    "metrics": {"summary": "Prometheus metrics", "responses": {"200": {"description": "Prometheus text format",
                                                                       "content": {"text/plain": {"schema": _STR}}}}},
    "health_head": {"summary": "Liveness, headers only (as GET /health, no body)", "responses": {
        "200": {"description": "serving"}, "503": {"description": "draining, stopped or stalled"}}},
    "metrics_head": {"summary": "Prometheus metrics, headers only", "responses": {"200": {"description": "up"}}},
    "tokenize": _tokenization("Token ids of a prompt or a chat (vLLM's /tokenize)", "TokenizeRequest",
                              "TokenizeResponse"),
    "detokenize": _tokenization("Text of token ids (vLLM's /detokenize)", "DetokenizeRequest", "DetokenizeResponse"),
    "openapi": {"summary": "This document", "responses": {"200": {"description": "OpenAPI 3.1",
                                                                  "content": {"application/json": {"schema": _OBJ}}}}},
}


def _path_parameters(path: str) -> tuple[str, list[dict]]:
    """aiohttp's `{name}` / `{name:regex}` templates as OpenAPI path templates and parameters."""
    names = re.findall(r"\{([^}:]+)(?::[^}]*)?\}", path)
    template = re.sub(r"\{([^}:]+)(?::[^}]*)?\}", r"{\1}", path)
    return template, [{"name": n, "in": "path", "required": True, "schema": _STR} for n in names]


def build_openapi(app: web.Application, config: ServerConfig, routes: tuple, plugin_routes: list) -> dict:
    """The document for `app`: the built-in `routes` (see `deepserve.server.routes.ROUTES`) and the routes
    plugins added, each with its statuses; `/v1/` operations carry the API-key requirement when one is set."""
    paths: dict[str, dict] = {}
    described = [(r.method, r.path, dict(OPERATIONS[r.operation], operationId=r.operation)) for r in routes]
    for name, method, path in plugin_routes:
        summary = f"added by the plugin route '{name}' (deepserve_register_routes)"
        described.append((method, path, {"summary": summary, "tags": ["plugins"],
                                         "responses": {"default": {"description": "defined by the plugin"}}}))
    for method, path, operation in described:
        template, parameters = _path_parameters(path)
        if parameters:
            operation = dict(operation, parameters=parameters)
        if config.api_key and path.startswith("/v1/"):
            operation = dict(operation, security=[{"bearer": []}, {"apiKey": []}])
            operation["responses"] = {**operation["responses"], "401": {
                "description": "missing or wrong API key", "content": {"application/json": _json(
                    "AnthropicError" if path.startswith("/v1/messages") else "Error")}}}
        paths.setdefault(template, {})[method.lower()] = operation
    components: dict[str, Any] = {"schemas": SCHEMAS}
    if config.api_key:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"},
                                         "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}}
    return {"openapi": "3.1.0", "info": {"title": "deepserve", "version": __version__,
                                         "description": f"serving {config.model_name}"},
            "paths": paths, "components": components}
