"""AsyncEngine: the engine on its own thread, outputs streamed per request, cancellation becomes an abort."""

from __future__ import annotations

import asyncio

import pytest

from deepserve import LLM, AsyncEngine, SamplingParams


@pytest.fixture
async def engine(tiny_dir):
    eng = AsyncEngine.from_pretrained(tiny_dir, dtype="float32", accelerator="cpu", block_size=128)
    await eng.start()
    yield eng
    await eng.shutdown()


def prompts():
    return [[(7 * i + j) % 500 + 2 for j in range(n)] for i, n in enumerate((5, 40, 130, 17))]


async def collect(engine, ids, params, request_id=None):
    outs = [o async for o in engine.generate(ids, params, request_id=request_id)]
    assert outs[-1].finished and all(not o.finished for o in outs[:-1])
    return outs


async def test_concurrent_streams_match_offline_generation(engine, tiny_dir):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    results = await asyncio.gather(*(collect(engine, p, params) for p in prompts()))
    with pytest.raises(RuntimeError, match="AsyncEngine"):
        engine.llm.generate([[5]], params)  # one driver per engine core
    offline = LLM(tiny_dir, dtype="float32", accelerator="cpu", block_size=128).generate(
        [{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    assert [r[-1].outputs[0].token_ids for r in results] == [o.outputs[0].token_ids for o in offline]
    # snapshots are cumulative: each one extends the previous
    for outs in results:
        ids = [o.outputs[0].token_ids for o in outs]
        assert all(a == b[: len(a)] for a, b in zip(ids, ids[1:]))


async def test_cancelled_stream_aborts_and_frees_pages(engine):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def consume():
        async for _ in engine.generate(prompts()[2], params, request_id="gone"):
            pass

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    kv = engine.llm.kv_manager
    for _ in range(200):  # the abort is drained before the next step
        if not engine.engine.has_unfinished_requests() and kv.num_free_blocks == kv.pool.num_blocks:
            break
        await asyncio.sleep(0.05)
    assert kv.num_free_blocks == kv.pool.num_blocks and engine.num_open_streams == 0
    assert engine.llm.runner.num_active_sequences == 0
    # and the engine keeps serving
    outs = await collect(engine, prompts()[0], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(outs[-1].outputs[0].token_ids) == 3


async def test_bad_request_raises_in_the_caller_only(engine):
    too_long = list(range(2, 500)) * 200
    with pytest.raises(ValueError, match="max_model_len"):
        await collect(engine, too_long, SamplingParams(max_tokens=2))
    outs = await collect(engine, prompts()[1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert outs[-1].outputs[0].finish_reason == "length"


async def test_explicit_abort_reports_the_abort(engine):
    params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    stream = engine.generate(prompts()[3], params, request_id="stop-me")
    first = await stream.__anext__()
    engine.abort("stop-me")
    last = first
    async for out in stream:
        last = out
    assert last.finished and last.outputs[0].finish_reason == "abort"


async def test_generate_before_start_is_an_error(tiny_dir):
    eng = AsyncEngine.from_pretrained(tiny_dir, dtype="float32", accelerator="cpu", block_size=128)
    with pytest.raises(RuntimeError, match="start"):
        async for _ in eng.generate([5], SamplingParams()):
            pass


async def test_request_finished_hook_sees_every_finished_request(tiny_dir):
    from deepserve.core.hookspecs import hookimpl
    from deepserve.core.plugins import make_plugin_manager

    seen = []

    class Observer:
        @hookimpl
        def deepserve_request_finished(self, request, stats):
            seen.append((request.request_id, stats))

    eng = AsyncEngine.from_pretrained(tiny_dir, dtype="float32", accelerator="cpu", block_size=128)
    eng.plugin_manager = make_plugin_manager(load_entrypoints=False, plugins=[Observer()])
    await eng.start()
    try:
        await collect(eng, prompts()[0], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), "done")
        stream = eng.generate(prompts()[1], SamplingParams(temperature=0, max_tokens=500, ignore_eos=True), "left")
        await stream.__anext__()
        await stream.aclose()  # the client went away
    finally:
        await eng.shutdown()
    stats = dict(seen)
    assert set(stats) == {"done", "left"}
    assert stats["done"].finish_reason == "length" and stats["done"].num_output_tokens == 3
    assert stats["done"].num_prompt_tokens == 5 and stats["done"].time_to_first_token is not None
    assert stats["left"].finish_reason == "abort"
    assert not eng.is_dead


def _snapshot(n: int, finished: bool = False):
    from deepserve.core.outputs import CompletionOutput, RequestOutput

    completion = CompletionOutput(0, "x" * n, list(range(n)), finish_reason="length" if finished else None)
    return RequestOutput("r", None, [1], None, [completion], finished)


async def test_a_consumer_behind_the_engine_reads_the_newest_snapshot_then_the_end():
    from deepserve.core.async_engine import _Stream

    stream = _Stream()
    for n in (1, 2, 3):  # three steps while the consumer was busy: cumulative, so the newest holds them all
        stream.put(_snapshot(n))
    stream.put(_snapshot(4, finished=True))  # the end always comes on its own
    assert [len((await stream.get()).outputs[0].token_ids) for _ in range(2)] == [3, 4]
    stream.put(_snapshot(5))
    stream.put(error := RuntimeError("the engine thread failed"))
    stream.put(_snapshot(6))  # nothing overtakes an error
    assert len((await stream.get()).outputs[0].token_ids) == 5
    assert await stream.get() is error
    waiter = asyncio.ensure_future(stream.get())
    assert len((await waiter).outputs[0].token_ids) == 6
    waiter = asyncio.ensure_future(stream.get())  # a waiting consumer is woken by the next put
    await asyncio.sleep(0)
    stream.put(_snapshot(7))
    assert len((await asyncio.wait_for(waiter, 5)).outputs[0].token_ids) == 7
