"""Request bodies in, server-sent events out: the HTTP details every endpoint shares."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from deepserve.server.errors import ApiError

SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


async def read_json_object(request: web.Request) -> tuple[bytes, dict[str, Any]]:
    """The raw body and its parse. 413 past the app's size limit; 400 for anything but a JSON object (NaN and
    Infinity are not JSON). Strings may still hold unpaired UTF-16 surrogates (`"\\ud800"`): see `check_text`."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise ApiError(413, f"request body too large: {exc.text}", code="request_too_large") from None
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except UnicodeDecodeError:
        raise ApiError(400, "invalid JSON: the request body is not UTF-8 text", code="invalid_json") from None
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, f"invalid JSON in the request body: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {json_type(body)}", code="invalid_json")
    return raw, body


def check_text(value: str, param: str) -> str:
    """400 for a string that cannot be UTF-8 (an unpaired surrogate escape), before it reaches a tokenizer."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, f"'{param}' contains an unpaired UTF-16 surrogate", param=param) from None
    return value


def json_type(value: Any) -> str:
    """The JSON name of a parsed value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


def sse_message(data: str, event: str | None = None) -> bytes:
    """One server-sent event; every line of `data` gets its own `data:` field, as the SSE format requires."""
    head = f"event: {event}\n" if event else ""
    return (head + "".join(f"data: {line}\n" for line in data.split("\n")) + "\n").encode("utf-8")


async def open_sse(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(status=200, headers=SSE_HEADERS)
    await response.prepare(request)
    return response
