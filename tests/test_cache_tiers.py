"""The cache tiers below the GPU pages on the real tiny model: a host-memory LRU and a block store (dir://,
ec:10+2). An engine that restarts over the same store gets prefix hits with bit-identical greedy outputs (the
reference backend is batch-invariant, so hits change no bit); corrupt, missing and hanging stores are misses,
never failed requests; `num_cached_tokens` and the per-tier counters count every tier."""

from __future__ import annotations

import asyncio
import random
import shutil

import pytest
import torch

from deepserve import LLM, SamplingParams
from deepserve.build import build_engine, resolve_config
from deepserve.core.hookspecs import hookimpl
from deepserve.core.kv.manager import KVCacheManager
from deepserve.core.kv.prefix_hash import block_hashes
from deepserve.core.kv.store import BlockStore, StoreStats
from deepserve.core.kv.store import GuardedStore
from deepserve.core.kv.tiers import HostTier, KVTiers
from deepserve.plugins.cache.memory_store import MemoryStore
from deepserve.core.plugins import make_plugin_manager
from deepserve.core.request import Request
from deepserve.core.scheduler.scheduler import Scheduler
from deepserve.model.kv_cache import bytes_per_page, page_pool_bytes, read_pages, write_pages

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
P = 128


def make_llm(tiny_dir, **kw):
    return LLM(tiny_dir, dtype="float32", accelerator="cpu", block_size=P, **kw)


def prompts(seed: int, n: int = 2, length: int = 300) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(2, 512) for _ in range(P + 10)]  # a common first page: one block shared by both
    return [shared + [rng.randrange(2, 512) for _ in range(length - len(shared))] for _ in range(n)]


def run(llm, items, params=GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in items], params, use_tqdm=False)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def cold(tiny_dir):
    """The prompts, their greedy outputs on an engine with no tier below the GPU, and the bytes of a page."""
    items = prompts(0)
    llm = make_llm(tiny_dir)
    outs = run(llm, items)
    assert all(o.num_cached_tokens == 0 for o in outs)
    return items, tokens(outs), bytes_per_page(llm.model, P, torch.float32)


# -- the tiers' parts, alone ---------------------------------------------------------------------------------------
def test_host_tier_evicts_least_recently_used_blocks_past_its_capacity():
    host = HostTier(capacity_bytes=300)
    for h in (b"a", b"b", b"c"):
        assert host.put(h, {"csa": bytes(60), "snapshot": bytes(40)})
    assert [len(b) for b in host.get_run([b"a"])] == [2]  # a is now the most recently used
    assert host.put(b"d", {"csa": bytes(100)})
    assert host.order() == [b"c", b"a", b"d"] and host.num_bytes == 300  # b went first
    assert len(host.get_run([b"c", b"x", b"a"])) == 1  # a run stops at the first block it lacks
    assert not host.put(b"e", {"csa": bytes(301)})  # larger than the tier: not taken
    assert host.stats.num_evicted_blocks == 1 and host.stats.num_stored_blocks == 4
    with pytest.raises(ValueError, match="host_cache_bytes"):
        HostTier(0)


def block(i: int) -> dict[str, bytes]:
    return {"csa": bytes([i]) * 30, "snapshot": bytes([i + 1]) * 10}


def wait_for_load(tiers: KVTiers):
    for _ in range(200):
        done = tiers.poll()
        if done:
            return done[0]
        tiers.wait(0.05)
    raise AssertionError("the load did not finish")


def test_tiers_read_host_then_store_promote_store_hits_and_write_both():
    store = MemoryStore()
    host = HostTier(capacity_bytes=10_000)
    tiers = KVTiers("ns", {"csa": 30, "snapshot": 10}, P, host, GuardedStore(store), ttl_class="agent")
    hashes = [bytes([i]) * 32 for i in range(5)]
    tiers.offload(hashes[:4], [block(i) for i in range(4)])  # blocks 0-3 computed: into both tiers
    assert tiers.flush(5) and len(store._blocks) == 8 and len(host) == 4
    tiers.offload(hashes[:1], [block(0)])  # again (its GPU page went): the tiers hold it already
    assert tiers.flush(5) and tiers.store_stats.num_stored_blocks == 4
    host._blocks.pop(hashes[2])
    host._blocks.pop(hashes[3])
    assert tiers.start_load("r", hashes, first=1)  # the GPU holds block 0
    load = wait_for_load(tiers)
    assert load.blocks() == [block(1), block(2), block(3)] and len(load.host) == 1
    assert hashes[2] in host and hashes[3] in host  # the store's blocks were promoted
    tiers.record(load, 3)
    stats = tiers.snapshot()
    assert (stats["host"].num_hit_tokens, stats["store"].num_hit_tokens) == (P, 2 * P)
    assert stats["store"].num_hit_bytes == 2 * 40 and stats["store"].load_seconds > 0
    assert not tiers.start_load("s", hashes[:1], first=1)  # nothing past the GPU's blocks: nothing to wait for
    assert tiers.start_load("t", [b"x" * 32], first=0)  # the host lacks it: the store is asked, and lacks it too
    assert wait_for_load(tiers).blocks() == []
    tiers.close()


