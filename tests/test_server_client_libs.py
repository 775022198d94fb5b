"""The clients people use, unmodified, against a real `deepserve serve` of the embedded model (issue 25, item 8):
langchain-openai (invoke, stream, structured output by json_schema and by function calling, bind_tools with a
forced tool, n), litellm (length fields, n, penalties, logit_bias, a forced tool), the openai and anthropic SDKs
(n, penalties, forced tools, streamed tool calls) and lm-eval's `local-completions` on a local task directory
(a multiple-choice loglikelihood task and a generate_until task, batched). Every tokenizer is the model's own
local one; nothing comes from a model hub. Each library is skipped where it is not installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import jsonschema
import pytest

import deepserve
from test_server_clients import Server, free_port, http_get

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm reads its bundled cost map, offline
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

EMBEDDED = Path(deepserve.__file__).parent / "assets" / "deepserve-tiny-v4"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
# the audit's model name, key (the clients insist on one; the server takes none), tool, its schema and the question
from client_audit import ASK, KEY, MC, MODEL, TOOL, WEATHER, write_tasks  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("client-libs")
    port = free_port()
    cmd = [sys.executable, "-m", "deepserve", "serve", str(EMBEDDED), "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", MODEL, "--accelerator", "cpu", "--dtype", "float32", "--max-model-len", "2048",
           "--block-size", "128", "--max-num-seqs", "8", "--thinking", "off", "--log-level", "warning"]
    log = root / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    handle = Server(f"http://127.0.0.1:{port}", proc, log, EMBEDDED)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, f"the server exited with {proc.returncode}:\n{handle.output()}"
            assert time.monotonic() < deadline, f"no /health within 300 s:\n{handle.output()}"
            try:
                if http_get(f"{handle.url}/health")[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.2)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    yield handle
    assert handle.stop() == 0, handle.output()


def weather_args(arguments: str | dict) -> dict:
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(args, WEATHER)
    return args


# -- langchain-openai ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def langchain_chat(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    import openai

    # langchain caches a default HTTP client per base URL for the process's life; one of our own is closed here
    with openai.DefaultHttpxClient(timeout=300) as http_client:
        yield lambda **kw: langchain_openai.ChatOpenAI(model=MODEL, base_url=f"{server.url}/v1", api_key=KEY,
                                                       max_retries=0, timeout=300, http_client=http_client, **kw)


def test_langchain_invoke_and_stream_honour_max_tokens(langchain_chat):
    llm = langchain_chat(max_tokens=5, temperature=0)
    message = llm.invoke("Say hello.")
    assert message.content and message.usage_metadata["output_tokens"] <= 5  # sent as max_completion_tokens
    streamed = "".join(chunk.content for chunk in llm.stream("Say hello."))
    assert streamed == message.content


def test_langchain_structured_output_by_both_methods(langchain_chat):
    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        city: Literal["Paris", "Rome", "Oslo"]
        days: int = Field(ge=1, le=7)

    llm = langchain_chat(max_tokens=128, temperature=0)
    for method in ("json_schema", "function_calling"):
        answer = llm.with_structured_output(Weather, method=method).invoke(ASK)
        assert isinstance(answer, Weather), method


def test_langchain_bind_tools_with_a_forced_tool_and_n(langchain_chat):
    llm = langchain_chat(max_tokens=128, temperature=0)
    for choice in ("any", "get_weather"):
        message = llm.bind_tools([TOOL], tool_choice=choice).invoke(ASK)
        assert [c["name"] for c in message.tool_calls] == ["get_weather"] * len(message.tool_calls) and \
            message.tool_calls, choice
        weather_args(message.tool_calls[0]["args"])
    from langchain_core.messages import HumanMessage

    result = langchain_chat(max_tokens=4, temperature=1.0, n=2, seed=1).generate([[HumanMessage("hi")]])
    assert len(result.generations[0]) == 2


# -- litellm ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def completion(server):
    litellm = pytest.importorskip("litellm")
    import openai

    # litellm caches its own HTTP client for the process's life; an OpenAI client of our own is closed here
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=300) as client:
        yield lambda **kw: litellm.completion(model=f"openai/{MODEL}", api_base=f"{server.url}/v1", api_key=KEY,
                                              client=client, **kw)


def test_litellm_length_n_penalties_and_logit_bias(completion):
    response = completion(messages=[{"role": "user", "content": "hi"}], max_completion_tokens=4, n=2,
                          presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"100": -100}, seed=3)
    assert len(response.choices) == 2 and response.usage.completion_tokens <= 2 * 4


def test_litellm_forced_tool_call(completion):
    response = completion(messages=[{"role": "user", "content": ASK}], tools=[TOOL], tool_choice="required",
                          max_tokens=128, temperature=0)
    calls = response.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather"
    weather_args(calls[0].function.arguments)


# -- the openai and anthropic SDKs -----------------------------------------------------------------------------------
def test_openai_sdk_n_penalties_and_streamed_forced_tool_call(server):
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=300) as client:
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=3,
                                              max_completion_tokens=3, seed=2, presence_penalty=1.0,
                                              frequency_penalty=-0.5, logit_bias={"7": -100})
        assert [c.index for c in chat.choices] == [0, 1, 2]
        text = client.completions.create(model=MODEL, prompt=["a b c", "d e f"], n=2, max_tokens=2,
                                         extra_body={"repetition_penalty": 1.3, "bad_words": ["the"]})
        assert sorted(c.index for c in text.choices) == [0, 1, 2, 3]
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}],
                                                tools=[TOOL], tool_choice={"type": "function",
                                                                           "function": {"name": "get_weather"}},
                                                parallel_tool_calls=False, max_tokens=128, temperature=0,
                                                stream=True)
        arguments, names = "", set()
        for chunk in stream:
            for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                names.add(delta.function.name) if delta.function and delta.function.name else None
                arguments += (delta.function.arguments or "") if delta.function else ""
        assert names == {"get_weather"}
        weather_args(arguments)


def test_anthropic_sdk_forced_tool_use(server):
    anthropic = pytest.importorskip("anthropic")
    with anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=300) as client:
        message = client.messages.create(model=MODEL, max_tokens=128, messages=[{"role": "user", "content": ASK}],
                                         tools=[{"name": "get_weather", "description": "forecast",
                                                 "input_schema": WEATHER}],
                                         tool_choice={"type": "tool", "name": "get_weather"})
        uses = [block for block in message.content if block.type == "tool_use"]
        assert message.stop_reason == "tool_use" and uses and uses[0].name == "get_weather"
        weather_args(uses[0].input)


# -- lm-eval ---------------------------------------------------------------------------------------------------------


def test_lm_eval_local_completions_runs_loglikelihood_and_generate_until_tasks(server, tmp_path):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"model": MODEL, "base_url": f"{server.url}/v1/completions", "tokenizer_backend": "huggingface",
                    "tokenizer": str(EMBEDDED), "num_concurrent": 1, "max_retries": 1},
        tasks=["ds_mc", "ds_gen"], task_manager=TaskManager(include_path=str(write_tasks(tmp_path))),
        batch_size=4, log_samples=False)
    scores = results["results"]
    assert 0.0 <= scores["ds_mc"]["acc,none"] <= 1.0
    assert 0.0 <= scores["ds_gen"]["exact_match,none"] <= 1.0
    assert results["n-samples"]["ds_mc"]["effective"] == len(MC)
