"""Structured output over HTTP: which field of a request asks for a constraint, the constraint as the engine's
`GrammarSpec`, its compile before the request is admitted, and how a grammar failure ends a response.

Where a request can ask (exactly one of them per request; two are a 400 that names both):

- OpenAI `response_format` (chat: converted by deepseek-recipe, which also checks OpenAI's rules; completions:
  read here): `{"type": "json_object"}` -> any JSON object, `{"type": "json_schema", "json_schema": {"schema": S,
  "strict": ...}}` -> an instance of S, `{"type": "regex", "regex": R}` (DeepSeek's) -> a full match of R,
  `{"type": "text"}` -> no constraint;
- OpenAI Responses `text.format` (deepseek-recipe: `json_object`, `json_schema`);
- Anthropic `output_format` / `output_config.format` `{"type": "json_schema", "schema": S}` (read here:
  deepseek-recipe drops it);
- on every generation route, vLLM's `structured_outputs` (`{"json" | "json_object" | "regex" | "grammar" |
  "choice": ..., "backend": ...}`, see `deepserve.core.structured.GrammarSpec.parse`) and its older
  `guided_json`, `guided_regex`, `guided_grammar`, `guided_choice` (with `guided_decoding_backend`).

A constrained request in thinking mode (it asked for thinking: see `deepserve.server.recipe`) is constrained after
its thinking section: `after_thinking` sets the spec's `after_token` to the id of `</think>`, so the reasoning is
free and the answer follows the constraint.

The backend: the server's `--structured-outputs-backend` (the engine's default), or per request
`structured_outputs.backend` / `guided_decoding_backend`; an unknown one is a 400 naming it.

`compile_grammar` compiles on the engine's grammar compiler (its thread pool and cache; the engine then finds the
grammar ready) and turns an invalid schema, regex or grammar, an unknown backend or a compile past
`grammar_compile_timeout` into a 400 naming the problem. A grammar that fails while generating (a dead end: no
token allowed) finishes the engine request with finish_reason "abort" and a `GRAMMAR_ERROR_PREFIX` stop reason;
`grammar_failure` makes that a 422 (`structured_output_failed`), or the protocol's error event in a stream.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import web

from deepserve.core.outputs import CompletionOutput
from deepserve.core.grammar_compiler import GrammarBusy, timeout_message
from deepserve.core.structured import GrammarError, GrammarSpec, GrammarTimeout
from deepserve.server.errors import ApiError, presented_api_keys
from deepserve.server.http import json_type

try:  # where the engine defines it (deepserve.core.tracking today)
    from deepserve.core.structured import GRAMMAR_ERROR_PREFIX  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - depends on the engine's layout
    from deepserve.core.tracking import GRAMMAR_ERROR_PREFIX

logger = logging.getLogger(__name__)

#: vLLM's older request fields -> the `structured_outputs` key each one stands for
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_grammar": "grammar",
                 "guided_choice": "choice"}
BACKEND_FIELD = "guided_decoding_backend"
#: the request-body fields `body_constraints` reads (on every generation route)
EXTENSION_FIELDS = ("structured_outputs", *GUIDED_FIELDS, BACKEND_FIELD)
#: `response_format` types /v1/completions accepts (chat's are deepseek-recipe's: the same four)
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema", "regex")
#: the status of a response whose grammar failed while generating (the request itself was valid)
GRAMMAR_FAILURE_STATUS = 422
#: the text of the token that ends a thinking section in DeepSeek-V4's chat format
THINKING_END = "</think>"


@dataclass(slots=True)
class Constraint:
    """A request's constraint: the field that asked for it (for error messages) and the `structured_outputs`
    dict it stands for."""

    field: str
    value: dict[str, Any]


def body_constraints(body: Mapping[str, Any]) -> list[Constraint]:
    """The constraints a body asks for through `structured_outputs` and `guided_*` (validated shapes; the
    values themselves are checked by `to_spec` and the compile). `guided_decoding_backend` applies to them."""
    found = []
    value = body.get("structured_outputs")
    if value is not None:
        if not isinstance(value, dict):
            raise ApiError(400, f"'structured_outputs' must be an object such as {{\"json\": schema}}, got "
                           f"{json_type(value)}", param="structured_outputs")
        found.append(Constraint("structured_outputs", {k: v for k, v in value.items() if v is not None}))
    for name, kind in GUIDED_FIELDS.items():
        if body.get(name) is not None:
            found.append(Constraint(name, {kind: body[name]}))
    backend = body.get(BACKEND_FIELD)
    if backend is not None:
        if not isinstance(backend, str) or not backend:
            raise ApiError(400, f"'{BACKEND_FIELD}' must be a non-empty string, got {json_type(backend)}",
                           param=BACKEND_FIELD)
        for constraint in found:
            named = constraint.value.get("backend")
            if named is not None and named != backend:
                raise ApiError(400, f"'{BACKEND_FIELD}' ({backend!r}) disagrees with {constraint.field}.backend "
                               f"({named!r})", param=BACKEND_FIELD)
            constraint.value["backend"] = backend
    return found


def response_format_constraint(value: Any, field: str = "response_format") -> Constraint | None:
    """OpenAI's `response_format` (and DeepSeek's `regex` type), read by the server itself (/v1/completions)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ApiError(400, f"'{field}' must be an object such as {{\"type\": \"json_object\"}}, got "
                       f"{json_type(value)}", param=field)
    kind = value.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise ApiError(400, f"'{field}.type' must be one of {list(RESPONSE_FORMAT_TYPES)}, got {kind!r}",
                       param=field)
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint(field, {"json_object": True})
    if kind == "regex":
        regex = value.get("regex")
        if not isinstance(regex, str) or not regex:
            raise ApiError(400, f"'{field}.regex' must be a non-empty string, got {json_type(regex)}", param=field)
        return Constraint(field, {"regex": regex})
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise ApiError(400, f"'{field}.json_schema' must be an object with a 'schema', got {json_type(spec)}",
                       param=field)
    if not isinstance(spec.get("schema"), (dict, bool)):
        raise ApiError(400, f"'{field}.json_schema.schema' must be a JSON schema (an object), got "
                       f"{json_type(spec.get('schema'))}", param=field)
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise ApiError(400, f"'{field}.json_schema.strict' must be a boolean, got {json_type(spec['strict'])}",
                       param=field)
    return Constraint(field, {"json": spec["schema"]})


