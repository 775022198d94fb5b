"""One validation path for what the generation routes share: the same field gets the same answer on every route.

`validate(route, body)` runs on every generation route before the protocol's own parsing (deepseek-recipe's
for chat, Responses and Messages; `deepserve.server.completions` for completions), so a field that several
routes read is judged once, by one rule, with one message and `param`:

- the sampling fields (`seed` in [0, 2**63), `temperature` in [0, 2], `top_p` in (0, 1], `top_k` >= -1;
  deepseek-recipe's ranges for chat, now every route's), `n` (1 to `MAX_N`: the server fans a request out into
  n engine requests), `stream` (a boolean), the output
  limit (`max_tokens`, `max_completion_tokens`, `max_output_tokens`: at least 1; completions also take
  `max_tokens: 0` with `echo: true`, the prompt's logprobs alone, as lm-eval's loglikelihood asks), the penalties,
  `logit_bias` and `bad_words` (`deepserve.server.sampling_options`), stop strings (`stop`,
  Anthropic's `stop_sequences`: at most `MAX_STOP_STRINGS` non-empty strings); each route checks the ones
  it reads (`ROUTE_FIELDS`);
- image, audio and file parts, which the model cannot read (deepseek-recipe would put a placeholder such as
  `[Unsupported Image]` in the prompt): a 400 naming the part;
- Anthropic's message roles: only `user` and `assistant` (a system prompt goes in the top-level `system`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from deepserve.server.errors import ApiError
from deepserve.server.http import json_type

#: stop strings a request may give (deepseek-recipe's limit for chat and Messages, now every route's)
MAX_STOP_STRINGS = 16
MAX_SEED = 2**63  # exclusive: seeds are signed 64-bit integers >= 0
#: choices one request may ask for (`n`): each is its own engine request, and counts as one against the 429 bound
MAX_N = 128


def _is_int(value: Any) -> bool:
    return type(value) is int  # a JSON boolean is not an integer


def _is_number(value: Any) -> bool:
    return type(value) in (int, float)


def _check_seed(name: str, value: Any) -> None:
    if not (_is_int(value) and 0 <= value < MAX_SEED):
        raise ApiError(400, f"'{name}' must be an integer from 0 to 2**63 - 1, got {value!r:.40}", param=name)


def _check_temperature(name: str, value: Any) -> None:
    if not (_is_number(value) and 0 <= value <= 2):
        raise ApiError(400, f"'{name}' must be a number from 0 to 2, got {value!r:.40}", param=name)


def _check_top_p(name: str, value: Any) -> None:
    if not (_is_number(value) and 0 < value <= 1):
        raise ApiError(400, f"'{name}' must be a number greater than 0 and at most 1, got {value!r:.40}", param=name)


def _check_top_k(name: str, value: Any) -> None:
    if not (_is_int(value) and value >= -1):
        raise ApiError(400, f"'{name}' must be an integer >= -1 (0 or -1: no top-k), got {value!r:.40}", param=name)


def _check_n(name: str, value: Any) -> None:
    if not (_is_int(value) and 1 <= value <= MAX_N):
        raise ApiError(400, f"'{name}' must be an integer from 1 to {MAX_N}, got {value!r:.40}", param=name)


def _check_boolean(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be a boolean, got {json_type(value)}", param=name)


def _check_limit(name: str, value: Any) -> None:
    if not (_is_int(value) and value >= 1):
        raise ApiError(400, f"'{name}' must be an integer >= 1, got {value!r:.40}", param=name)


def _check_stop(name: str, value: Any, allow_string: bool = True) -> None:
    items = [value] if allow_string and isinstance(value, str) else value
    if not isinstance(items, list):
        shape = "a string or an array of strings" if allow_string else "an array of strings"
        raise ApiError(400, f"'{name}' must be {shape}, got {json_type(value)}", param=name)
    if len(items) > MAX_STOP_STRINGS:
        raise ApiError(400, f"'{name}' holds {len(items)} stop strings; at most {MAX_STOP_STRINGS} are allowed",
                       param=name)
    for i, item in enumerate(items):
        where = f"{name}[{i}]" if isinstance(value, list) else name
        if not isinstance(item, str) or not item:
            got = "an empty string" if item == "" else json_type(item)
            raise ApiError(400, f"'{where}' must be a non-empty string, got {got}", param=where)


def _check_penalty(name: str, value: Any) -> None:
    if not (_is_number(value) and -2 <= value <= 2):
        raise ApiError(400, f"'{name}' must be a number from -2 to 2, got {value!r:.40}", param=name)


def _check_repetition_penalty(name: str, value: Any) -> None:
    if not (_is_number(value) and 0 < value < float("inf")):
        raise ApiError(400, f"'{name}' must be a number greater than 0 (1: off), got {value!r:.40}", param=name)


def _check_logit_bias(name: str, value: Any) -> None:
    if not isinstance(value, dict):
        raise ApiError(400, f"'{name}' must be an object of token ids to numbers, got {json_type(value)}", param=name)
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit()):
            raise ApiError(400, f"'{name}' keys must be token ids, got {key!r:.40}", param=name)
        if not (_is_number(bias) and -100 <= bias <= 100):
            raise ApiError(400, f"'{name}[{key}]' must be a number from -100 to 100, got {bias!r:.40}", param=name)


def _check_bad_words(name: str, value: Any) -> None:
    if not (isinstance(value, list) and all(isinstance(w, str) and w for w in value)):
        raise ApiError(400, f"'{name}' must be an array of non-empty strings", param=name)


RULES: dict[str, Callable[[str, Any], None]] = {
    "presence_penalty": _check_penalty, "frequency_penalty": _check_penalty,
    "repetition_penalty": _check_repetition_penalty, "logit_bias": _check_logit_bias, "bad_words": _check_bad_words,
    "seed": _check_seed, "temperature": _check_temperature, "top_p": _check_top_p, "top_k": _check_top_k,
    "n": _check_n, "stream": _check_boolean, "max_tokens": _check_limit, "max_completion_tokens": _check_limit,
    "max_output_tokens": _check_limit, "stop": _check_stop,
    "stop_sequences": lambda name, value: _check_stop(name, value, allow_string=False),
}
_SAMPLING = ("seed", "temperature", "top_p", "top_k", "stream")
_PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "bad_words")
#: the shared fields each route reads (the names are each protocol's own)
ROUTE_FIELDS: dict[str, tuple[str, ...]] = {
    "chat.completions": (*_SAMPLING, *_PENALTIES, "n", "stop", "max_tokens", "max_completion_tokens"),
    "completions": (*_SAMPLING, *_PENALTIES, "n", "stop", "max_tokens"),
    "responses": (*_SAMPLING, *_PENALTIES, "max_output_tokens"),
    "messages": (*_SAMPLING, "stop_sequences", "max_tokens"),
}
#: content-part types that carry what this text-only model cannot read, per route: (what, the part's type)
_MEDIA_PARTS = {
    "chat.completions": {"image_url": "image", "input_audio": "audio", "file": "file"},
    "responses": {"input_image": "image", "input_file": "file", "input_audio": "audio"},
    "messages": {"image": "image", "document": "file"},
}


#: why a media kind is refused, where there is more to say than "text only"
_WHY = {"image": " (images need the vision-encoder role, which deepserve does not have yet)"}


def validate(route: str, body: dict[str, Any]) -> None:
    """400 `ApiError` for the first shared field of `body` that `route` reads and the rule refuses, a media
    part, or (Messages) a role other than user/assistant. `route`: a key of `ROUTE_FIELDS`."""
    for name in ROUTE_FIELDS[route]:
        if body.get(name) is not None and not _echo_only(route, name, body):
            RULES[name](name, body[name])
    if route == "messages":
        _check_anthropic_roles(body.get("messages"))
    media = _MEDIA_PARTS.get(route, {})
    for path, part in _content_parts(route, body):
        kind = media.get(part.get("type"))
        if kind is not None:
            raise ApiError(400, f"{kind} input is not supported yet: '{path}' is a {part['type']!r} part, and this "
                           f"server reads text only{_WHY.get(kind, '')}", param=path, code="unsupported")


def _echo_only(route: str, name: str, body: dict[str, Any]) -> bool:
    """A completions request for its prompt alone: `max_tokens: 0` with `echo: true`."""
    return route == "completions" and name == "max_tokens" and _is_int(body[name]) and body[name] == 0 \
        and body.get("echo") is True


def _check_anthropic_roles(messages: Any) -> None:
    for i, message in enumerate(messages if isinstance(messages, list) else ()):
        role = message.get("role") if isinstance(message, dict) else None
        if isinstance(role, str) and role not in ("user", "assistant"):
            hint = ": a system prompt goes in the top-level 'system' field" if role == "system" else ""
            raise ApiError(400, f"'messages[{i}].role' must be 'user' or 'assistant', got {role!r:.40}{hint}",
                           param=f"messages[{i}].role")


def _content_parts(route: str, body: dict[str, Any]) -> Iterator[tuple[str, dict]]:
    """(path, part) of every content part where `route`'s protocol puts them; a tool result's parts included."""
    top = "input" if route == "responses" else "messages"
    items = body.get(top)
    for i, item in enumerate(items if isinstance(items, list) else ()):
        if not isinstance(item, dict):
            continue
        for key in ("content", "output"):  # Responses: a function_call_output's output may hold parts too
            yield from _parts(f"{top}[{i}].{key}", item.get(key), nested=route == "messages")


def _parts(path: str, parts: Any, nested: bool) -> Iterator[tuple[str, dict]]:
    for j, part in enumerate(parts if isinstance(parts, list) else ()):
        if isinstance(part, dict):
            yield f"{path}[{j}]", part
            if nested and part.get("type") == "tool_result":  # Anthropic: a tool result holds its own blocks
                yield from _parts(f"{path}[{j}].content", part.get("content"), nested=False)
