"""`ec:K+M:` erasure-coded block store (pyeclib, ISA-L): any K of K + M children decode a block; a read asks K + 1
and decodes from the first K; lost, failing, hanging and corrupt children are survived up to M of them."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from deepserve.core.kv.store import BlockKey, GuardedStore, StoreNamespace, StoreRegistry
from deepserve.core.plugins import collect_registrations, make_plugin_manager
from deepserve.plugins.cache.ec_store import ErasureCodedStore
from deepserve.plugins.cache.memory_store import MemoryStore

NS = StoreNamespace("deepserve-tiny-v4", "rev0", "v4-paged-1", "float32").key


def registry() -> StoreRegistry:
    return StoreRegistry(collect_registrations(make_plugin_manager(load_entrypoints=False),
                                               "deepserve_register_cache_backends"))


def keys(hashes, pool="csa"):
    return [BlockKey(NS, h, pool) for h in hashes]


def blocks(n: int, size: int = 3000) -> list[bytes]:
    return [bytes((i * 7 + j) % 251 for j in range(size)) for i in range(n)]


class Counting(MemoryStore):
    """A memory store that counts the reads it is asked for, and can fail, hang or lose what it holds."""

    def __init__(self):
        super().__init__()
        self.num_reads, self.mode = 0, "ok"

    async def get_many(self, keys, buffers):
        self.num_reads += 1
        if self.mode == "hang":
            await asyncio.Event().wait()
        if self.mode == "fail":
            raise ConnectionError("storage node down")
        return await super().get_many(keys, buffers)

    async def longest_prefix(self, namespace, block_hashes, pools):
        if self.mode == "hang":
            await asyncio.Event().wait()
        if self.mode == "fail":
            raise ConnectionError("storage node down")
        return await super().longest_prefix(namespace, block_hashes, pools)


def ec_over_memory(k=10, m=2):
    children = [Counting() for _ in range(k + m)]
    return ErasureCodedStore(children, k, m, straggler_seconds=0.02), children


async def read(store, hashes, size=3000):
    buffers = [bytearray(size) for _ in hashes]
    found = await store.get_many(keys(hashes), buffers)
    return found, [bytes(b) for b in buffers]


async def test_ec_dir_store_survives_any_two_lost_shard_directories(tmp_path):
    uri = f"dir://{tmp_path}/kv"
    store = GuardedStore(registry().open(f"ec:10+2:{uri}"))
    assert isinstance(store.store, ErasureCodedStore) and store.store.ec_type == "isa_l_rs_vand"
    data = blocks(4, 30000)
    assert await store.put_many(list(zip(keys(range(4)), data))) == 4
    shards = sorted((tmp_path / "kv").iterdir())
    assert [s.name for s in shards] == [f"shard{i:02d}" for i in range(12)]
    fragment_bytes = sum(f.stat().st_size for f in (tmp_path / "kv").rglob("*.blk"))
    assert fragment_bytes < 1.3 * sum(map(len, data))  # 12/10 of the data, plus small headers
    for lost in ([0, 1], [3, 11], [10, 11]):  # two data shards; one of each; both parities
        again = GuardedStore(registry().open(f"ec:10+2:{uri}"))  # a fresh process over the same root
        for i in lost:
            shutil.move(shards[i], tmp_path / f"away{i}")
        assert await again.longest_prefix(NS, [0, 1, 2, 3, 4], ["csa"]) == 4
        assert await read(again, range(4), 30000) == ([True] * 4, data)
        for i in lost:
            shutil.move(tmp_path / f"away{i}", shards[i])
    for i in (0, 5, 9):  # three lost: more than M, a miss and not an error
        shutil.rmtree(shards[i])
    again = GuardedStore(registry().open(f"ec:10+2:{uri}"))
    assert await again.longest_prefix(NS, [0, 1], ["csa"]) == 0
    assert (await read(again, [0], 30000))[0] == [False] and again.num_errors == 0


async def test_a_read_asks_k_plus_one_children_and_the_rest_only_when_needed():
    store, children = ec_over_memory()
    data = blocks(3)
    await store.put_many(list(zip(keys(range(3)), data)))
    assert await read(store, range(3)) == ([True] * 3, data)
    assert [c.num_reads for c in children] == [1] * 11 + [0]  # K + 1: the data fragments and one parity
    children[2].mode = "hang"  # a straggler among the first K + 1, and one that fails
    children[7].mode = "fail"
    assert await read(store, range(3)) == ([True] * 3, data)
    assert children[11].num_reads == 1  # asked once the failure used up the spare
    assert store.num_child_errors == 1


async def test_corrupt_or_stale_fragments_are_dropped_and_decoded_around():
    store, children = ec_over_memory()
    data = blocks(2)
    await store.put_many(list(zip(keys(range(2)), data)))
    key = keys([0])[0]
    bad = bytearray(children[4]._blocks[key])
    bad[-10] ^= 0x40  # one flipped bit in a fragment: its frame's CRC fails
    children[4]._blocks[key] = bytes(bad)
    stale = ErasureCodedStore([MemoryStore() for _ in range(12)], 10, 2).encode(b"\x00" * 3000)
    children[6]._blocks[key] = stale[6]  # a well-framed fragment of another write: the block's CRC finds it
    assert await read(store, [0, 1]) == ([True, True], data)
    for i in (1, 3, 8):
        children[i]._blocks.pop(keys([1])[0])
    assert (await read(store, [0, 1]))[0] == [True, False]  # three fragments gone: past M, a miss


async def test_a_lookup_takes_the_prefix_k_children_hold_and_does_not_wait_for_a_straggler():
    store, children = ec_over_memory()
    await store.put_many(list(zip(keys(range(5)), blocks(5, 100))))
    children[0].mode = "hang"
    for i in (3, 9):  # two children lost the last two blocks
        for h in (3, 4):
            children[i]._blocks.pop(keys([h])[0])
    guarded = GuardedStore(store, deadline=5.0)
    assert await guarded.longest_prefix(NS, list(range(6)), ["csa"]) == 3  # of 11 answers, only 9 hold all 5
    children[0].mode = "ok"
    assert await guarded.longest_prefix(NS, list(range(6)), ["csa"]) == 5  # 10 children hold all 5
    assert guarded.num_errors == 0


@pytest.mark.parametrize("uri, message", [
    ("ec:10:dir:///tmp/x", "ec:K\\+M"),
    ("ec:0+2:dir:///tmp/x", "K >= 1"),
    ("ec:2+1:memory://,memory://", "needs 3 child store URIs"),
    ("ec:2+1:memory://,memory://,nosuch://", "no block store serves the scheme 'nosuch'"),
])
def test_a_malformed_ec_uri_names_the_problem(uri, message):
    with pytest.raises(ValueError, match=message):
        registry().open(uri)


async def test_ec_over_child_uris_of_any_store():
    store = registry().open("ec:2+1:memory://,memory://,memory://")
    await store.put_many([(keys([1])[0], b"abc" * 50)])
    store.children[0]._blocks.clear()
    assert await read(store, [1], 150) == ([True], [b"abc" * 50])
