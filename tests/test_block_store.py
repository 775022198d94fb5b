"""The block-store seam: stores registered by URI scheme through `deepserve_register_cache_backends`, the memory
store behind it, and `GuardedStore`'s contract (a deadline on every call; an error or a timeout is a miss)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from deepserve.core.hookspecs import hookimpl
from deepserve.core.kv.store import BlockKey, BlockStore, GuardedStore, StoreNamespace, StoreRegistry, StoreStats
from deepserve.core.plugins import PluginError, collect_registrations, make_plugin_manager

NS = StoreNamespace("deepserve-tiny-v4", "rev0", "v4-paged-1", "float32").key


def keys(hashes, pool="csa"):
    return [BlockKey(NS, h, pool) for h in hashes]


def registry(*plugins) -> StoreRegistry:
    pm = make_plugin_manager(load_entrypoints=False, plugins=plugins)
    return StoreRegistry(collect_registrations(pm, "deepserve_register_cache_backends"))


async def test_memory_store_puts_gets_and_finds_the_longest_prefix():
    store = GuardedStore(registry().open("memory://"))
    assert await store.put_many([(k, bytes([i]) * 8) for i, k in enumerate(keys([11, 12, 13]))]) == 3
    assert await store.put_many([(k, b"x" * 8) for k in keys([11, 12], pool="hca")]) == 2
    assert await store.longest_prefix(NS, [11, 12, 13, 14], ["csa"]) == 3
    assert await store.longest_prefix(NS, [11, 12, 13], ["csa", "hca"]) == 2  # block 13 lacks its hca rows
    assert await store.longest_prefix("other-model/rev0/v4-paged-1/float32/0", [11], ["csa"]) == 0
    buffers = [bytearray(8), bytearray(8), bytearray(4)]
    assert await store.get_many(keys([12, 99, 13]), buffers) == [True, False, False]  # missing; wrong size
    assert bytes(buffers[0]) == bytes([1]) * 8
    assert await store.evict(keys([12, 12, 50])) == 1
    stats = await store.stats()
    assert (stats.num_blocks, stats.num_bytes, stats.num_hits, stats.num_misses) == (4, 32, 1, 2)


async def test_memory_store_evicts_the_least_recently_used_past_its_capacity():
    store = registry().open("memory://?capacity_bytes=24")
    await store.put_many([(k, b"a" * 8) for k in keys([1, 2, 3])])
    await store.get_many(keys([1]), [bytearray(8)])  # block 1 is now the most recent
    await store.put_many([(keys([4])[0], b"b" * 8), (keys([5])[0], b"c" * 100)])  # 5 is larger than the store
    assert [await store.longest_prefix(NS, [h], ["csa"]) for h in (1, 2, 3, 4, 5)] == [1, 0, 1, 1, 0]
    assert (await store.stats()).num_evictions == 1


@pytest.mark.parametrize("uri, message", [
    ("memory", "URI such as"),
    ("nosuch://x", "no block store serves the scheme 'nosuch'.*memory"),
    ("memory://host/path", "memory store URI"),
    ("memory://?capacity_bytes=-3", "capacity_bytes must be a positive integer"),
    ("memory://?size=3", "unknown option"),
    ("dir://relative/path", "absolute"),
    ("dir:///tmp/x?capacity_bytes=lots", "capacity_bytes must be an integer"),
    ("dir:///tmp/x?ttl=3", "unknown option"),
])
def test_a_malformed_or_unserved_uri_names_the_problem(uri, message):
    with pytest.raises(ValueError, match=message):
        registry().open(uri)


def test_the_namespace_refuses_parts_that_would_alias():
    with pytest.raises(ValueError, match="kv_dtype"):
        StoreNamespace("m", "r", "layout", "a/b")


class Hanging(BlockStore):
    """Never answers a read; fails every write; answers nonsense to a lookup."""

    async def longest_prefix(self, namespace, block_hashes, pools):
        return 10**6

    async def get_many(self, keys, buffers):
        await asyncio.Event().wait()

    async def put_many(self, items, ttl_class=None):
        raise ConnectionError("store node down")

    async def evict(self, keys):
        return 0

    async def stats(self):
        return StoreStats(0, 0)


async def test_a_hanging_or_failing_store_is_a_miss_and_counted(caplog):
    store = GuardedStore(Hanging(), deadline=0.05)
    caplog.set_level(logging.WARNING)
    assert await store.get_many(keys([1, 2]), [bytearray(8), bytearray(8)]) == [False, False]
    assert await store.put_many([(keys([1])[0], b"x")]) == 0
    assert await store.longest_prefix(NS, [1, 2], ["csa"]) == 2  # clamped to what was asked
    assert (await store.stats()).num_errors == 2
    assert "timed out" in caplog.text and "store node down" in caplog.text
    with pytest.raises(ValueError, match="deadline"):
        GuardedStore(Hanging(), deadline=0)


class ThirdPartyStores:
    """A plugin as a third-party package would write it: one scheme, a factory that reads its URI."""

    @hookimpl
    def deepserve_register_cache_backends(self, register):
        register("fake", lambda uri: FakeStore(uri))


class FakeStore(Hanging):
    def __init__(self, uri):
        self.uri = uri


def test_a_plugin_registers_a_scheme_and_the_registry_opens_it():
    stores = registry(ThirdPartyStores())
    assert stores.schemes == ["dir", "ec", "fake", "memory", "mooncake", "redis", "rediss"]
    assert stores.open("fake://node-1:9000/kv").uri == "fake://node-1:9000/kv"


def test_two_plugins_claiming_one_scheme_is_an_error():
    class Again:
        @hookimpl
        def deepserve_register_cache_backends(self, register):
            register("memory", lambda uri: None)

    with pytest.raises(PluginError, match="memory"):
        registry(Again())


def test_a_factory_that_returns_no_store_is_refused():
    class Broken:
        @hookimpl
        def deepserve_register_cache_backends(self, register):
            register("broken", lambda uri: object())

    with pytest.raises(TypeError, match="not a BlockStore"):
        registry(Broken()).open("broken://")


def test_an_engine_holds_the_stores_from_start_up(tiny_dir):
    from deepserve import LLM

    llm = LLM(tiny_dir, accelerator="cpu", dtype="float32", block_size=128, kv_cache_bytes=2**22)
    assert "memory" in llm.parts.block_stores.schemes


# -- dir:// (what a 3FS mount holds) ----------------------------------------------------------------------------
class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def test_dir_store_survives_a_new_process_and_drops_corrupt_blocks(tmp_path):
    from deepserve.plugins.cache.dir_store import DirStore

    uri = f"dir://{tmp_path}/kv"
    first = GuardedStore(registry().open(uri))
    await first.put_many([(k, bytes([i + 1]) * 64) for i, k in enumerate(keys([1, 2, 3]))])
    again = GuardedStore(registry().open(uri))  # as another engine, or the next process, sees it
    assert await again.longest_prefix(NS, [1, 2, 3, 4], ["csa"]) == 3
    buffers = [bytearray(64) for _ in range(3)]
    assert await again.get_many(keys([1, 2, 3]), buffers) == [True, True, True] and buffers[2] == bytes([3]) * 64
    files = sorted((tmp_path / "kv").rglob("*.blk"))
    files[0].write_bytes(files[0].read_bytes()[:-5])  # truncated
    data = bytearray(files[1].read_bytes())
    data[-1] ^= 0xFF  # one flipped bit: the checksum fails
    files[1].write_bytes(bytes(data))
    got = await again.get_many(keys([1, 2, 3]), [bytearray(64) for _ in range(3)])
    assert sum(got) == 1 and len(list((tmp_path / "kv").rglob("*.blk"))) == 1  # both bad files removed
    assert isinstance(again.store, DirStore)


async def test_dir_store_expires_by_ttl_class_and_evicts_lru_past_its_watermark(tmp_path):
    from deepserve.plugins.cache.dir_store import DAY, DirStore

    clock = Clock()
    store = DirStore(tmp_path, capacity_bytes=10 * 80, high=0.9, low=0.5, clock=clock)
    await store.put_many([(k, b"a" * 64) for k in keys([1])], ttl_class="agent")
    await store.put_many([(k, b"c" * 64) for k in keys([2])], ttl_class="chat")
    clock.now += 4 * DAY  # past agent's 3 days, inside chat's 7
    assert await store.longest_prefix(NS, [1], ["csa"]) == 0 and await store.longest_prefix(NS, [2], ["csa"]) == 1
    assert store.gc() == 1 and not (tmp_path / "agent" / str(int((clock.now - 4 * DAY) // DAY))).exists()
    for h in range(10, 19):  # 9 more blocks of 80 bytes on disk: 10 in all, past 90% of 800
        await store.put_many([(keys([h])[0], b"x" * 64)])
        clock.now += 1
    left = [h for h in [2, *range(10, 19)] if await store.longest_prefix(NS, [h], ["csa"])]
    assert len(left) * 80 <= 400 and left == sorted(left)[-len(left):]  # the oldest went first
    with pytest.raises(ValueError, match="ttl_class"):
        await store.put_many([(keys([1])[0], b"x")], ttl_class="forever")


async def test_dir_store_gc_passes_over_a_block_being_read(tmp_path, monkeypatch):
    import threading

    from deepserve.plugins.cache.dir_store import DirStore

    clock = Clock()
    store = DirStore(tmp_path, capacity_bytes=4 * 80, high=0.9, low=0.5, clock=clock)
    for h in range(3):
        await store.put_many([(keys([h])[0], bytes([h]) * 64)])
        clock.now += 1
    reading, collected = threading.Event(), threading.Event()
    plain = DirStore._read_file

    def slow_read(path):
        reading.set()
        assert collected.wait(10)
        return plain(path)

    monkeypatch.setattr(DirStore, "_read_file", staticmethod(slow_read))
    buffer = bytearray(64)
    read = asyncio.ensure_future(store.get_many(keys([0]), [buffer]))  # block 0: the least recently used
    assert await asyncio.to_thread(reading.wait, 10)
    await store.put_many([(keys([9])[0], b"n" * 64)])  # 4 blocks past 90% of 320 bytes: gc() runs
    collected.set()
    assert await read == [True] and buffer == bytes([0]) * 64  # not evicted under its reader
    assert [await store.longest_prefix(NS, [h], ["csa"]) for h in (0, 1, 2, 9)] == [1, 0, 0, 1]  # 1, 2 went