def anthropic_constraints(body: Mapping[str, Any]) -> list[Constraint]:
    """Anthropic's structured outputs, `output_format` (beta) and `output_config.format`: `{"type":
    "json_schema", "schema": S}`. deepseek-recipe does not carry them, so the server reads them."""
    found = []
    config = body.get("output_config")
    candidates = [("output_format", body.get("output_format"))]
    if isinstance(config, dict):
        candidates.append(("output_config.format", config.get("format")))
    for field, value in candidates:
        if value is None:
            continue
        if not isinstance(value, dict) or value.get("type") != "json_schema":
            raise ApiError(400, f"'{field}' must be {{\"type\": \"json_schema\", \"schema\": {{...}}}}", param=field)
        if not isinstance(value.get("schema"), (dict, bool)):
            raise ApiError(400, f"'{field}.schema' must be a JSON schema (an object), got "
                           f"{json_type(value.get('schema'))}", param=field)
        found.append(Constraint(field, {"json": value["schema"]}))
    return found


def recipe_constraint(constraint: Any, field: str) -> Constraint | None:
    """deepseek-recipe's `OutputConstraint` (kind json with a schema, or "" for any JSON; regex). Tool-call
    constraints are not enforced (None)."""
    if constraint is None:
        return None
    if constraint.kind == "json":
        # "" is the recipe's JSON mode (`json_object`): OpenAI and DeepSeek promise a JSON object there
        return Constraint(field, {"json_object": True} if not constraint.schema else {"json": constraint.schema})
    if constraint.kind == "regex":
        return Constraint(field, {"regex": constraint.schema})
    return None


def single(constraints: list[Constraint | None]) -> Constraint | None:
    """The one constraint a request asks for; 400 naming the fields when there are several."""
    present = [c for c in constraints if c is not None]
    if len(present) > 1:
        names = ", ".join(f"'{c.field}'" for c in present)
        raise ApiError(400, f"structured output is asked for by more than one field ({names}): send only one",
                       param=present[1].field, code="conflicting_structured_outputs")
    return present[0] if present else None


