"""The engine on the real tiny model: continuous batching, prefix reuse, preemption, chunking and the
asynchronous pipeline all leave every request's tokens exactly what it gets alone."""

from __future__ import annotations

import random

import pytest
import torch

from deepserve import LLM, SamplingParams


def make_llm(tiny_dir, **kw):
    kw.setdefault("block_size", 128)
    return LLM(tiny_dir, dtype="float32", accelerator="cpu", **kw)


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return make_llm(tiny_dir)


def workload(n: int, seed: int, shared: list[int] | None = None):
    """(arrival step, prompt ids, params): random lengths, greedy and seeded sampling mixed."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = (shared or []) + [rng.randrange(2, 512) for _ in range(rng.randint(1, 300))]
        if i % 2:
            params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 12), ignore_eos=True)
        else:
            params = SamplingParams(temperature=0.9, top_p=0.95, seed=rng.randrange(1 << 30),
                                    max_tokens=rng.randint(1, 12), ignore_eos=True)
        out.append((rng.randint(0, 20), prompt, params))
    return out


def serve(llm, items, aborts=()):
    """Add each request at its arrival step and step the engine until everything is done."""
    engine = llm.engine
    pending = sorted(enumerate(items), key=lambda x: x[1][0])
    results, step = {}, 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, params) = pending.pop(0)
            engine.add_request(f"w{i}", prompt, params)
        for out in engine.abort([f"w{j}" for j in dict(aborts).get(step, ())]):
            results[out.request_id] = out
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
        step += 1
    return [results[f"w{i}"] for i in range(len(items))]  # every request finishes or is aborted


def alone(llm, items):
    return [llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0].outputs[0].token_ids for _, p, sp in items]


def assert_everything_free(llm):
    assert not llm.engine.has_unfinished_requests()  # also means the runner has dropped their state
    assert llm.kv_manager.num_free_blocks == llm.kv_manager.pool.num_blocks
    assert not llm.kv_manager.block_tables
    assert llm.runner.num_active_sequences == 0 and llm.cache.num_free_slots == llm.cache.num_slots


@pytest.fixture(scope="module")
def reference(llm):
    items = workload(64, seed=1)
    return items, alone(llm, items)


def test_64_requests_with_random_arrivals_match_each_alone(llm, reference):
    items, ref = reference
    outs = serve(llm, items)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert_everything_free(llm)
    assert llm.engine.stats.host_gaps, "the host gap between device steps is measured"


@pytest.mark.parametrize("kw", [
    dict(max_num_batched_tokens=1), dict(max_num_batched_tokens=37, max_num_seqs=5),
    dict(async_scheduling=False), dict(enable_prefix_caching=False),
])
def test_chunk_sizes_and_modes_do_not_change_tokens(tiny_dir, reference, kw):
    items, ref = reference
    n = 6 if kw.get("max_num_batched_tokens") == 1 else 16  # a token a step: every prompt token is its own step
    items, ref = items[:n], ref[:n]
    other = make_llm(tiny_dir, **kw)
    assert [o.outputs[0].token_ids for o in serve(other, items)] == ref
    assert_everything_free(other)


def test_forced_preemption_gives_identical_tokens(tiny_dir, llm):
    from deepserve.model.kv_cache import bytes_per_page

    rng = random.Random(8)
    # prompts just under a page: every request needs a second page while it decodes
    items = [(rng.randint(0, 4), [rng.randrange(2, 512) for _ in range(rng.randint(100, 127))],
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)) for _ in range(12)]
    ref = alone(llm, items)
    page = bytes_per_page(llm.model, 128, torch.float32)
    small = make_llm(tiny_dir, kv_cache_bytes=5 * page)
    outs = serve(small, items)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert small.engine.scheduler.num_preemptions > 0
    assert_everything_free(small)


def test_prefix_hits_at_several_boundaries_change_nothing(tiny_dir):
    rng = random.Random(4)
    shared = [rng.randrange(2, 512) for _ in range(390)]  # prefixes end at 130, 257, 390: not multiples of 4 or 128
    items = []
    for i, cut in enumerate([130, 257, 390, 390, 257]):
        tail = [rng.randrange(2, 512) for _ in range(rng.randint(1, 70))]
        items.append((i * 3, shared[:cut] + tail, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)))
    cached = make_llm(tiny_dir)
    plain = make_llm(tiny_dir, enable_prefix_caching=False)
    with_hits = serve(cached, items)
    without = serve(plain, items)
    assert [o.outputs[0].token_ids for o in with_hits] == [o.outputs[0].token_ids for o in without]
    hits = [o.num_cached_tokens for o in with_hits]
    assert hits[0] == 0 and sorted(set(hits[1:])) == [128, 256, 384], hits
    assert all(o.num_cached_tokens == 0 for o in without)
    kv = cached.kv_manager
    assert kv.num_prefix_hits == sum(hits) and kv.num_prefix_queries > kv.num_prefix_hits
    assert_everything_free(cached)


def test_aborts_at_any_time_free_every_page(tiny_dir, reference):
    items, _ = reference
    llm = make_llm(tiny_dir)
    aborts = [(2, [1, 5]), (6, [0, 9, 12]), (15, [30, 31, 33])]
    outs = serve(llm, items[:40], aborts)
    aborted = {f"w{j}" for _, ids in aborts for j in ids}
    assert {o.request_id for o in outs if o.outputs[0].finish_reason == "abort"} <= aborted
    assert_everything_free(llm)


def test_seeded_request_is_the_same_in_a_busy_batch(llm, reference):
    items, _ = reference
    params = SamplingParams(temperature=1.0, seed=77, max_tokens=10, ignore_eos=True)
    prompt = items[3][1]
    solo = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
    busy = serve(llm, [(0, p, sp) for _, p, sp in items[:20]] + [(5, prompt, params)])[-1].outputs[0].token_ids
    assert solo == busy
