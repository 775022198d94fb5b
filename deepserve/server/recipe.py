"""The three protocols deepseek-recipe speaks: OpenAI Chat Completions, OpenAI Responses, Anthropic Messages.

The recipe parses and converts a request into a conversation, renders and encodes the V4 prompt, resolves
`max_tokens` against the context, and its stream processor turns output tokens back into protocol chunks
(reasoning content, tool calls, stop sequences, usage with cached tokens). deepserve adds only what the recipe
leaves to its caller: which model names it serves, options the engine cannot honour (a 400 that names them),
the prompt-length check, the field a parse error is about, and structured output: the recipe's
`output_constraint` (and the fields it does not read: see `deepserve.server.structured`) becomes the request's
`SamplingParams.structured_outputs`. A constrained request runs without thinking unless it asks for thinking
explicitly; then the constraint applies after the thinking section (`deepserve.server.structured.after_thinking`).
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import deepseek_recipe as dr

from deepserve.core.sampling_params import SamplingParams
from deepserve.core.structured import GrammarSpec
from deepserve.model.registry import checkpoint_model_type
from deepserve.server.config import DEFAULT_MAX_TOKENS
from deepserve.server.dialects import rewrite
from deepserve.server.usage import OutputUsage
from deepserve.server.errors import ApiError, sampling_error
from deepserve.server.sampling_options import cache_fields, penalty_fields, sibling_params
from deepserve.server.session import session_of
from deepserve.server.tool_calls import DSML, auto_choice, forced_tools, parallel_allowed, tool_call_spec
from deepserve.server.structured import THINKING_END, Constraint, after_thinking, anthropic_constraints, \
    body_constraints, recipe_constraint, single, to_spec

if TYPE_CHECKING:  # pragma: no cover - annotations only
    from deepserve.server.state import ModelInfo

_present: Callable[[Any], bool] = lambda v: v is not None  # noqa: E731
_nonempty: Callable[[Any], bool] = lambda v: bool(v)  # noqa: E731


@dataclass(frozen=True, slots=True)
class Protocol:
    """One protocol: its recipe types, the id prefix of its responses, a minimal valid body (to find which field a
    parse error is about), where it asks for structured output, and the options the engine cannot honour."""

    name: str
    request_type: type
    response_type: type
    id_prefix: str
    skeleton: dict[str, Any]
    constraint_field: str
    unsupported: dict[str, Callable[[Any], bool]]


_MESSAGES = [{"role": "user", "content": "x"}]
CHAT = Protocol("chat.completions", dr.ChatCompletionRequest, dr.ChatCompletionResponse, "chatcmpl-",
                {"model": "m", "messages": _MESSAGES}, "response_format",
                {"audio": _present, "prediction": _present, "web_search_options": _present,
                 "modalities": lambda v: v is not None and v != ["text"]})
RESPONSES = Protocol("responses", dr.ResponsesRequest, dr.ResponsesResponse, "resp_",
                     {"model": "m", "input": "x"}, "text.format",
                     {"previous_response_id": _present, "prompt": _present,
                      "background": _nonempty})
MESSAGES = Protocol("messages", dr.MessagesRequest, dr.MessagesResponse, "msg_",
                    {"model": "m", "messages": _MESSAGES, "max_tokens": 1}, "output_format",
                    {"container": _present, "mcp_servers": _nonempty})


@dataclass(slots=True)
class Prepared:
    """A converted request, ready for the engine: prompt ids, sampling parameters, its stream processor and the
    counter of its output usage. `constraint_field` names the field that asked for `params.structured_outputs` (None: unconstrained);
    `session_id`: the session whose SWA host slot it continues (`deepserve.server.session`)."""

    protocol: Protocol
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    processor: dr.StreamProcessor
    usage: OutputUsage
    constraint_field: str | None = None
    fork: Callable[[], tuple[dr.StreamProcessor, OutputUsage]] | None = None
    n: int = 1
    session_id: str | None = None

    def sibling(self, index: int) -> Prepared:
        """Choice `index` of an `n` > 1 request: its own stream processor and usage, the same prompt, and
        `seed + index` when seeded (`deepserve.server.completion_choices.sibling_params`)."""
        processor, usage = self.fork()
        return dataclasses.replace(self, processor=processor, usage=usage,
                                   params=sibling_params(self.params, index))


class RecipeCodec:
    """deepseek-recipe set up for the served model: its tokenizer, the prompt encoding of its version (V4, or
    V4.1 for a `deepseek_v41` checkpoint), conversion options that accept exactly the served model name.
    `unavailable` says why chat cannot work with this tokenizer."""

    def __init__(self, model_dir: str, model_name: str, default_thinking_mode: bool,
                 default_max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        v41 = checkpoint_model_type(model_dir) == "deepseek_v41"
        self.version = dr.ModelVersion.DeepseekV41Flash if v41 else dr.ModelVersion.DeepseekV4Pro
        self.default_thinking_mode = default_thinking_mode
        self.options = {mode: self._options(mode) for mode in (False, True)}
        file = Path(model_dir) / "tokenizer.json"
        self.tokenizer = dr.Tokenizer.from_file(str(file)) if file.is_file() else None
        encoding = dr.DeepseekV41Encoding() if v41 else dr.DeepseekV4Encoding()
        self.encoding = encoding.with_tokenizer(self.tokenizer) if self.tokenizer else None
        self.thinking_end_ids = self.tokenizer.encode(THINKING_END) if self.tokenizer else []
        dsml = self.tokenizer.encode(DSML) if self.tokenizer else []
        self.dsml_id = dsml[0] if len(dsml) == 1 else None  # V4's tool-call marker, one special token
        self.unavailable = self._probe()

    def _options(self, default_thinking_mode: bool) -> dr.ConversionOptions:
        return dr.ConversionOptions(default_thinking_mode=default_thinking_mode) \
            .with_model_versions_by_name({self.model_name: self.version})

    def _probe(self) -> str | None:
        if self.encoding is None:
            return "this model has no tokenizer.json, so it cannot render chat prompts: use /v1/completions"
        try:
            self.encoding.encode(dr.Conversation([dr.UserMessage("x")], thinking_mode=True))
        except RuntimeError as exc:
            name = "V4.1" if self.version == dr.ModelVersion.DeepseekV41Flash else "V4"
            return f"this model's tokenizer cannot encode {name} chat prompts ({exc}): use /v1/completions"
        return None

    def prepare(self, protocol: Protocol, raw: bytes, body: dict[str, Any], model: ModelInfo) -> Prepared:
        """Convert one request body (already checked to name the served model). Raises `ApiError` (4xx).
        Seconds for a long prompt (rendering and tokenizing it): the server calls it on its thread pool."""
        if self.unavailable:
            raise ApiError(400, self.unavailable, code="chat_not_supported")
        for name, is_set in protocol.unsupported.items():
            if is_set(body.get(name)):
                raise ApiError(400, f"'{name}' is not supported by this server", param=name, code="unsupported")
        if protocol is MESSAGES and body.get("max_tokens") is None:  # required by Anthropic's API and our document
            raise ApiError(400, "'max_tokens' is required", param="max_tokens", code="missing_required_parameter")
        n = (body.get("n") or 1) if protocol is CHAT else 1  # validated: 1 to MAX_N; the rewrite drops it
        session_id = session_of(protocol.name, body)
        raw, body = rewrite(protocol.name, raw, body)
        forced = forced_tools(protocol.name, body)
        request = _recipe(lambda: protocol.request_type(raw), protocol, body)
        echo = _recipe(request.echo, protocol, body) if protocol is RESPONSES else None
        default_thinking = self.thinking_default(protocol)
        tool_map = _recipe(lambda: request.namespace_tool_map(self.options[default_thinking]), protocol, body) \
            if protocol is RESPONSES else None
        if forced is None:
            conv = _recipe(lambda: request.convert(self.options[default_thinking]), protocol, body)
            tool = None
        else:
            conv, tool = self._forced_tool_conversion(protocol, raw, body, forced)
        constraint = _constraint(protocol, conv, body, tool)
        spec = to_spec(constraint) if constraint is not None else None
        if constraint is not None and conv.conversation.thinking_mode and default_thinking and forced is None:
            conv = self._constrained_conversion(protocol, raw, body)
        if constraint is not None and conv.conversation.thinking_mode:  # asked for: constrained after the thinking
            spec = after_thinking(spec, self.thinking_end_ids, constraint.field)
        rendered = _recipe(lambda: self.encoding.render_conversation(conv.conversation), protocol, body)
        model.check_prompt_text(rendered.prompt)  # milliseconds; tokenizing an oversized prompt takes seconds
        ids = _recipe(lambda: self.encoding.encode(conv.conversation), protocol, body)
        model.check_prompt(ids)
        max_tokens = self._max_tokens(conv, protocol, body, len(ids), model.max_model_len,
                                      self.default_max_tokens if model.default_max_tokens is None
                                      else model.default_max_tokens)
        params = model.fit_params(_sampling_params(conv.inference_options, max_tokens, body, spec,
                                                   model.default_fields))
        request_id = f"{protocol.id_prefix}{uuid.uuid4().hex}"

        def fork() -> tuple[dr.StreamProcessor, OutputUsage]:
            generator = protocol.request_type.chunk_generator(conv, request_id, self.model_name)
            if echo is not None:
                generator = generator.with_echo(echo)
            if tool_map:
                generator = generator.with_namespace_tool_map(tool_map)
            stage = conv.parsing_options.thinking_initial_stage
            end_id = self.thinking_end_ids[0] if len(self.thinking_end_ids) == 1 else None
            return (dr.StreamProcessor(generator, conv.parsing_options, self.tokenizer),
                    OutputUsage(stage is not None and stage.starts_in_reasoning(), end_id))

        processor, usage = fork()
        return Prepared(protocol, request_id, ids, params, conv.stream, processor, usage,
                        constraint.field if constraint is not None else None, fork, n, session_id)

    def _max_tokens(self, conv: dr.ConversationRequest, protocol: Protocol, body: dict[str, Any],
                    num_prompt_tokens: int, max_model_len: int, default: int) -> int:
        """The request's own limit (past the context: the recipe's 400), else `default` (the model's
        `max_new_tokens`, else `default_max_tokens`) lowered to the context the prompt leaves (the recipe's own
        default would be 8,192, or 65,536 tokens when thinking)."""
        if conv.inference_options.max_tokens is not None:
            return _recipe(lambda: conv.resolve_max_tokens(num_prompt_tokens, max_model_len), protocol, body)
        return max(1, min(default, max_model_len - num_prompt_tokens))

    def thinking_default(self, protocol: Protocol) -> bool:
        """The thinking mode of a request that does not choose: the server's, except on Messages, where Anthropic's
        API thinks only when the request asks (`thinking`), whatever the server's default."""
        return False if protocol is MESSAGES else self.default_thinking_mode

    def _forced_tool_conversion(self, protocol: Protocol, raw: bytes, body: dict[str, Any],
                                forced: tuple[str, ...]) -> tuple[dr.ConversationRequest, Constraint]:
        """A request whose `tool_choice` forces a call: converted without thinking unless it asks for thinking
        itself (as constrained requests are), its prompt then ending inside the call block the grammar
        continues. The recipe refuses forced calls with thinking, so a request that asks for thinking is converted
        as `auto` and the grammar, opening the block itself, applies after `</think>`."""
        parallel = parallel_allowed(protocol.name, body)
        try:
            conv = _recipe(lambda: protocol.request_type(raw).convert(self.options[False]), protocol, body)
            open_block = False
        except ApiError as error:
            if "thinking" not in error.message.lower():  # the recipe's refusal of a forced call while thinking
                raise
            auto = json.dumps({**body, "tool_choice": auto_choice(protocol.name)}, ensure_ascii=False).encode()
            conv = _recipe(lambda: protocol.request_type(auto).convert(self.options[True]), protocol, body)
            open_block = True
        found = conv.inference_options.output_constraint
        tools = json.loads(found.schema) if found is not None and found.kind.startswith("tool_call") else []
        spec = tool_call_spec(tools, forced, self.dsml_id, parallel, open_block)
        return conv, Constraint("tool_choice", {"grammar": spec.spec, "backend": spec.backend})

    def _constrained_conversion(self, protocol: Protocol, raw: bytes, body: dict[str, Any]) -> dr.ConversationRequest:
        """The conversion of a constrained request whose thinking came from the server's default: without thinking
        (a constrained answer then starts at once); a request that asked for thinking keeps it."""
        request = _recipe(lambda: protocol.request_type(raw), protocol, body)
        return _recipe(lambda: request.convert(self.options[False]), protocol, body)


