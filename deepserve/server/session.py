"""The session a request continues: `session_id` (a top-level field on every generation route, an extension as
SGLang and DeepInfer take one) or the Responses API's `conversation` (a string or `{"id": ...}`). The engine keys
its SWA host slots by it (docs/cache.md): the next turn of the same session restores the window state past its
last full page instead of recomputing that tail. The server stores no conversation items: a client still sends
the whole conversation each turn, and `conversation` only names whose slot the turn continues."""

from __future__ import annotations

from typing import Any

from deepserve.server.errors import ApiError
from deepserve.server.http import json_type

#: the longest session id accepted (OpenAI's conversation ids are about 50 characters)
MAX_SESSION_ID_LENGTH = 256


def session_of(route: str, body: dict[str, Any]) -> str | None:
    """The request's session id, None when it names none. 400 for one that is not a non-empty string of at most
    `MAX_SESSION_ID_LENGTH` characters, a `conversation` without a string `id`, or both fields naming different
    sessions. `route`: a key of `deepserve.server.validation.ROUTE_FIELDS` (only Responses reads `conversation`)."""
    session = body.get("session_id")
    if session is not None:
        _check(session, "session_id")
    conversation = body.get("conversation") if route == "responses" else None
    if conversation is None:
        return session
    if isinstance(conversation, dict):
        param = "conversation.id"
        conversation = conversation.get("id")
        if conversation is None:
            raise ApiError(400, "'conversation' must be a conversation id or an object with an 'id'", param=param)
    else:
        param = "conversation"
    _check(conversation, param)
    if session is not None and session != conversation:
        raise ApiError(400, f"'session_id' ({session!r:.40}) and '{param}' ({conversation!r:.40}) name different "
                       "sessions: send one of them", param="session_id")
    return conversation


def _check(value: Any, param: str) -> None:
    if not isinstance(value, str):
        raise ApiError(400, f"'{param}' must be a string, got {json_type(value)}", param=param)
    if not value:
        raise ApiError(400, f"'{param}' must not be empty", param=param)
    if len(value) > MAX_SESSION_ID_LENGTH:
        raise ApiError(400, f"'{param}' is {len(value)} characters long; at most {MAX_SESSION_ID_LENGTH} are allowed",
                       param=param)
