"""The real `deepserve serve` process on loopback, spoken to the way users speak to it (issue 4, item 5):

- the official `openai` client (chat completions, completions, responses, models; streaming and not) and the
  official `anthropic` client (messages, models; streaming and not), whose own types must parse every answer,
  and whose error classes must come out of the server's error statuses;
- schemathesis, fuzzing every operation of the server's own `/openapi.json`: no 5xx, and every answer's status,
  content type, headers and body as the document describes them.

One server process serves the whole module (a tiny random V4 on CPU: the text is noise, the protocols are not).
It is stopped with SIGINT at the end and must exit 0. Everything is strict. Fixed findings: F1 (the document described event-stream bodies as a string; OpenAPI 3.1
tools read that schema per event, so it is now the event object) and F2 (/v1/messages served requests without
the `max_tokens` the document and Anthropic's API require; now a 400) and F3 (chat-protocol usage left out a
final token that ended inside a UTF-8 character; usage now counts the engine's token ids).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402 - schemathesis brings hypothesis
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import (  # noqa: E402
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

MODEL = "tiny"
API_KEY = "deepserve-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN = 512
MAX_BODY_BYTES = 64 * 1024
MAX_TOKENS = 8
USER = [{"role": "user", "content": "hi"}]
#: examples per operation and generation mode: the whole file stays within ~90 s on two CPU cores
MAX_EXAMPLES = 40
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance]


# -- the server process ----------------------------------------------------------------------------------------------
@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log: Path
    checkpoint: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def stop(self) -> int:
        """SIGINT (graceful shutdown), then the exit status; killed after 30 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"the server ignored SIGINT for 30 s:\n{self.output()}") from None
        return self.proc.returncode


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_get(url: str) -> tuple[int, bytes]:
    try:
        with _NO_PROXY.open(url, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    from deepserve.tools.demo_checkpoint import build_demo_checkpoint

    root = tmp_path_factory.mktemp("served")
    checkpoint = build_demo_checkpoint(root / "checkpoint")
    port = free_port()
    cmd = [sys.executable, "-m", "deepserve", "serve", str(checkpoint), "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", MODEL, "--api-key", API_KEY, "--accelerator", "cpu", "--dtype", "float32",
           "--max-model-len", str(MAX_MODEL_LEN), "--block-size", "128", "--max-num-seqs", "4",
           "--max-body-bytes", str(MAX_BODY_BYTES), "--thinking", "off", "--log-level", "warning"]
    log = root / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    handle = Server(f"http://127.0.0.1:{port}", proc, log, checkpoint)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, f"the server exited with {proc.returncode}:\n{handle.output()}"
            assert time.monotonic() < deadline, f"no /health within 180 s:\n{handle.output()}"
            try:
                if http_get(f"{handle.url}/health")[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.1)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    yield handle
    if proc.poll() is None:  # `test_zz_server_exits_cleanly_on_sigint` did not run (-k, -x, ...)
        assert handle.stop() == 0, handle.output()


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def claude(server):
    with anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120) as client:
        yield client


def generated_tokens(server: Server) -> float:
    """`deepserve_generation_tokens_total`: every token the engine handed to a response."""
    text = http_get(f"{server.url}/metrics")[1].decode()
    return float(re.search(r"^deepserve_generation_tokens_total (\S+)$", text, re.M).group(1))


# -- openai ----------------------------------------------------------------------------------------------------------
def test_openai_lists_and_retrieves_the_model(oai):
    page = oai.models.list()
    assert [m.id for m in page.data] == [MODEL]
    model = page.data[0]
    assert isinstance(model, openai.types.Model) and model.object == "model" and model.owned_by == "deepserve"
    assert model.created > 0
    assert oai.models.retrieve(MODEL).id == MODEL