def _constraint(protocol: Protocol, conv: dr.ConversationRequest, body: dict[str, Any],
                tool: Constraint | None = None) -> Constraint | None:
    """The one constraint of a request: the recipe's `output_constraint` (`response_format`, `text.format`),
    Anthropic's output format (which the recipe does not carry), the `structured_outputs` / `guided_*`
    extension fields, or a forced tool call (`tool`, `deepserve.server.tool_calls`). The tool-call constraints
    the recipe reports for `auto` are not enforced: the model chooses, the recipe parses what it writes."""
    found = [tool, recipe_constraint(conv.inference_options.output_constraint, protocol.constraint_field)]
    if protocol is MESSAGES:
        found += anthropic_constraints(body)
    return single(found + body_constraints(body))


def _sampling_params(options: dr.InferenceOptions, max_tokens: int, body: dict[str, Any],
                     structured_outputs: GrammarSpec | None = None,
                     defaults: dict[str, Any] | None = None) -> SamplingParams:
    """The recipe's options plus what it does not carry: `top_k` on every protocol, `seed` on Responses and
    Messages (validated with the other routes' fields: `deepserve.server.validation`), and the penalties,
    `logit_bias` and `bad_words` (`PENALTY_FIELDS`; Messages has none), and `cache_ttl` (`CACHE_FIELDS`, on every
    protocol). `defaults`: the model's sampling defaults (generation_config.json) for the fields the request
    leaves out (but `max_tokens`). `detokenize=False`: the stream processor
    decodes the token ids itself, so the engine does not decode them a second time."""
    logprobs = (options.top_logprobs or 0) if options.logprobs else None
    top_k, seed = body.get("top_k"), options.seed if options.seed is not None else body.get("seed")
    # the recipe fills temperature and top_p with 1.0 when the body has none (and leaves them out when thinking):
    # only the body's own values win over the model's defaults
    given = {name: getattr(options, name) if body.get(name) is not None else None for name in ("temperature", "top_p")}
    given["top_k"] = top_k
    fields = (defaults or {}) | {name: value for name, value in given.items() if value is not None} \
        | penalty_fields(body)
    try:
        return SamplingParams(seed=seed, max_tokens=max_tokens, logprobs=logprobs,
                              structured_outputs=structured_outputs, detokenize=False, **fields, **cache_fields(body))
    except ValueError as exc:
        raise sampling_error(exc) from None


