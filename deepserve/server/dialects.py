"""Fields clients send in spellings deepseek-recipe does not read, rewritten into the recipe's before it parses a
body, so a request means what its client meant. `rewrite(route, raw, body)` runs after the shared validation
(`deepserve.server.validation`, which has already judged each field's type and range) and returns the body
unchanged, bytes and all, when nothing needed rewriting:

- chat `max_completion_tokens` (OpenAI's current name for the output limit, sent by langchain, litellm, aiperf)
  wins over the deprecated `max_tokens` when both are given, as OpenAI documents; the recipe reads `max_tokens`;
- chat `chat_template_kwargs` (vLLM's switch, sent by lm-eval and vLLM users): `{"thinking": bool}` or
  `{"enable_thinking": bool}` becomes DeepSeek's `thinking: {"type": "enabled" | "disabled"}`, unless the
  request sets `thinking` itself. The recipe reads `thinking` before `reasoning_effort` (`"none"`: off), so the
  order is: `thinking`, then `chat_template_kwargs`, then `reasoning_effort`, then the server's default;
- the `developer` role (OpenAI's name for system instructions to reasoning models, sent by the openai SDK and
  litellm) is `system`, in chat `messages` and Responses `input` (the recipe refused it in chat and read it as
  `user` in Responses).
- chat `n` > 1 is the server's (`deepserve.server.fanout`: one engine request per choice), so the recipe, which
  refuses it, reads each choice's request without it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from deepserve.server.errors import ApiError
from deepserve.server.http import json_type

#: the `chat_template_kwargs` keys that switch thinking (DeepSeek's templates read `thinking`, Qwen's
#: `enable_thinking`; clients send either)
THINKING_KEYS = ("thinking", "enable_thinking")


def thinking_switch(kwargs: dict[str, Any], where: str) -> bool | None:
    """The thinking mode a `chat_template_kwargs` object asks for, None when it names none. ValueError when a
    key is not a boolean or the two keys disagree (`where`: the field's name, for the message)."""
    found = {}
    for key in THINKING_KEYS:
        value = kwargs.get(key)
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"'{where}.{key}' must be a boolean, got {json_type(value)}")
        if value is not None:
            found[key] = value
    if len(set(found.values())) > 1:
        raise ValueError(f"'{where}.thinking' and '{where}.enable_thinking' disagree")
    return next(iter(found.values()), None)


def _chat_template_kwargs(body: dict[str, Any]) -> bool:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return False
    if not isinstance(kwargs, dict):
        raise ApiError(400, f"'chat_template_kwargs' must be an object, got {json_type(kwargs)}",
                       param="chat_template_kwargs")
    try:
        switch = thinking_switch(kwargs, "chat_template_kwargs")
    except ValueError as exc:
        raise ApiError(400, str(exc), param="chat_template_kwargs") from None
    if switch is None or body.get("thinking") is not None:
        return False
    body["thinking"] = {"type": "enabled" if switch else "disabled"}
    return True

def _max_completion_tokens(body: dict[str, Any]) -> bool:
    limit = body.pop("max_completion_tokens", None)
    if limit is None:
        return False
    body["max_tokens"] = limit
    return True


def _fanned_out_n(body: dict[str, Any]) -> bool:
    return body.pop("n", None) is not None


def _developer_role(key: str) -> Callable[[dict[str, Any]], bool]:
    def rewrite_roles(body: dict[str, Any]) -> bool:
        items = body.get(key)
        if not isinstance(items, list) or not any(_is_developer(item) for item in items):
            return False
        body[key] = [{**item, "role": "system"} if _is_developer(item) else item for item in items]
        return True

    return rewrite_roles


def _is_developer(item: Any) -> bool:
    return isinstance(item, dict) and item.get("role") == "developer"


#: the rewrites each route applies (each changes the body it is given and says whether it did)
_REWRITES: dict[str, tuple[Callable[[dict[str, Any]], bool], ...]] = {
    "chat.completions": (_max_completion_tokens, _chat_template_kwargs, _developer_role("messages"), _fanned_out_n),
    "responses": (_developer_role("input"),),
}


def rewrite(route: str, raw: bytes, body: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
    """(raw, body) as deepseek-recipe should read them for `route` (a key of `validation.ROUTE_FIELDS`); `body`
    itself is never changed. Re-serializes only a body that changed (seconds for a huge one: call it off the
    event loop, as `RecipeCodec.prepare` is)."""
    new, changed = dict(body), False
    for fix in _REWRITES.get(route, ()):
        changed = fix(new) or changed
    if not changed:
        return raw, body
    return json.dumps(new, ensure_ascii=False).encode(), new
