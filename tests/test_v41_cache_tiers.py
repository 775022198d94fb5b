"""V4's cache tiers on the V4.1 engine path (docs/v41.md, "Cache tiers"): V4.1's page pools (the kv sources' rows
and index keys, the page-boundary snapshots and their host values) copy out and back bit for bit; an engine that
restarts over a `dir://` store (through `LLM` or `deepserve serve --kv-store`) hits it and gives the cold run's
bits, and corrupt or truncated blocks are misses; the host tier serves what the GPU pages evicted; KV events
publish stored and removed blocks; a store without window snapshots is hit through V4.1's SWA replay, exact
(the cold bits) or bounded (counted in /metrics)."""

from __future__ import annotations

import time
import types

import pytest
import torch

from deepserve import LLM, SamplingParams
from deepserve.core.kv.prefix_hash import block_hashes
from deepserve.model.v41.paged import bytes_per_page, page_pool_bytes, read_pages, write_pages
from deepserve.model.v41.replay import BOUNDED_LENGTH, exact_length
from test_cache_events import receive, subscribe
from test_cache_swa_metrics import samples
from test_v41_engine import TINY_A, prompt

P = 128
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)


def make_llm(**options) -> LLM:
    torch.set_num_threads(1)
    return LLM(model=str(TINY_A), block_size=P, max_num_seqs=2, **options)


def run(llm, ids: list[int]):
    return llm.generate([ids], GREEDY, use_tqdm=False)[0]


def bits(out) -> list[tuple[int, float]]:
    """The generated tokens with their logprobs (compared exactly)."""
    c = out.outputs[0]
    return [(t, lp[t].logprob) for t, lp in zip(c.token_ids, c.logprobs)]


@pytest.fixture(scope="module")
def cold():
    """Three full pages and a tail (B = 384 > tiny_a's window x depth = 256, so an exact replay is a real
    one), its greedy tokens and logprobs on an engine with no tier below the pages, and a page's bytes."""
    ids = prompt(3 * P + 20, seed=11)
    llm = make_llm()
    out = run(llm, ids)
    assert out.num_cached_tokens == 0
    return ids, bits(out), bytes_per_page(llm.model.state_owners(), P)


def test_v41_pages_copy_out_and_back_bit_for_bit(cold):
    ids, _, _ = cold
    llm = make_llm()
    run(llm, ids)
    states = llm.cache
    table = [llm.kv_manager.pool.get_cached(h) for h in block_hashes(ids, P)]  # the prompt's three full pages
    blocks = read_pages(states, table[:2])
    assert set(blocks[0]) == set(page_pool_bytes(states)) == {"layers.rows", "layers.index", "layers.snapshot",
                                                               "dspark_layers.snapshot", "sequence.snapshot"}
    spare = [p for p in range(states.num_pages) if p not in table][:2]
    write_pages(states, spare, blocks)
    assert read_pages(states, spare) == blocks
    first, slot = states.new_sequence(table[:2], 2 * P)  # from the second page's snapshot, host values too
    states.free_sequence(slot)
    again, slot = states.new_sequence(spare, 2 * P)  # from its copy: the same state
    states.free_sequence(slot)
    assert (again.num_tokens, again.engram_history, again.index_key_publisher) == \
        (first.num_tokens, first.engram_history, first.index_key_publisher) and first.num_tokens == 2 * P
    assert first.engram_history and all(torch.equal(a.ring, b.ring) for a, b in zip(again.layers, first.layers))
    assert all(torch.equal(a.rows, b.rows) for a, b in zip(again.layers, first.layers) if a.spec.owns_rows)
    with pytest.raises(ValueError, match="bytes for 1 pages"):
        write_pages(states, spare[:1], [{**blocks[0], "layers.rows": b"short"}])


def test_a_restarted_engine_hits_the_dir_store_with_the_cold_bits_and_bad_blocks_are_misses(cold, tmp_path):
    ids, expected, _ = cold
    uri = f"dir://{tmp_path}/kv"
    first = make_llm(kv_store=uri)
    assert "/v41-paged-1-p128-" in first.engine.kv_tiers.namespace  # V4.1's layout, not V4's
    assert bits(run(first, ids)) == expected
    first.engine.shutdown()  # the writes in flight finish
    files = list((tmp_path / "kv").rglob("*.blk"))
    assert len(files) == 3 * 5  # three full pages, in five pools
    second = make_llm(kv_store=uri)  # a restart
    out = run(second, ids)
    assert out.num_cached_tokens == 3 * P and bits(out) == expected
    store = second.engine.snapshot().kv_tiers["store"]
    assert store.num_hit_tokens == 3 * P and store.num_errors == 0

    for i, path in enumerate(files):  # every block corrupt (a flipped bit) or truncated
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x01
        path.write_bytes(bytes(data if i % 2 else data[:-7]))
    third = make_llm(kv_store=uri)
    out = run(third, ids)
    assert out.num_cached_tokens == 0 and bits(out) == expected and out.finished
    assert third.engine.snapshot().kv_tiers["store"].num_hit_tokens == 0


def test_with_dspark_a_restart_restores_the_drafters_rings_from_the_store(cold, tmp_path):
    ids, expected, _ = cold
    spec = {"method": "dspark", "num_speculative_tokens": 2}
    for restart in (False, True):  # the second engine starts over the store the first one filled
        llm = make_llm(kv_store=f"dir://{tmp_path}/kv", speculative_config=spec)
        out = run(llm, ids)
        assert out.num_cached_tokens == (3 * P if restart else 0)
        assert out.outputs[0].token_ids == [t for t, _ in expected]
        table = [llm.kv_manager.pool.get_cached(h) for h in block_hashes(ids, P)]
        state, slot = llm.cache.new_sequence(table, 3 * P)  # what a hit on the prefix starts from
        llm.cache.free_sequence(slot)
        assert state.dspark_num_tokens == 3 * P and any(bool(st.ring.any()) for st in state.dspark)
        llm.engine.shutdown()