def test_openai_chat_completion_streamed_equals_non_streamed(oai):
    request = dict(model=MODEL, messages=USER, max_tokens=MAX_TOKENS, temperature=0)
    full = oai.chat.completions.create(**request)
    assert isinstance(full, openai.types.chat.ChatCompletion)
    assert full.object == "chat.completion" and full.model == MODEL and len(full.choices) == 1
    choice = full.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant" and choice.message.content
    usage = full.usage
    assert usage.prompt_tokens > 0 and usage.completion_tokens == MAX_TOKENS
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens

    chunks = list(oai.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    assert chunks and all(isinstance(c, openai.types.chat.ChatCompletionChunk) for c in chunks)
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert all(c.usage is None for c in chunks[:-1])  # the recipe puts usage on the final chunk
    last = chunks[-1].usage
    assert (last.prompt_tokens, last.completion_tokens) == (usage.prompt_tokens, usage.completion_tokens)


def test_openai_completion_streamed_equals_non_streamed(server, oai):
    request = dict(model=MODEL, prompt="hello", max_tokens=MAX_TOKENS, temperature=0)
    full = oai.completions.create(**request)
    assert isinstance(full, openai.types.Completion) and full.object == "text_completion" and full.model == MODEL
    choice = full.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert full.usage.prompt_tokens == len("hello")  # the demo tokenizer is byte-level
    assert full.usage.completion_tokens == MAX_TOKENS
    assert full.usage.total_tokens == full.usage.prompt_tokens + MAX_TOKENS

    chunks = list(oai.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    assert all(isinstance(c, openai.types.Completion) for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS  # OpenAI's usage chunk
    assert all(c.usage is None for c in chunks[:-1])

    ids = Tokenizer.from_file(str(server.checkpoint / "tokenizer.json")).encode("hello", add_special_tokens=False).ids
    by_ids = oai.completions.create(model=MODEL, prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
    assert by_ids.choices[0].text == choice.text  # the same prompt as token ids


def test_openai_responses_streamed_equals_non_streamed(oai):
    if not hasattr(oai, "responses"):
        pytest.skip("this openai client has no Responses API")
    request = dict(model=MODEL, input="hi", max_output_tokens=MAX_TOKENS, temperature=0)
    full = oai.responses.create(**request)
    assert isinstance(full, openai.types.responses.Response) and full.object == "response" and full.model == MODEL
    assert full.status == "incomplete" and full.incomplete_details.reason == "max_output_tokens"
    assert full.output_text and full.output[0].type == "message" and full.output[0].role == "assistant"
    assert full.usage.input_tokens > 0 and 0 < full.usage.output_tokens <= MAX_TOKENS
    assert full.usage.total_tokens == full.usage.input_tokens + full.usage.output_tokens

    events = list(oai.responses.create(**request, stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == full.output_text
    final = events[-1].response
    assert isinstance(final, openai.types.responses.Response) and final.output_text == full.output_text
    assert final.usage.output_tokens == full.usage.output_tokens


# -- anthropic -------------------------------------------------------------------------------------------------------
def test_anthropic_lists_the_model(claude):
    models = claude.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert isinstance(models[0], anthropic.types.ModelInfo) and models[0].type == "model"
    assert models[0].display_name == MODEL and models[0].created_at.year >= 2024


def test_anthropic_message_streamed_equals_non_streamed(claude):
    # this client has no `temperature` argument any more; the server still reads it from the body
    request = dict(model=MODEL, max_tokens=MAX_TOKENS, messages=USER, extra_body={"temperature": 0})
    message = claude.messages.create(**request)
    assert isinstance(message, anthropic.types.Message) and message.type == "message"
    assert message.role == "assistant" and message.model == MODEL and message.stop_reason == "max_tokens"
    text = "".join(block.text for block in message.content if block.type == "text")
    assert text and message.usage.input_tokens > 0 and 0 < message.usage.output_tokens <= MAX_TOKENS

    with claude.messages.stream(**request) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == message.usage.output_tokens

    events = list(claude.messages.create(**request, stream=True))
    types = [e.type for e in events]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    assert {"content_block_start", "content_block_delta", "content_block_stop"} <= set(types)
    assert events[-2].delta.stop_reason == "max_tokens"


def test_chat_usage_counts_every_generated_token(server, oai):
    """Greedy prefixes of one output: each answer's usage must count what the engine generated for it."""
    for max_tokens in range(1, MAX_TOKENS + 1):
        before = generated_tokens(server)
        usage = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=max_tokens, temperature=0).usage
        assert usage.completion_tokens == generated_tokens(server) - before, (max_tokens, usage)


# -- errors through the clients --------------------------------------------------------------------------------------
@dataclass
class Clients:
    oai: Any
    claude: Any
    oai_wrong_key: Any
    claude_wrong_key: Any


@pytest.fixture(scope="module")
def clients(server, oai, claude):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0, timeout=60) as oai_wrong, \
            anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0, timeout=60) as claude_wrong:
        yield Clients(oai, claude, oai_wrong, claude_wrong)


ERRORS = {
    # name: (call, the client's exception, status, OpenAI's `param`)
    "openai-wrong-key": (lambda c: c.oai_wrong_key.chat.completions.create(model=MODEL, messages=USER),
                         openai.AuthenticationError, 401, None),
    "openai-models-wrong-key": (lambda c: c.oai_wrong_key.models.list(), openai.AuthenticationError, 401, None),
    "openai-unknown-model": (lambda c: c.oai.chat.completions.create(model="nope", messages=USER),
                             openai.NotFoundError, 404, "model"),
    "openai-retrieve-unknown-model": (lambda c: c.oai.models.retrieve("nope"), openai.NotFoundError, 404,
                                      "model_id"),
    "openai-completions-unknown-model": (lambda c: c.oai.completions.create(model="nope", prompt="hi"),
                                         openai.NotFoundError, 404, "model"),
    "openai-responses-unknown-model": (lambda c: c.oai.responses.create(model="nope", input="hi"),
                                       openai.NotFoundError, 404, "model"),
    "openai-bad-temperature": (lambda c: c.oai.chat.completions.create(model=MODEL, messages=USER, temperature=5),
                               openai.BadRequestError, 400, "temperature"),
    "openai-completions-bad-max-tokens": (lambda c: c.oai.completions.create(model=MODEL, prompt="hi",
                                                                             max_tokens=-1),
                                          openai.BadRequestError, 400, "max_tokens"),
    "openai-completions-prompt-too-long": (lambda c: c.oai.completions.create(model=MODEL, prompt="x" * 600),
                                           openai.BadRequestError, 400, "prompt"),
    "openai-responses-previous-response-id": (
        lambda c: c.oai.responses.create(model=MODEL, input="hi", previous_response_id="resp_1"),
        openai.BadRequestError, 400, "previous_response_id"),
    "anthropic-wrong-key": (lambda c: c.claude_wrong_key.messages.create(model=MODEL, max_tokens=4, messages=USER),
                            anthropic.AuthenticationError, 401, None),
    "anthropic-unknown-model": (lambda c: c.claude.messages.create(model="nope", max_tokens=4, messages=USER),
                                anthropic.NotFoundError, 404, None),
    "anthropic-bad-max-tokens": (lambda c: c.claude.messages.create(model=MODEL, max_tokens=0, messages=USER),
                                 anthropic.BadRequestError, 400, None),
    "anthropic-bad-temperature": (lambda c: c.claude.messages.create(model=MODEL, max_tokens=4, messages=USER,
                                                                     extra_body={"temperature": 3}),
                                  anthropic.BadRequestError, 400, None),
}


@pytest.mark.parametrize("name", ERRORS)
def test_errors_map_to_the_clients_exceptions(clients, name):
    call, error, status, param = ERRORS[name]
    with pytest.raises(error) as info:
        call(clients)
    exc = info.value
    assert exc.status_code == status and exc.message
    body = exc.body
    if name.startswith("anthropic"):  # Anthropic's error JSON: the client keeps the whole body
        assert body["type"] == "error" and body["error"]["message"]
        assert body["error"]["type"] == {400: "invalid_request_error", 401: "authentication_error",
                                         404: "not_found_error"}[status]
    else:  # OpenAI's: the client keeps `error`
        assert body["message"] and body["type"] and body.get("param") == param
        if name.endswith("prompt-too-long"):
            assert "600" in body["message"] and str(MAX_MODEL_LEN) in body["message"]  # both numbers
            assert exc.code == "context_length_exceeded"


# -- schemathesis against the live /openapi.json ---------------------------------------------------------------------
OPERATIONS = [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/v1/responses"),
              ("POST", "/v1/messages"), ("GET", "/v1/models"), ("GET", "/v1/models/{model_id}"), ("GET", "/health"),
              ("HEAD", "/health"), ("GET", "/metrics"), ("HEAD", "/metrics"), ("GET", "/openapi.json"),
              ("POST", "/tokenize"), ("POST", "/detokenize")]
#: operations with inputs get negative (document-breaking) data as well
FUZZ = [(m, p, GenerationMode.POSITIVE) for m, p in OPERATIONS] + \
       [(m, p, GenerationMode.NEGATIVE) for m, p in OPERATIONS if m == "POST" or "{" in p]
TOKEN_LIMIT = {"/v1/responses": "max_output_tokens"}


@pytest.fixture(scope="module")
def api_schema(server):
    config = schemathesis.Config.from_dict({"cache": {"enabled": False}})
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json", config=config)


def is_event_stream(response) -> bool:
    return any("text/event-stream" in value for value in response.headers.get("content-type", []))


def validate(case, response, checks, headers) -> None:
    """schemathesis' checks; its FailureGroup (a BaseExceptionGroup) as an AssertionError hypothesis reports."""
    try:
        case.validate_response(response, checks=checks, headers=headers)
    except BaseExceptionGroup as group:
        raise AssertionError(str(group)) from None


def realistic(case, path: str) -> None:
    """Generated bodies, nudged so that they reach the engine without running it long: the served model's name
    (any other is a 404), a short output (4 tokens where the body asks for more, or does not say: the default is
    the rest of the context), at most 2 choices, chat messages with some content (and a tool message with a `tool_call_id`), a
    Responses input: the document leaves these optional, the recipe does not. Other values the document allows
    but the server refuses (a 400, which the document lists) are left alone."""
    body = case.body
    if not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str):
        body["model"] = MODEL
    if not path.startswith("/v1/"):
        return  # /tokenize and /detokenize generate nothing
    if type(body.get("n")) is int and body["n"] > 2:
        body["n"] = 2  # each choice is an engine request: a valid n of 128 runs 128 of them
    key = TOKEN_LIMIT.get(path, "max_tokens")
    value = body.get(key)
    if (key not in body and path != "/v1/messages") or value is None or \
            (type(value) is int and 4 < value < 2**32):  # larger ones hit the recipe's u32 check: a 400
        body[key] = 4
    if isinstance(body.get("messages"), list):
        for message in body["messages"]:
            if isinstance(message, dict):
                message.setdefault("content", "hi")
                if message.get("role") == "tool":
                    message.setdefault("tool_call_id", "call_0")
    if path == "/v1/responses" and "input" not in body:
        body["input"] = "hi"


def test_openapi_document_lists_every_route(server):
    status, raw = http_get(f"{server.url}/openapi.json")
    assert status == 200
    doc = json.loads(raw)
    served = sorted((method.upper(), path) for path, item in doc["paths"].items() for method in item)
    assert served == sorted(OPERATIONS)
    assert doc["components"]["securitySchemes"]  # the server has a key: the document says so


@pytest.mark.parametrize("method,path,mode", FUZZ, ids=[f"{m} {p} {g.value}" for m, p, g in FUZZ])
def test_schemathesis_finds_no_5xx_and_no_undocumented_answer(api_schema, method, path, mode):
    operation = api_schema[path][method]

    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case):
        realistic(case, path)
        response = case.call(headers=AUTH, timeout=120)
        validate(case, response, CHECKS, AUTH)

    fuzz()


def _case(schema, method, path, body=None, **kwargs):
    operation = schema[path][method]
    if body is None:
        return operation.Case(**kwargs)
    return operation.Case(body=body, media_type="application/json", **kwargs)


CHAT = {"model": MODEL, "messages": USER, "max_tokens": 3}
EXAMPLES = {
    # label: (method, path, body, path parameters, headers, expected status)
    "chat": ("POST", "/v1/chat/completions", CHAT, None, AUTH, 200),
    "chat-stream": ("POST", "/v1/chat/completions", {**CHAT, "stream": True}, None, AUTH, 200),
    "completions": ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3}, None, AUTH, 200),
    "completions-ids": ("POST", "/v1/completions", {"model": MODEL, "prompt": [104, 105], "max_tokens": 3}, None,
                        AUTH, 200),
    "completions-stream": ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3,
                                                       "stream": True}, None, AUTH, 200),
    "responses": ("POST", "/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 3}, None, AUTH, 200),
    "responses-stream": ("POST", "/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 3,
                                                   "stream": True}, None, AUTH, 200),
    "messages": ("POST", "/v1/messages", CHAT, None, {"x-api-key": API_KEY}, 200),
    "messages-stream": ("POST", "/v1/messages", {**CHAT, "stream": True}, None, {"x-api-key": API_KEY}, 200),
    "models": ("GET", "/v1/models", None, None, AUTH, 200),
    "model": ("GET", "/v1/models/{model_id}", None, {"model_id": MODEL}, AUTH, 200),
    "health": ("GET", "/health", None, None, {}, 200),
    "metrics": ("GET", "/metrics", None, None, {}, 200),
    "openapi": ("GET", "/openapi.json", None, None, {}, 200),
    "chat-no-key": ("POST", "/v1/chat/completions", CHAT, None, {}, 401),
    "completions-no-key": ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi"}, None, {}, 401),
    "responses-no-key": ("POST", "/v1/responses", {"model": MODEL, "input": "hi"}, None, {}, 401),
    "messages-no-key": ("POST", "/v1/messages", CHAT, None, {}, 401),
    "models-no-key": ("GET", "/v1/models", None, None, {}, 401),
    "model-no-key": ("GET", "/v1/models/{model_id}", None, {"model_id": MODEL}, {}, 401),
    "chat-unknown-model": ("POST", "/v1/chat/completions", {**CHAT, "model": "nope"}, None, AUTH, 404),
    "messages-unknown-model": ("POST", "/v1/messages", {**CHAT, "model": "nope"}, None, AUTH, 404),
    "model-unknown": ("GET", "/v1/models/{model_id}", None, {"model_id": "nope"}, AUTH, 404),
    "completions-too-long": ("POST", "/v1/completions", {"model": MODEL, "prompt": "x" * 600}, None, AUTH, 400),
    "messages-bad-field": ("POST", "/v1/messages", {**CHAT, "max_tokens": 0}, None, AUTH, 400),
    "chat-body-too-large": ("POST", "/v1/chat/completions",
                            {**CHAT, "messages": [{"role": "user", "content": "x" * MAX_BODY_BYTES}]}, None, AUTH, 413),
}
STREAMED = [label for label in EXAMPLES if label.endswith("-stream")]


