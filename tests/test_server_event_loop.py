"""Nothing slow on the event loop: prompts are rendered and tokenized on the app's thread pool, a prompt too long
for the context is refused from its byte count before any tokenizer runs, and the loop's lag is measured
(`deepserve_event_loop_lag_seconds`) and logged when it is large. Ordering, never timings, decides each test."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import threading
import time

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from deepserve.model.tokenizer import Tokenizer
from deepserve.server.loop_lag import LoopLagMonitor
from deepserve.server.state import MODEL, RECIPE
from deepserve.server.tokenization import PromptBound, TextEncoder
from test_server import MODEL as NAME, USER, chat_dir, make_app  # noqa: F401 - fixtures

BIG = 20_000  # bytes of prompt text: under what 1024 tokens could hold (29 bytes a token at most), over 1024 tokens
HUGE = "a " * 2**21  # the 4 MB body of the issue: far past any 1024-token prompt


def body_for(path: str, text: str) -> dict:
    if path == "/v1/completions":
        return {"model": NAME, "prompt": text, "max_tokens": 2}
    return {"model": NAME, "messages": [{"role": "user", "content": text}], "max_tokens": 2}


def post(client, path: str, text: str):
    """The request, its body streamed from a file object (aiohttp's client warns about large byte strings)."""
    data = io.BytesIO(json.dumps(body_for(path, text)).encode())
    return client.post(path, data=data, headers={"Content-Type": "application/json"})


class Gate:
    """Holds every tokenization of a prompt longer than BIG / 2 until `release` is set; counts tokenizations."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self.num_calls = 0

    def hold(self, length: int) -> None:
        self.num_calls += 1
        if length > BIG // 2:
            self.entered.set()
            self.release.wait(30)


class GatedEncoding:
    """deepseek-recipe's prompt encoding, with `Gate` in front of its tokenization."""

    def __init__(self, inner, gate: Gate) -> None:
        self.inner, self.gate = inner, gate

    def render_conversation(self, conversation):
        return self.inner.render_conversation(conversation)

    def encode(self, conversation):
        self.gate.hold(len(self.inner.render_conversation(conversation).prompt))
        return self.inner.encode(conversation)


def gate_tokenizers(app) -> Gate:
    gate = Gate()
    app[RECIPE].encoding = GatedEncoding(app[RECIPE].encoding, gate)
    encoder = app[MODEL].encoder
    real = encoder.encode
    encoder.encode = lambda text: (gate.hold(len(text)), real(text))[1]
    return gate


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_a_long_prompt_being_tokenized_does_not_hold_other_requests(aiohttp_client, chat_dir, path):  # noqa: F811
    client = await aiohttp_client(make_app(chat_dir))
    gate = gate_tokenizers(client.app)
    big = asyncio.create_task(post(client, path, "x" * BIG))
    assert await asyncio.to_thread(gate.entered.wait, 30)  # its tokenization has started, and is held
    small = await post(client, path, "hi")
    assert small.status == 200, await small.text()
    assert (await client.get("/health")).status == 200
    assert not big.done()  # both were served while the long prompt was still being tokenized
    gate.release.set()
    refused = await big
    error = (await refused.json())["error"]
    assert refused.status == 400 and error["code"] == "context_length_exceeded"
    assert "is at least" not in error["message"]  # its tokens were counted: the bound let it through


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_a_prompt_too_long_for_any_tokenization_is_refused_unread(aiohttp_client, chat_dir, path):  # noqa: F811
    client = await aiohttp_client(make_app(chat_dir))
    gate = gate_tokenizers(client.app)
    r = await post(client, path, HUGE)
    error = (await r.json())["error"]
    assert r.status == 400 and error["code"] == "context_length_exceeded", error
    assert "is at least" in error["message"] and "1024" in error["message"]
    assert gate.num_calls == 0  # refused from its byte count: no tokenizer ran
    assert (await post(client, path, "hi")).status == 200


def test_the_bound_never_exceeds_the_token_count(chat_dir):  # noqa: F811
    tokenizer = Tokenizer(chat_dir)
    bound = PromptBound.from_tokenizer_json(tokenizer.to_str())
    assert bound is not None and bound.max_token_bytes >= max(len(t.encode()) for t in ("<｜User｜>", "<think>"))
    for text in ["hi", "a " * 500, "<｜User｜>" * 40, "日本語のテキスト" * 30, "\n\t  " * 100, "🙂" * 80]:
        ids = tokenizer.encode(text)
        num_bytes = len(text.encode())
        assert len(ids) * bound.max_token_bytes >= num_bytes, text[:20]
        bound.check(text, max_model_len=len(ids) + 1)  # fits: no error
    unknown = {"model": {"type": "WordPiece", "vocab": {"a": 0}}, "normalizer": None, "pre_tokenizer": None}
    assert PromptBound.from_tokenizer_json(json.dumps(unknown)) is None  # no proof for other tokenizers


def test_text_encoder_gives_the_tokenizers_ids(chat_dir):  # noqa: F811
    tokenizer = Tokenizer(chat_dir)
    encoder = TextEncoder(tokenizer)
    for text in ["hi", "<｜User｜>hello<｜Assistant｜>", "héllo wörld 日本語 " * 20, " \n " * 30, ""]:
        assert encoder.encode(text) == tokenizer.encode(text), text[:20]


async def test_loop_lag_is_measured_and_a_held_loop_is_logged(caplog):
    registry = CollectorRegistry()
    monitor = LoopLagMonitor(registry, interval=0.01, warn_after=0.25)
    task = asyncio.create_task(monitor.run())
    try:
        while registry.get_sample_value("deepserve_event_loop_lag_seconds_count") in (None, 0.0):
            await asyncio.sleep(0.01)
        with caplog.at_level(logging.WARNING, logger="deepserve.server.loop_lag"):
            time.sleep(0.5)  # holds the loop: the monitor's timer, due within 0.01 s, runs >= 0.49 s late
            seen = registry.get_sample_value("deepserve_event_loop_lag_seconds_count")
            while registry.get_sample_value("deepserve_event_loop_lag_seconds_count") == seen:
                await asyncio.sleep(0.01)
        assert registry.get_sample_value("deepserve_event_loop_lag_seconds_bucket", {"le": "0.25"}) < \
            registry.get_sample_value("deepserve_event_loop_lag_seconds_count")
        assert any("event loop was held" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    finally:
        task.cancel()


async def test_metrics_expose_the_loop_lag(aiohttp_client, chat_dir):  # noqa: F811
    client = await aiohttp_client(make_app(chat_dir))
    for _ in range(500):
        families = {f.name: f for f in text_string_to_metric_families(await (await client.get("/metrics")).text())}
        count = [s.value for s in families["deepserve_event_loop_lag_seconds"].samples if s.name.endswith("_count")]
        if count[0] > 0:
            break
        await asyncio.sleep(0.02)
    assert count[0] > 0