def to_spec(constraint: Constraint) -> GrammarSpec:
    """The engine's spec; 400 naming the field for a malformed value."""
    try:
        return GrammarSpec.parse(constraint.value)
    except (ValueError, TypeError, RecursionError) as exc:
        message = str(exc)
        if constraint.field != "structured_outputs":
            message = message.replace("structured_outputs", f"'{constraint.field}' (as structured_outputs)", 1)
        raise ApiError(400, message, param=constraint.field) from None


def after_thinking(spec: GrammarSpec, thinking_end_ids: Sequence[int], field: str) -> GrammarSpec:
    """`spec` applied after the thinking section: from the token after `</think>` (`thinking_end_ids`: how the
    model's tokenizer encodes `</think>`, which must be one token). 400 when the tokenizer has no such token."""
    if len(thinking_end_ids) != 1:
        raise ApiError(400, f"'{field}' asks for structured output after a thinking section, but this model's "
                       f"tokenizer has no single {THINKING_END} token: disable thinking for this request",
                       param=field, code="unsupported")
    return replace(spec, after_token=thinking_end_ids[0])


def client_of(request: web.Request) -> str:
    """Who sent a request, for per-client fairness: a digest of its API key, else its address."""
    keys = presented_api_keys(request)
    if keys:
        return "key:" + hashlib.sha256(keys[0].encode()).hexdigest()[:16]
    return f"addr:{request.remote}"


async def compile_grammar(engine: Any, spec: GrammarSpec, field: str, client: str | None = None) -> None:
    """Compile `spec` on the compiler of `engine` (the `EngineCore`) before the request is admitted; 400 naming
    the problem when it cannot be (no grammar backend, an unknown backend, an invalid schema/regex/grammar, a
    compile past the timeout), 429 when `client` (`client_of`) already has its share of compiles in flight."""
    grammars = getattr(engine, "grammars", None)
    if grammars is None:
        raise ApiError(400, "structured output needs a grammar backend, and this server has none (the model has no "
                       "tokenizer.json, or no grammar backend plugin is installed)", param=field,
                       code="structured_outputs_unavailable")
    try:
        waiter = asyncio.wrap_future(grammars.submit(spec, client))
        waiter.add_done_callback(_consume)  # a compile that outlives this request must not log its error unread
        # shield: neither a client that leaves nor the timeout may cancel a compile the cache shares
        await asyncio.wait_for(asyncio.shield(waiter), grammars.timeout)
    except TimeoutError:
        grammars.forget(spec)  # the late result is not kept for a request that has failed
        raise ApiError(400, timeout_message(spec, grammars.timeout), param=field,
                       code="grammar_compile_timeout") from None
    except asyncio.CancelledError:
        raise
    except GrammarBusy as exc:
        raise ApiError(429, str(exc), param=field, code="too_many_grammar_compiles",
                       headers={"Retry-After": "1"}) from None
    except GrammarTimeout as exc:  # stopped in its compile process at the timeout
        raise ApiError(400, str(exc), param=field, code="grammar_compile_timeout") from None
    except GrammarError as exc:
        raise ApiError(400, f"invalid structured output in '{field}': {exc}", param=field,
                       code="invalid_structured_output") from None
    except BaseException as exc:  # a grammar engine's own failure (a Rust panic included) on the user's spec
        if not isinstance(exc, Exception) and type(exc).__name__ != "PanicException":
            raise
        logger.warning("deepserve: compiling a %s failed: %r", spec.description, exc)
        raise ApiError(400, f"invalid structured output in '{field}': the {spec.description} could not be "
                       f"compiled ({type(exc).__name__}: {exc})", param=field,
                       code="invalid_structured_output") from None


def _consume(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


def grammar_failure(completion: CompletionOutput, field: str | None = None) -> ApiError | None:
    """The error for an output its grammar ended (finish_reason "abort", stop_reason "structured output: ..."),
    else None. `field` names the field that asked for the constraint."""
    reason = completion.stop_reason
    if completion.finish_reason != "abort" or not isinstance(reason, str) or not reason.startswith(
            GRAMMAR_ERROR_PREFIX):
        return None
    return ApiError(GRAMMAR_FAILURE_STATUS, f"generation stopped: {reason} ({len(completion.token_ids)} tokens "
                    "were generated)", param=field, code="structured_output_failed")