def _recipe(call: Callable[[], Any], protocol: Protocol, body: dict[str, Any]) -> Any:
    """Run one recipe step; its errors become 4xx `ApiError`s (parse errors name the field they are about)."""
    try:
        return call()
    except dr.ConversionError as exc:
        status = exc.status_code if 400 <= exc.status_code < 500 else 400
        raise ApiError(status, _conversion_message(exc)) from None
    except ValueError as exc:  # a body the recipe cannot parse
        field = _locate_field(protocol, body)
        detail = str(exc).removeprefix("invalid request body: ")
        raise ApiError(400, f"invalid '{field}': {detail}" if field else detail, param=field) from None
    except RuntimeError as exc:  # prompt encoding failed
        raise ApiError(400, f"cannot encode the prompt: {exc}") from None
    except BaseException as exc:  # a Rust panic (pyo3's PanicException derives from BaseException)
        if type(exc).__name__ != "PanicException":
            raise
        raise ApiError(400, "the request could not be converted (deepseek-recipe rejected it)") from None


def _conversion_message(exc: dr.ConversionError) -> str:
    try:
        return json.loads(exc.body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return str(exc)


def _locate_field(protocol: Protocol, body: dict[str, Any], limit: int = 64) -> str | None:
    """The first top-level field that alone makes a minimal valid body unparseable (serde names no paths)."""
    for key in list(body)[:limit]:
        try:
            protocol.request_type(json.dumps({**protocol.skeleton, key: body[key]}))
        except Exception:  # noqa: BLE001 - any failure implicates this field
            return key
    return None