@pytest.mark.parametrize("label", EXAMPLES)
def test_known_requests_get_the_documented_answer(api_schema, label):
    """The answers fuzzing rarely reaches (successes, streams, 401, 404, 413), each checked against the document."""
    method, path, body, path_parameters, headers, status = EXAMPLES[label]
    case = _case(api_schema, method, path, body, **({"path_parameters": path_parameters} if path_parameters else {}))
    response = case.call(headers=headers, timeout=120)
    assert response.status_code == status, response.text[:500]
    assert is_event_stream(response) == label.endswith("-stream")
    validate(case, response, CHECKS, headers)


@pytest.mark.parametrize("label", STREAMED)
def test_streamed_bodies_match_the_document(api_schema, label):
    method, path, body, _, headers, _ = EXAMPLES[label]
    case = _case(api_schema, method, path, body)
    response = case.call(headers=headers, timeout=120)
    assert response.status_code == 200 and is_event_stream(response)
    case.validate_response(response, checks=[response_schema_conformance], headers=headers)


def test_messages_without_max_tokens_is_answered_as_documented(api_schema):
    """The document and the server agree that `max_tokens` is required on /v1/messages (it was F2)."""
    required = "max_tokens" in api_schema.raw_schema["components"]["schemas"]["MessagesRequest"]["required"]
    # a prompt that fills the context but for a few tokens, so that a served request stays short
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x" * (MAX_MODEL_LEN - 12)}]}
    response = _case(api_schema, "POST", "/v1/messages", body).call(headers=AUTH, timeout=120)
    assert (response.status_code == 400) == required, (required, response.status_code, response.text[:300])


# -- last: the shutdown ----------------------------------------------------------------------------------------------
def test_zz_server_exits_cleanly_on_sigint(server):
    assert http_get(f"{server.url}/health")[0] == 200
    assert server.stop() == 0, server.output()
    assert "Traceback" not in server.output(), server.output()