def test_store_writes_in_flight_are_bounded_and_the_rest_dropped():
    class Slow(MemoryStore):
        async def put_many(self, items, ttl_class=None):
            await asyncio.sleep(0.5)
            return await super().put_many(items, ttl_class)

    tiers = KVTiers("ns", {"csa": 30, "snapshot": 10}, P, None, GuardedStore(Slow(), deadline=5))
    from deepserve.core.kv import tiers as tiers_module

    for i in range(tiers_module.MAX_WRITES_IN_FLIGHT + 3):
        tiers.offload([bytes([i % 256, i // 256]) * 16], [block(i % 200)])
    assert tiers.store_stats.num_dropped_writes == 3
    tiers.close()
    assert tiers.store_stats.num_stored_blocks == tiers_module.MAX_WRITES_IN_FLIGHT


def test_loaded_pages_are_held_for_their_request_until_it_looks_them_up():
    kv = KVCacheManager(num_blocks=4, block_size=P)
    ids = list(range(3 * P + 1))
    hashes = block_hashes(ids, P)
    kv.allocate_slots("a", P)
    kv.cache_full_blocks("a", ids, P)
    kv.free("a")  # block 0 is cached in a free page
    new = kv.prepare_load("b", hashes, first=1)  # blocks 1 and 2 came from a lower tier
    assert [i for i, _ in new] == [1, 2] and kv.num_free_blocks == 1
    assert kv.allocate_slots("other", P) is not None and kv.allocate_slots("more", P) is None  # held: not evicted
    pages, cached = kv.get_computed_blocks("b", ids)
    assert cached == 3 * P and pages[1:] == [p for _, p in new]
    kv.free("b")
    kv.free("other")
    assert kv.num_free_blocks == 4
    kv.prepare_load("c", hashes, first=3)
    kv.free("c")  # an aborted wait gives back its hold
    assert kv.num_free_blocks == 4


def test_a_request_loading_its_prefix_waits_while_others_pass():
    kv = KVCacheManager(num_blocks=16, block_size=P)
    scheduler = Scheduler(kv, None, max_num_seqs=4, max_num_batched_tokens=1024, max_model_len=2048)
    scheduler.add_request(Request("loading", list(range(300)), GREEDY), loading_kv=True)
    scheduler.add_request(Request("plain", list(range(5)), GREEDY))
    assert [c.request_id for c in scheduler.schedule().chunks] == ["plain"]
    scheduler.kv_loaded("loading")
    assert "loading" in [c.request_id for c in scheduler.schedule().chunks]


def test_pages_copy_out_and_back_bit_for_bit(tiny_dir):
    llm = make_llm(tiny_dir)
    run(llm, prompts(1, n=1))
    cache = llm.cache
    blocks = read_pages(cache, [0, 1])
    assert set(blocks[0]) == set(page_pool_bytes(cache)) == {"layers.csa", "layers.hca", "layers.index",
                                                             "layers.snapshot"}
    assert sum(page_pool_bytes(cache).values()) <= bytes_per_page(llm.model, P, torch.float32)
    write_pages(cache, [3, 2], blocks)
    assert read_pages(cache, [3, 2]) == blocks
    with pytest.raises(ValueError, match="bytes for 1 pages"):
        write_pages(cache, [3], [{**blocks[0], "layers.csa": b"short"}])


# -- an engine over a store ----------------------------------------------------------------------------------------
def test_a_restarted_engine_hits_the_dir_store_with_identical_outputs(tiny_dir, cold, tmp_path):
    items, expected, _ = cold
    uri = f"dir://{tmp_path}/kv"
    first = make_llm(tiny_dir, kv_store=uri)
    assert tokens(run(first, items)) == expected
    first.engine.shutdown()  # the writes in flight finish
    files = list((tmp_path / "kv").rglob("*.blk"))
    assert len(files) == 3 * 4  # the shared page and each prompt's second page, in 4 pools
    second = make_llm(tiny_dir, kv_store=uri)
    outs = run(second, items)
    assert tokens(outs) == expected
    assert [o.num_cached_tokens for o in outs] == [2 * P, 2 * P]  # the first page from the store, then the GPU
    store = second.engine.snapshot().kv_tiers["store"]
    assert store.num_hit_tokens == 3 * P and store.num_errors == 0 and store.num_hit_bytes > 0
    assert second.kv_manager.num_prefix_hits == 4 * P  # every tier's hits count as the request's cached tokens

    corrupt = {}
    for i, path in enumerate(files):  # every block corrupt (a flipped bit) or truncated
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x01
        corrupt[path] = bytes(data if i % 2 else data[:-7])
        path.write_bytes(corrupt[path])
    third = make_llm(tiny_dir, kv_store=uri)
    outs = run(third, items)
    assert tokens(outs) == expected  # every block a miss; correct outputs
    store = third.engine.snapshot().kv_tiers["store"]
    assert store.num_hit_tokens == 0 and store.num_hit_bytes == 0
    # the prompt whose store lookup ends last may still hit the other's shared page on the GPU once that page is
    # computed (either prompt can be that one), so one of them 0 or P, the other 0, never more
    assert sorted(o.num_cached_tokens for o in outs) in ([0, 0], [0, P])
    third.engine.shutdown()
    assert all(path.read_bytes() != corrupt[path] for path in files)  # each bad file went; recomputed, written anew


def test_ec_store_across_a_restart_with_two_shards_lost(tiny_dir, cold, tmp_path):
    items, expected, _ = cold
    uri = f"ec:10+2:dir://{tmp_path}/kv"
    first = make_llm(tiny_dir, kv_store=uri)
    run(first, items)
    first.engine.shutdown()
    for shard in ("shard02", "shard07"):
        shutil.rmtree(tmp_path / "kv" / shard)
    second = make_llm(tiny_dir, kv_store=uri)
    outs = run(second, items)
    assert tokens(outs) == expected and [o.num_cached_tokens for o in outs] == [2 * P, 2 * P]
    assert second.engine.snapshot().kv_tiers["store"].num_hit_tokens == 3 * P


def test_a_speculative_engine_stores_and_restores_the_drafters_state_too(tmp_path):
    """With MTP speculation the drafter's window snapshots are a pool of their own; a restarted engine's hits
    restore them with the main layers', and its greedy tokens are the cold run's."""
    from pathlib import Path

    import deepserve

    embedded = Path(deepserve.__file__).parent / "assets" / "deepserve-tiny-v4"
    rng = random.Random(2)
    prompt = [rng.randrange(2, 400) for _ in range(300)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def run():
        llm = LLM(embedded, dtype="float32", accelerator="cpu", block_size=P, load_plugins=False,
                  speculative_config={"method": "mtp", "num_speculative_tokens": 3}, kv_store=f"dir://{tmp_path}")
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        llm.engine.shutdown()
        return out

    cold = run()
    pools = {path.parent.name for path in tmp_path.rglob("*.blk")}
    assert pools == {"layers_csa", "layers_hca", "layers_index", "layers_snapshot", "mtp_layers_snapshot"}
    warm = run()
    assert cold.num_cached_tokens == 0 and warm.num_cached_tokens == 2 * P
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids


def test_the_host_tier_serves_blocks_the_gpu_pages_evicted(tiny_dir, cold):
    items, expected, page_bytes = cold
    llm = make_llm(tiny_dir, kv_cache_bytes=4 * page_bytes, host_cache_bytes=2**24)
    assert tokens(run(llm, items[:1])) == expected[:1]
    run(llm, prompts(7, n=2))  # other prompts take every GPU page
    out = run(llm, items[:1])[0]
    assert out.outputs[0].token_ids == expected[0] and out.num_cached_tokens == 2 * P
    host = llm.engine.snapshot().kv_tiers["host"]
    assert host.num_hit_tokens >= P and host.num_stored_blocks >= 2 and "store" not in llm.engine.snapshot().kv_tiers


class Hanging(BlockStore):
    """A store node that never answers."""

    async def longest_prefix(self, namespace, block_hashes, pools):
        await asyncio.Event().wait()

    async def get_many(self, keys, buffers):
        await asyncio.Event().wait()

    async def put_many(self, items, ttl_class=None):
        await asyncio.Event().wait()

    async def evict(self, keys):
        return 0

    async def stats(self):
        return StoreStats(0, 0)


class HangingStores:
    @hookimpl
    def deepserve_register_cache_backends(self, register):
        register("hang", lambda uri: Hanging())


def test_a_hanging_store_is_a_miss_within_its_deadline(tiny_dir, cold):
    items, expected, _ = cold
    config = resolve_config(tiny_dir, dtype="float32", accelerator="cpu", block_size=P, kv_store="hang://",
                            kv_store_deadline=0.2)
    parts = build_engine(config, make_plugin_manager(load_entrypoints=False, plugins=[HangingStores()]))
    engine = parts.engine
    engine.add_request("r", items[0], GREEDY)
    done = []
    for _ in range(10_000):
        done += [o for o in engine.step() if o.finished]
        if not engine.has_unfinished_requests():
            break
    assert done[0].outputs[0].token_ids == expected[0] and done[0].num_cached_tokens == 0
    engine.shutdown()  # the writes time out too: counted, not raised
    assert engine.kv_tiers.store_stats.num_errors >= 2


def test_a_request_aborted_while_its_prefix_loads_leaves_nothing_behind(tiny_dir, cold):
    items, _, _ = cold
    config = resolve_config(tiny_dir, dtype="float32", accelerator="cpu", block_size=P, kv_store="hang://",
                            kv_store_deadline=30.0)
    parts = build_engine(config, make_plugin_manager(load_entrypoints=False, plugins=[HangingStores()]))
    engine, kv = parts.engine, parts.kv_manager
    engine.add_request("waits", items[0], GREEDY)
    engine.add_request("short", items[0][:50], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.kv_tiers.num_loading == 1 and kv.block_tables.keys() <= {"short"}  # it waits; the other ran
    engine.abort(["waits"])
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv_tiers.num_loading == 0 and kv.num_free_blocks == kv.pool.num_blocks
    engine.shutdown()


def test_tier_counters_reach_metrics(tiny_dir, cold, tmp_path):
    from deepserve.server.metrics import ServerMetrics

    items, _, _ = cold
    llm = make_llm(tiny_dir, kv_store=f"dir://{tmp_path}/kv", host_cache_bytes=2**24)
    run(llm, items)

    class Engine:  # the AsyncEngine's face that metrics read: its snapshot and its core
        engine = llm.engine

        def snapshot(self):
            return llm.engine.snapshot()

    metrics = ServerMetrics()
    metrics.engine = Engine()
    text = metrics.render().decode()
    assert 'deepserve_kv_tier_stored_blocks_total{tier="host"} 3.0' in text
    assert 'deepserve_kv_tier_hit_tokens_total{tier="store"} 0.0' in text
    assert 'deepserve_kv_tier_errors_total{tier="store"} 0.0' in text


def test_serve_flags_reach_the_engine_options():
    from deepserve.cli import build_parser, engine_options

    args = build_parser().parse_args(["serve", "--host-cache-bytes", "4096", "--kv-store", "redis://h:6379/0",
                                      "--kv-store-deadline", "0.5", "--kv-store-ttl-class", "agent"])
    options = engine_options(args)
    assert (options["host_cache_bytes"], options["kv_store"], options["kv_store_deadline"],
            options["kv_store_ttl_class"]) == (4096, "redis://h:6379/0", 0.5, "agent")
    assert "kv_store" not in engine_options(build_parser().parse_args(["serve"]))


@pytest.mark.parametrize("options, message", [
    (dict(host_cache_bytes=0), "host_cache_bytes"),
    (dict(kv_store="nowhere"), "block store URI"),
    (dict(kv_store="dir:///tmp/x", kv_store_deadline=0), "kv_store_deadline"),
    (dict(kv_store="dir:///tmp/x", kv_store_ttl_class="week"), "kv_store_ttl_class"),
    (dict(kv_store="dir:///tmp/x", enable_prefix_caching=False), "enable_prefix_caching"),
])
def test_bad_tier_options_name_the_problem(options, message):
    with pytest.raises(ValueError, match=message):
        resolve_config("/nonexistent", **options)
