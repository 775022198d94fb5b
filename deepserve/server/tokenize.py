"""vLLM's `POST /tokenize` and `POST /detokenize`, in vLLM's request and response shapes.

`/tokenize` takes either `prompt` (text, tokenized exactly as `/v1/completions` tokenizes it) or `messages` (a
chat conversation plus any chat field such as `tools` or `thinking`: rendered and encoded by deepseek-recipe
exactly as `/v1/chat/completions` would, so `count` is the prompt a chat request would send) and answers
`{"count", "max_model_len", "tokens"}`, with `token_strs` when `return_token_strs` is true. `/detokenize` takes
`tokens` (ids in the vocabulary) and answers `{"prompt": text}` (special tokens kept, so a round trip of
`/tokenize` gives the text back). `model` is optional; when given it must be the served one.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from deepserve.server.errors import ApiError
from deepserve.server.http import check_text, json_type, read_json_object
from deepserve.server.pool import run_in_pool
from deepserve.server.recipe import CHAT
from deepserve.server.state import MODEL, RECIPE, ModelInfo
from deepserve.server.validation import validate

_PROMPT_FIELDS = frozenset({"model", "prompt", "add_special_tokens", "return_token_strs"})


def _check_model(body: dict[str, Any], model: ModelInfo) -> None:
    name = body.get("model")
    if name is not None and name != model.name:
        raise ApiError(404, f"the model {name!r:.60} does not exist: this server serves '{model.name}'",
                       param="model", code="model_not_found")


async def tokenize(request: web.Request) -> web.Response:
    _, body = await read_json_object(request)
    model = request.app[MODEL]
    _check_model(body, model)
    strs = body.get("return_token_strs", False)
    if not isinstance(strs, bool):
        raise ApiError(400, f"'return_token_strs' must be a boolean, got {json_type(strs)}", param="return_token_strs")
    if ("prompt" in body) == ("messages" in body):
        raise ApiError(400, "give exactly one of 'prompt' (text) and 'messages' (a chat)", param="prompt")
    if "prompt" in body:
        ids = await run_in_pool(request.app, _prompt_ids, body, model)
    else:
        ids = await run_in_pool(request.app, _chat_ids, request.app[RECIPE], body, model)
    answer: dict[str, Any] = {"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids}
    if strs:
        answer["token_strs"] = [model.tokenizer.id_to_token(t) for t in ids]
    return web.json_response(answer, dumps=lambda x: json.dumps(x, ensure_ascii=False))


def _prompt_ids(body: dict[str, Any], model: ModelInfo) -> list[int]:
    for name in body:
        if name not in _PROMPT_FIELDS:
            raise ApiError(400, f"unrecognized field '{name}'", param=name, code="unknown_field")
    if body.get("add_special_tokens", True) is not True:
        raise ApiError(400, "'add_special_tokens' must be true: prompts are tokenized as /v1/completions does",
                       param="add_special_tokens")
    prompt = body["prompt"]
    if not isinstance(prompt, str):
        raise ApiError(400, f"'prompt' must be a string, got {json_type(prompt)}", param="prompt")
    if model.encoder is None:
        raise ApiError(400, "this model has no tokenizer", param="prompt")
    return model.encoder.encode(check_text(prompt, "prompt"))


def _chat_ids(recipe, body: dict[str, Any], model: ModelInfo) -> list[int]:
    chat = {key: value for key, value in body.items() if key != "return_token_strs"}
    chat["model"] = model.name
    validate("chat.completions", chat)
    prepared = recipe.prepare(CHAT, json.dumps(chat, ensure_ascii=False).encode(), chat, model)
    prepared.processor.close()
    return prepared.prompt_token_ids


async def detokenize(request: web.Request) -> web.Response:
    _, body = await read_json_object(request)
    model = request.app[MODEL]
    _check_model(body, model)
    for name in body:
        if name not in ("model", "tokens"):
            raise ApiError(400, f"unrecognized field '{name}'", param=name, code="unknown_field")
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise ApiError(400, f"'tokens' must be an array of token ids, got {json_type(tokens)}", param="tokens")
    bad = [t for t in tokens if not 0 <= t < model.vocab_size]
    if bad:
        raise ApiError(400, f"token id {bad[0]} is outside the vocabulary [0, {model.vocab_size})", param="tokens")
    if model.tokenizer is None:
        raise ApiError(400, "this model has no tokenizer", param="tokens")
    text = await run_in_pool(request.app, model.tokenizer.decode, tokens, False)
    return web.json_response({"prompt": text}, dumps=lambda x: json.dumps(x, ensure_ascii=False))
