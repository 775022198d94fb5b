"""The engine in its own process behind the front (`engine_process`, `--engine-process`; vLLM's multiprocessing
engine core), on the embedded model on CPU: the server streams what one process makes, a client that
disconnects frees its request in the engine process, a JSON-schema request satisfies its schema, `/metrics` and
`/health` answer, the shutdown leaves no child process, an engine process that dies is a 503 and a `RankError`
naming it, as is an engine that fails to build, and a V4.1 checkpoint gives one process's tokens. The outputs
cross as changes (`messages.OutputDeltas` / `OutputAccumulator`), checked here against the cumulative outputs
they are made from."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import signal
from pathlib import Path

import jsonschema
import pytest

from deepserve import LLM, SamplingParams
from deepserve.cli import build_parser, engine_options
from deepserve.core.env import default_model_dir
from deepserve.core.outputs import CompletionOutput, Logprob, Prefix, RequestOutput
from deepserve.core.plugins import make_plugin_manager
from deepserve.distributed import messages as m
from deepserve.distributed.front import DataParallelEngine, RankError
from deepserve.server import ENGINE, ServerConfig, create_app
from test_distributed_server import until

MODEL = str(default_model_dir())
OPTIONS = dict(max_num_seqs=4, kv_cache_bytes=2**24, block_size=128, max_model_len=512)
RECORD = {"type": "object", "additionalProperties": False, "required": ["color", "n"], "properties": {
    "color": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}}}


def make_app():
    config = ServerConfig(model=MODEL, served_model_name="tiny", default_thinking_mode=False,
                          engine_kwargs=dict(OPTIONS, engine_process=True))
    return create_app(config, plugin_manager=make_plugin_manager(load_entrypoints=False))


async def first_event(response) -> bytes:
    line = b""
    while not line.startswith(b"data:"):
        line = await asyncio.wait_for(response.content.readline(), 30)
    return line


@pytest.fixture(scope="module")
def one():
    llm = LLM(**OPTIONS)
    yield llm
    llm.engine.shutdown()


def test_the_option_from_the_flag_the_environment_and_llm(one, monkeypatch):
    assert engine_options(build_parser().parse_args(["serve", "--engine-process"]))["engine_process"] is True
    assert engine_options(build_parser().parse_args(["serve", "--no-engine-process"]))["engine_process"] is False
    assert "engine_process" not in engine_options(build_parser().parse_args(["serve"]))
    monkeypatch.setenv("DEEPSERVE_ENGINE_PROCESS", "1")
    llm = LLM(**OPTIONS)  # the environment turns it on
    try:
        front = llm.engine
        assert isinstance(front, DataParallelEngine) and front.world_size == 1
        assert front.processes[0].pid != os.getpid() and front.processes[0].is_alive()
        params = SamplingParams(temperature=0, max_tokens=12, logprobs=2)
        prompts = [[5, 6, 7, 8, 9], "Hello there", [3] * 40]
        got = llm.generate(prompts, params, use_tqdm=False)
        want = one.generate(prompts, params, use_tqdm=False)
        for g, w in zip(got, want):
            assert (g.prompt, g.prompt_token_ids, g.outputs[0].token_ids, g.outputs[0].text) == \
                (w.prompt, w.prompt_token_ids, w.outputs[0].token_ids, w.outputs[0].text)
            assert g.outputs[0].logprobs == w.outputs[0].logprobs
    finally:
        llm.engine.shutdown()
    assert front.processes[0].exitcode == 0
    with pytest.raises(ValueError, match="DEEPSERVE_ENGINE_PROCESS must be 0 or 1"):
        monkeypatch.setenv("DEEPSERVE_ENGINE_PROCESS", "yes")
        LLM(**OPTIONS)


def test_an_engine_that_fails_to_build_is_one_error_and_leaves_no_process():
    with pytest.raises(RankError, match="rank 0 failed to start: ValueError: speculative_config.method 'nope' is "
                                        "not a registered proposer"):
        LLM(engine_process=True, speculative_config={"method": "nope", "num_speculative_tokens": 2}, **OPTIONS)
    assert not [p for p in multiprocessing.active_children() if p.name == "deepserve-engine"]


def test_a_v41_checkpoint_through_the_engine_process():
    tiny = Path(__file__).parent / "golden" / "v41" / "tiny_a" / "tiny"
    options = dict(max_num_seqs=2, max_num_batched_tokens=24, block_size=128)
    params = SamplingParams(temperature=0, max_tokens=6)
    prompts = [[5, 6, 7, 8, 9, 10], [40, 41, 42]]
    llm = LLM(model=str(tiny), **options)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.engine.shutdown()
    llm = LLM(model=str(tiny), engine_process=True, **options)
    try:
        assert isinstance(llm.engine, DataParallelEngine)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    finally:
        llm.engine.shutdown()


def test_outputs_cross_as_changes_and_are_rebuilt_whole():
    deltas, held = m.OutputDeltas(), m.OutputAccumulator()
    held.add("a", "hi", [1, 2, 3], views=True)
    tokens, logprobs = [], []

    def snapshot(text: str, finished: bool = False) -> RequestOutput:
        completion = CompletionOutput(0, text, list(tokens), -1.5, list(logprobs), "stop" if finished else None, None)
        return RequestOutput("a", "hi", [1, 2, 3], None, [completion], finished, 0)

    seen = []
    for step, text in enumerate(["x", "xy", "xyz", "xyzw"]):
        tokens.append(100 + step)
        logprobs.append({100 + step: Logprob(-0.5, 1, text[-1])})
        wire = deltas.to_wire(snapshot(text))
        assert wire.outputs[0].token_ids == [100 + step] and wire.outputs[0].text == text[-1]  # only the change
        out = held.from_wire(m.to_front_decoder.decode(m.to_front_encoder.encode(m.StepOutputs(0, [wire], {}))
                                                       ).outputs[0])
        assert isinstance(out.outputs[0].token_ids, Prefix)
        assert (out.prompt, out.prompt_token_ids, out.outputs[0].text) == ("hi", [1, 2, 3], text)
        seen.append(out)
    assert [list(o.outputs[0].token_ids) for o in seen] == [[100], [100, 101], [100, 101, 102],
                                                            [100, 101, 102, 103]]  # earlier views do not move
    # the final output's text was cut at a stop string: it is sent whole and replaces what the front held
    final = held.from_wire(deltas.to_wire(snapshot("xy", finished=True)))
    assert (final.outputs[0].text, final.outputs[0].token_ids, final.finished) == ("xy", tokens, True)
    assert final.outputs[0].logprobs == logprobs and final.outputs[0].cumulative_logprob == -1.5


async def test_streams_aborts_structured_metrics_and_shutdown(aiohttp_client, one):
    client = await aiohttp_client(make_app())
    front = client.app[ENGINE].engine
    assert isinstance(front, DataParallelEngine) and front.world_size == 1
    (proc,) = front.processes
    assert proc in multiprocessing.active_children()
    prompt = [5, 6, 7, 8, 9, 10, 11]
    # the request sets no penalty: the model's defaults (its generation_config.json) hold for it, behind the front too
    params = SamplingParams(**{**one.sampling_defaults, "temperature": 0, "max_tokens": 10})
    want = one.generate([prompt], params, use_tqdm=False)[0].outputs[0]

    body = {"model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0, "stream": True}
    streamed = await asyncio.wait_for((await client.post("/v1/completions", json=body)).text(), 60)
    pieces = [json.loads(line[len("data: "):]) for line in streamed.split("\n")
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert "".join(p["choices"][0]["text"] for p in pieces) == want.text
    assert pieces[-1]["choices"][0]["finish_reason"] == "length"

    # a client that goes away mid-stream: its request is aborted in the engine process, its pages freed there
    long = {"model": "tiny", "prompt": [3, 4, 5], "max_tokens": 400, "ignore_eos": True, "stream": True}
    response = await client.post("/v1/completions", json=long)
    await first_event(response)
    assert front.has_unfinished_requests() and front.rank_snapshots[0].num_requests_running == 1
    response.close()
    assert await until(lambda: not front.has_unfinished_requests()
                       and front.rank_snapshots[0].num_requests_running == 0
                       and front.rank_snapshots[0].num_kv_pages_used == 0, 30.0)

    # a JSON-schema request: validated on the front's compiler, compiled again and masked in the engine process
    constrained = {"model": "tiny", "prompt": "A record: ", "max_tokens": 60, "temperature": 0,
                   "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": RECORD}}}
    r = await asyncio.wait_for(client.post("/v1/completions", json=constrained), 60)
    data = await r.json()
    assert r.status == 200, data
    jsonschema.validate(json.loads(data["choices"][0]["text"]), RECORD)
    invalid = {**constrained, "response_format": {"type": "json_schema", "json_schema": {
        "name": "r", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}}
    assert (await client.post("/v1/completions", json=invalid)).status == 400

    metrics = await (await client.get("/metrics")).text()
    assert 'deepserve_requests_finished_total{reason="abort"} 1.0' in metrics
    assert f"deepserve_generation_tokens_total {float(front.snapshot().num_generation_tokens)}" in metrics
    assert front.snapshot().num_generation_tokens >= 11
    assert (await client.get("/health")).status == 200

    # the graceful shutdown: a stream in flight finishes, then the engine process ends and nothing is left
    short = {"model": "tiny", "prompt": [3, 4, 5], "max_tokens": 12, "ignore_eos": True, "stream": True}
    response = await client.post("/v1/completions", json=short)
    first = await first_event(response)
    closing = asyncio.create_task(client.server.close())
    rest = (await asyncio.wait_for(response.read(), 60)).decode()
    await asyncio.wait_for(closing, 60)
    events = [line for line in (first.decode() + rest).split("\n") if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][len("data: "):])["choices"][0]["finish_reason"] == "length"
    assert await until(lambda: not proc.is_alive(), 30.0)
    assert proc.exitcode == 0 and proc not in multiprocessing.active_children()


async def test_a_dead_engine_process_is_a_clear_error(aiohttp_client):
    client = await aiohttp_client(make_app())
    engine = client.app[ENGINE]
    (proc,) = engine.engine.processes
    long = {"model": "tiny", "prompt": [3, 4, 5], "max_tokens": 400, "ignore_eos": True, "stream": True}
    response = await client.post("/v1/completions", json=long)
    await first_event(response)
    os.kill(proc.pid, signal.SIGKILL)
    rest = (await asyncio.wait_for(response.read(), 30)).decode()
    assert "the engine has stopped" in rest  # the stream ends with the server's error event
    assert await until(lambda: engine.is_dead)
    assert isinstance(engine.dead_error, RankError)
    assert f"process deepserve-engine (pid {proc.pid}) ended with exit code -9" in str(engine.dead_error)
    health = await client.get("/health")
    assert (health.status, (await health.json())["status"]) == (503, "engine stopped")
    r = await client.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2], "max_tokens": 2})
    assert r.status == 503
    assert not proc.is_alive() and proc not in multiprocessing.active_children()