def test_the_host_tier_serves_blocks_the_gpu_pages_evicted(cold):
    ids, expected, page_bytes = cold
    llm = make_llm(kv_cache_bytes=5 * page_bytes, host_cache_bytes=2**24)
    assert bits(run(llm, ids)) == expected
    run(llm, prompt(4 * P + 20, seed=12))  # takes every GPU page
    out = run(llm, ids)
    assert out.num_cached_tokens == 3 * P and bits(out) == expected
    host = llm.engine.snapshot().kv_tiers["host"]
    assert host.num_hit_tokens == 3 * P and "store" not in llm.engine.snapshot().kv_tiers


def test_kv_events_publish_stored_and_removed_blocks(tmp_path, cold):
    from deepserve.plugins.cache import kv_events as wire

    _, _, page_bytes = cold
    endpoint = f"ipc://{tmp_path}/kv-events"
    llm = make_llm(kv_cache_bytes=4 * page_bytes,
                   kv_events_config={"enable_kv_cache_events": True, "endpoint": endpoint, "topic": "kv"})
    socket = subscribe(endpoint)
    time.sleep(0.3)  # the subscription reaches the publisher (PUB drops what no subscriber asked for yet)
    ids = prompt(2 * P + 10, seed=13)
    run(llm, ids)
    stored = receive(socket, lambda ev: sum(isinstance(e, wire.BlockStored) for e in ev) >= 2)
    hashes = block_hashes(ids, P)
    assert [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in stored] == \
        [([hashes[0]], None, ids[:P]), ([hashes[1]], hashes[0], ids[P : 2 * P])]
    run(llm, prompt(3 * P + 10, seed=14))  # needs every page: the first prompt's go
    later = receive(socket, lambda ev: any(isinstance(e, wire.BlockRemoved) for e in ev))
    removed = [h for e in later if isinstance(e, wire.BlockRemoved) for h in e.block_hashes]
    assert removed and set(removed) <= set(hashes[:2])
    llm.parts.kv_events.close()
    socket.close()


def test_a_store_without_snapshots_is_hit_through_v41_replay_exact_bits_and_bounded_counted(cold, tmp_path):
    from deepserve.server.metrics import ServerMetrics

    ids, expected, _ = cold
    uri = f"dir://{tmp_path}/kv"

    def engine(mode):
        return make_llm(kv_store=uri, kv_store_snapshots=False, swa_replay=mode)

    def replays(llm) -> dict:
        server = ServerMetrics()
        server.engine = types.SimpleNamespace(snapshot=llm.engine.snapshot, engine=llm.engine)
        found = samples(server.render().decode())
        mode = (("mode", llm.engine.swa_replay_mode),)
        return found[("deepserve_swa_replays_total", mode)], found[("deepserve_swa_replay_tokens_total", mode)]

    first = engine("exact")
    assert bits(run(first, ids)) == expected
    first.engine.shutdown()
    pools = {path.parent.name for path in tmp_path.rglob("*.blk")}
    assert pools == {"layers_rows", "layers_index"}  # no snapshot pool in the store

    exact = engine("exact")  # a restart: the rows from the store, the last page's snapshot replayed
    out = run(exact, ids)
    assert exact_length(exact.model.cfg) == 256 < 3 * P
    assert out.num_cached_tokens == 3 * P and bits(out) == expected  # the cold run's bits
    assert replays(exact) == (1, 256)
    again = run(exact, ids)  # a GPU hit on the replayed page: nothing more to replay
    assert again.num_cached_tokens == 3 * P and bits(again) == expected and replays(exact) == (1, 256)

    bounded = engine("bounded")
    out = run(bounded, ids)
    assert out.num_cached_tokens == 3 * P and len(out.outputs[0].token_ids) == 4
    assert replays(bounded) == (1, BOUNDED_LENGTH)
    with pytest.raises(ValueError, match="not with DSpark"):
        make_llm(kv_store=uri, kv_store_snapshots=False, speculative_config={"method": "dspark",
                                                                             "num_speculative_tokens": 2})


async def test_serve_with_kv_store_flags_restarts_onto_the_store(aiohttp_client, cold, tmp_path):
    from deepserve.cli import build_parser, engine_options
    from deepserve.core.plugins import make_plugin_manager
    from deepserve.server import ServerConfig, create_app

    ids, expected, _ = cold
    args = build_parser().parse_args(["serve", str(TINY_A), "--block-size", str(P), "--max-num-seqs", "2",
                                      "--kv-store", f"dir://{tmp_path}/kv"])
    config = ServerConfig(model=str(TINY_A), served_model_name="v41", engine_kwargs=engine_options(args))
    body = {"model": "v41", "prompt": ids, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    cached = []
    for _ in range(2):  # the second server starts over the store the first one filled
        torch.set_num_threads(1)
        client = await aiohttp_client(create_app(config, plugin_manager=make_plugin_manager(load_entrypoints=False)))
        r = await client.post("/v1/completions", json=body)
        assert r.status == 200, await r.text()
        usage = (await r.json())["usage"]
        cached.append(usage["prompt_tokens_details"]["cached_tokens"])
        await client.close()  # the engine stops: its store writes finish
    assert cached == [0, 3 * P]


def test_what_v41_still_lacks_is_refused_by_name():
    with pytest.raises(ValueError, match="does not take data_parallel_size / enable_expert_parallel yet"):
        make_llm(data_parallel_size=2)
