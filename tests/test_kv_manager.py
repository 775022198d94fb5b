"""The KV page bookkeeping: block pool, prefix hashes and the manager, driven as the scheduler drives them."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from deepserve.core.kv import (
    BlockPool,
    KVCacheManager,
    NoFreeBlocksError,
    block_hashes,
    hash_block,
    pages_for_budget,
    rows_per_page,
    validate_block_size,
)

B = 128  # block size used throughout


def make_manager(num_blocks: int = 16, block_size: int = B, **kwargs) -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size, **kwargs)


def tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(129_280) for _ in range(n)]


def prefill(mgr: KVCacheManager, rid: str, toks: list[int], salt: str | None = None) -> int:
    """Schedule a whole prompt as one step and cache its full blocks; returns the prefix hit in tokens."""
    _, num_cached = mgr.get_computed_blocks(rid, toks, salt)
    assert mgr.allocate_slots(rid, len(toks)) is not None
    mgr.cache_full_blocks(rid, toks, len(toks), salt)
    return num_cached


def assert_consistent(mgr: KVCacheManager) -> None:
    """Every reference the pool counts is one entry of one block table, and free pages are unreferenced."""
    held = [page for table in mgr.block_tables.values() for page in table]
    pool = mgr.pool
    assert sum(pool.ref_count(p) for p in range(pool.num_blocks)) == len(held)
    assert pool.num_free_blocks == sum(pool.ref_count(p) == 0 for p in range(pool.num_blocks))


# ---------------------------------------------------------------- pool


def test_allocate_is_all_or_nothing():
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert not pool.can_allocate(2)
    with pytest.raises(NoFreeBlocksError, match="asked for 2 KV pages but only 1 of 4 are free"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1 and pool.usage == 0.75
    with pytest.raises(ValueError, match="must be positive"):
        BlockPool(0)


def test_double_free_is_an_error():
    pool = BlockPool(2)
    pages = pool.allocate(1)
    pool.free(pages)
    with pytest.raises(ValueError, match="freed more often than it was taken"):
        pool.free(pages)


def test_lru_evicts_least_recently_freed_first():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    for page, h in ((a, b"ha"), (b, b"hb"), (c, b"hc")):
        pool.cache_block(page, h)
    pool.free([b])
    pool.free([c])
    pool.free([a])
    assert pool.num_cached_blocks == 3
    assert pool.allocate(1) == [b]
    assert pool.get_cached(b"hb") is None  # evicted
    assert pool.allocate(1) == [c]
    assert pool.get_cached(b"ha") == a  # the most recently freed survives


def test_touch_revives_a_free_cached_page_and_protects_it_from_eviction():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache_block(a, b"ha")
    pool.free([a, b])
    assert pool.get_cached(b"ha") == a and pool.ref_count(a) == 0
    pool.touch([a])
    assert pool.ref_count(a) == 1 and pool.num_free_blocks == 1
    assert pool.allocate(1) == [b]  # a is in use, so b is the only candidate
    assert not pool.can_allocate(1)
    assert pool.get_cached(b"ha") == a


def test_duplicate_block_keeps_the_first_copy():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, b"h")
    assert not pool.cache_block(b, b"h")
    assert pool.cache_block(a, b"h")  # same page, same hash: no-op
    assert pool.get_cached(b"h") == a and pool.block_hash(b) is None
    with pytest.raises(ValueError, match="already cached under another"):
        pool.cache_block(a, b"other")
    pool.free([a, b])
    with pytest.raises(ValueError, match="not in use"):
        pool.cache_block(b, b"x")


# ---------------------------------------------------------------- hashes


@pytest.mark.parametrize("bad", [0, -128, 64, 100, 129, 200, 128.0])
def test_block_size_must_be_a_multiple_of_128(bad):
    with pytest.raises(ValueError, match="multiple of 128"):
        validate_block_size(bad)
    with pytest.raises(ValueError, match="multiple of 128"):
        KVCacheManager(8, bad)


def test_block_hashes_cover_full_blocks_only_and_chain():
    toks = tokens(3 * B + 5)
    hashes = block_hashes(toks, B)
    assert len(hashes) == 3 and all(isinstance(h, bytes) and len(h) == 32 for h in hashes)
    assert block_hashes(toks[: 2 * B], B) == hashes[:2]
    # a different first token changes every later hash: each hash names the whole prefix
    other = block_hashes([toks[0] + 1] + toks[1:], B)
    assert all(x != y for x, y in zip(hashes, other))
    assert hash_block(None, [1, 2]) != hash_block(None, [1, 2], ("",))
    assert hash_block(None, [1], ("ab",)) != hash_block(None, [1], ("a", "b"))
    assert hash_block(None, [1], (1,)) != hash_block(None, [1], ("1",))


def test_salt_goes_into_the_first_block_so_salted_chains_share_nothing():
    toks = tokens(3 * B)
    plain, alice, bob = (block_hashes(toks, B, salt) for salt in (None, "alice", "bob"))
    assert set(plain).isdisjoint(alice) and set(alice).isdisjoint(bob) and set(plain).isdisjoint(bob)
    assert block_hashes(toks, B, "alice") == alice


def test_hashes_are_the_same_in_every_process():
    code = "from deepserve.core.kv import block_hashes; print(block_hashes(list(range(300)), 128, 's')[1].hex())"
    outs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip()
        for seed in ("1", "2")
    }
    assert outs == {block_hashes(list(range(300)), 128, "s")[1].hex()}


# ---------------------------------------------------------------- manager


def test_random_interleaved_requests_return_every_page():
    rng = random.Random(0)
    mgr = make_manager(num_blocks=48)
    shared = tokens(4 * B, seed=1)  # common system prompt, so hits and shared pages happen
    live: dict[str, list[int]] = {}
    for i in range(64):
        rid = f"r{i}"
        prompt = shared[: rng.choice([0, B, 2 * B, 4 * B])] + tokens(rng.randrange(1, 3 * B), seed=100 + i)
        mgr.get_computed_blocks(rid, prompt)
        if mgr.allocate_slots(rid, len(prompt)) is None:
            mgr.free(rid)  # stays waiting: give back its hit pages
        else:
            mgr.cache_full_blocks(rid, prompt, len(prompt))
            live[rid] = prompt
        for other in list(live):  # decode a few tokens, finish or abort some
            action = rng.random()
            if action < 0.5:
                live[other] += [rng.randrange(100) for _ in range(rng.randrange(1, 40))]
                if mgr.allocate_slots(other, len(live[other])) is None:
                    mgr.free(other)  # preempted
                    del live[other]
                else:
                    mgr.cache_full_blocks(other, live[other], len(live[other]))
            elif action < 0.7:
                mgr.free(other)
                del live[other]
        assert_consistent(mgr)
    assert mgr.num_prefix_hits > 0
    for rid in list(live):
        mgr.free(rid)
    mgr.free("never-seen")  # an abort may come for a request that holds nothing
    assert mgr.num_free_blocks == 48 and mgr.block_tables == {} and mgr.usage == 0.0


def test_shared_prefix_pages_are_reference_counted():
    mgr = make_manager()
    prompt = tokens(2 * B + 10)
    prefill(mgr, "a", prompt)
    assert prefill(mgr, "b", prompt) == 2 * B
    a, b = mgr.block_tables["a"], mgr.block_tables["b"]
    assert a[:2] == b[:2] and a[2] != b[2]
    assert [mgr.pool.ref_count(p) for p in b] == [2, 2, 1]
    mgr.free("a")
    assert [mgr.pool.ref_count(p) for p in b] == [1, 1, 1]
    assert mgr.num_free_blocks == 16 - 3  # a's own last page came back
    mgr.free("b")
    assert mgr.num_free_blocks == 16 and mgr.pool.num_cached_blocks == 2  # cached pages stay for revival


def test_freed_cached_pages_are_revived_by_a_later_hit():
    mgr = make_manager()
    prompt = tokens(3 * B + 1)
    prefill(mgr, "a", prompt)
    pages = list(mgr.block_tables["a"])
    mgr.free("a")
    hit, num_cached = mgr.get_computed_blocks("b", prompt)
    assert (hit, num_cached) == (pages[:3], 3 * B)
    assert all(mgr.pool.ref_count(p) == 1 for p in hit)
    new = mgr.allocate_slots("b", len(prompt))
    assert new is not None and len(new) == 1 and new[0] not in hit
    assert mgr.block_tables["b"] == hit + new


def test_evicted_page_gives_no_stale_hit():
    mgr = make_manager(num_blocks=4)
    first = tokens(2 * B + 1, seed=1)
    prefill(mgr, "a", first)
    mgr.free("a")
    # "b" needs all four pages: the cached ones are evicted and overwritten with b's tokens
    prefill(mgr, "b", tokens(4 * B, seed=2))
    mgr.free("b")
    assert mgr.get_computed_blocks("c", first) == ([], 0)
    assert mgr.pool.num_cached_blocks == 4  # b's blocks, none of a's


def test_tail_blocks_are_evicted_before_the_head():
    mgr = make_manager(num_blocks=4)
    prompt = tokens(3 * B + 1)
    prefill(mgr, "a", prompt)
    mgr.free("a")
    mgr.allocate_slots("x", 2 * B)  # takes the never-used page, then evicts a's last full block
    assert mgr.get_computed_blocks("b", prompt)[1] == 2 * B


def test_cache_salt_isolates_tenants():
    mgr = make_manager()
    prompt = tokens(2 * B + 1)
    prefill(mgr, "a", prompt, salt="alice")
    assert mgr.get_computed_blocks("b", prompt, "bob") == ([], 0)
    assert mgr.get_computed_blocks("c", prompt, None) == ([], 0)
    assert mgr.get_computed_blocks("d", prompt, "alice")[1] == 2 * B
    mgr.allocate_slots("d", len(prompt))
    with pytest.raises(ValueError, match="changed its cache_salt"):
        mgr.cache_full_blocks("d", prompt, len(prompt), "bob")


@pytest.mark.parametrize(
    "length, expected",
    [(1, 0), (127, 0), (128, 0), (129, B), (255, B), (256, B), (257, 2 * B), (300, 2 * B), (384, 2 * B),
     (385, 3 * B), (513, 4 * B), (600, 4 * B)],
)
def test_hit_at_block_boundaries_leaves_at_least_one_token_to_compute(length, expected):
    mgr = make_manager()
    cached = tokens(4 * B + 1)
    prefill(mgr, "a", cached)  # 4 full blocks cached
    prompt = (cached + tokens(200, seed=9))[:length]
    hit, num_cached = mgr.get_computed_blocks("b", prompt)
    assert num_cached == expected and len(hit) == expected // B
    assert num_cached < len(prompt)
    assert hit == mgr.block_tables["a"][: len(hit)]


def test_partial_last_block_is_never_cached():
    mgr = make_manager()
    prompt = tokens(B + 100)
    prefill(mgr, "a", prompt)
    assert mgr.pool.num_cached_blocks == 1
    longer = prompt + tokens(28, seed=5)  # decoding fills block 1: only now is it cached
    mgr.allocate_slots("a", len(longer))
    mgr.cache_full_blocks("a", longer, len(longer) - 1)
    assert mgr.pool.num_cached_blocks == 1  # one token of block 1 not computed yet
    mgr.cache_full_blocks("a", longer, len(longer))
    assert mgr.pool.num_cached_blocks == 2
    assert mgr.get_computed_blocks("b", longer + [7])[1] == 2 * B


def test_failed_allocation_returns_none_and_changes_nothing():
    mgr = make_manager(num_blocks=4)
    prefill(mgr, "a", tokens(2 * B + 1))
    hit_before = mgr.get_computed_blocks("b", tokens(2 * B + 1))
    tables = {k: list(v) for k, v in mgr.block_tables.items()}
    refs = [mgr.pool.ref_count(p) for p in range(4)]
    assert mgr.allocate_slots("b", 6 * B) is None
    assert mgr.allocate_slots("new", 5 * B) is None
    assert mgr.block_tables == tables and "new" not in mgr.block_tables
    assert [mgr.pool.ref_count(p) for p in range(4)] == refs and mgr.num_free_blocks == 1
    assert mgr.allocate_slots("b", 3 * B) == [3] and hit_before[1] == 2 * B


def test_prefix_caching_off_never_hits():
    mgr = make_manager(enable_prefix_caching=False)
    prompt = tokens(2 * B + 1)
    prefill(mgr, "a", prompt)
    assert prefill(mgr, "b", prompt) == 0
    assert mgr.pool.num_cached_blocks == 0 and mgr.num_prefix_queries == 0
    assert set(mgr.block_tables["a"]).isdisjoint(mgr.block_tables["b"])


def test_counters():
    mgr = make_manager()
    prompt = tokens(2 * B + 50)
    prefill(mgr, "a", prompt)
    prefill(mgr, "b", prompt[: B + 3])
    assert (mgr.num_prefix_queries, mgr.num_prefix_hits) == (len(prompt) + B + 3, B)
    assert mgr.num_free_blocks == 16 - 3 - 1 and mgr.usage == pytest.approx(4 / 16)
    with pytest.raises(ValueError, match="already holds KV pages"):
        mgr.get_computed_blocks("a", prompt)


def test_sizing_helpers():
    assert rows_per_page(256, 4) == 64 and rows_per_page(256, 128) == 2 and rows_per_page(128, 1) == 128
    with pytest.raises(ValueError, match="whole number of rows"):
        rows_per_page(128, 3)
    assert pages_for_budget(10 * 1024, 1000) == 10
    with pytest.raises(ValueError, match="holds no page"):
        pages_for_budget(999, 1000)


def test_kv_package_imports_no_torch():
    code = ("import sys, deepserve.core.kv; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'aiohttp')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
