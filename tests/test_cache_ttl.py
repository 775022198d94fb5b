"""Per-request retention classes (issue 21): a request's `cache_ttl` (`SamplingParams.cache_ttl`, the `cache_ttl`
request field, top-level or in `extra_body`; default `--kv-store-ttl-class`) is the class its KV blocks go to the
block store under: the dir store's day buckets of that class, Redis's native TTL of that class. A block hit by a
later request of a longer class is written again under the longer one; a hit never shortens a class."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import pytest

from deepserve import LLM, SamplingParams
from deepserve.core.kv.manager import KVCacheManager, NewBlock
from deepserve.core.kv.store import BlockKey
from deepserve.plugins.cache.dir_store import DAY, DirStore
from deepserve.server.state import ENGINE
from test_cache_redis import REDIS, redis_server  # noqa: F401 - fixture
from test_server import MODEL, USER, chat_dir, make_app  # noqa: F401 - fixtures

P = 128


def test_a_blocks_class_is_its_writers_and_a_longer_hit_puts_it_again():
    kv = KVCacheManager(8, P)
    kv.record_new_blocks = True
    kv.default_ttl_class = "chat"
    tokens = list(range(2 * P + 1))
    kv.get_computed_blocks("a", tokens, ttl_class="agent")
    kv.allocate_slots("a", len(tokens))
    kv.cache_full_blocks("a", tokens, len(tokens))  # the class given at admission
    written = kv.take_new_blocks()
    assert [(b.ttl_class, b.reput) for b in written] == [("agent", False)] * 2
    kv.free("a")
    kv.get_computed_blocks("b", tokens, ttl_class="agent")  # the same class: nothing to write again
    assert kv.take_new_blocks() == []
    kv.free("b")
    kv.get_computed_blocks("c", tokens)  # no class of its own: the default, chat, which keeps blocks longer
    again = kv.take_new_blocks()
    assert again == [NewBlock(b.block_hash, b.page, "chat", True) for b in written]
    kv.free("c")
    kv.get_computed_blocks("d", tokens, ttl_class="agent")  # a hit never shortens a class
    assert kv.take_new_blocks() == [] and [kv.ttl_class_of(b.page) for b in written] == ["chat", "chat"]
    kv.free("d")
    with pytest.raises(ValueError, match="ttl_class must be one of"):
        kv.get_computed_blocks("e", tokens, ttl_class="week")


def test_cache_ttl_is_validated_by_sampling_params():
    assert SamplingParams(cache_ttl="agent").cache_ttl == "agent" and SamplingParams().cache_ttl is None
    with pytest.raises(ValueError, match=r"cache_ttl must be one of \['agent', 'chat'\], got 'forever'"):
        SamplingParams(cache_ttl="forever")


def test_a_block_put_again_under_chat_outlives_its_agent_copy(tmp_path):
    now = [10 * DAY]
    store = DirStore(tmp_path, clock=lambda: now[0])
    key = BlockKey("ns", 7, "csa")

    async def scenario():
        await store.put_many([(key, b"kv")], ttl_class="agent")
        await store.put_many([(key, b"kv")], ttl_class="chat")
        now[0] += 4 * DAY  # past the agent class's 3 days, within chat's 7
        store.gc()
        return await store.get_many([key], [bytearray(2)])

    assert asyncio.run(scenario()) == [True]
    assert not list((tmp_path / "agent").rglob("*.blk")) and len(list((tmp_path / "chat").rglob("*.blk"))) == 1


def classes_on_disk(root: Path) -> dict[str, int]:
    """Block files per retention class directory of a dir store."""
    return {d.name: len(list(d.rglob("*.blk"))) for d in sorted(root.iterdir()) if d.is_dir()}


def test_an_engines_requests_write_their_own_classes_to_a_dir_store(tiny_dir, tmp_path):
    rng = random.Random(1)
    first, second = ([rng.randrange(2, 512) for _ in range(2 * P + 20)] for _ in range(2))
    llm = LLM(tiny_dir, dtype="float32", accelerator="cpu", block_size=P, kv_store=f"dir://{tmp_path}",
              kv_store_ttl_class="agent")
    pools = len(llm.engine.kv_tiers.store_pools)

    def run(prompt, cache_ttl=None):
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, cache_ttl=cache_ttl)
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        assert llm.engine.kv_tiers.flush(10)
        return out

    run(first)  # the engine's default class: agent
    assert classes_on_disk(tmp_path) == {"agent": 2 * pools}
    hit = run(first, "chat")  # hits both blocks on the GPU, and writes them again under chat
    assert hit.num_cached_tokens == 2 * P and classes_on_disk(tmp_path) == {"agent": 2 * pools, "chat": 2 * pools}
    run(second, "chat")
    assert classes_on_disk(tmp_path) == {"agent": 2 * pools, "chat": 4 * pools}
    run(second, "agent")  # a hit of a shorter class writes nothing
    assert classes_on_disk(tmp_path) == {"agent": 2 * pools, "chat": 4 * pools}
    assert llm.engine.kv_tiers.store_stats.num_stored_blocks == 6
    llm.engine.shutdown()


@pytest.mark.skipif(REDIS is None, reason="no redis-server on PATH (scripts/bootstrap.sh installs one)")
def test_redis_keeps_each_requests_blocks_for_its_class(redis_server, tiny_dir):  # noqa: F811 - the fixture
    import redis

    rng = random.Random(2)
    prompt = [rng.randrange(2, 512) for _ in range(P + 20)]
    llm = LLM(tiny_dir, dtype="float32", accelerator="cpu", block_size=P,
              kv_store=f"redis://127.0.0.1:{redis_server}/5?key_prefix=ttl")
    raw = redis.Redis(port=redis_server, db=5)

    def ttls(cache_ttl):
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, cache_ttl=cache_ttl)
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        assert llm.engine.kv_tiers.flush(10)
        names = list(raw.scan_iter(match="ttl:*"))
        assert len(names) == len(llm.engine.kv_tiers.store_pools)  # one block, one key per pool
        return [raw.ttl(name) for name in names]

    assert all(3 * DAY - 60 < t <= 3 * DAY for t in ttls("agent"))
    assert all(7 * DAY - 60 < t <= 7 * DAY for t in ttls(None))  # the default (chat): put again for 7 days
    raw.close()
    llm.engine.shutdown()


# -- over HTTP -------------------------------------------------------------------------------------------------------
ROUTES = [("/v1/chat/completions", {"messages": USER, "max_tokens": 1}),
          ("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 1}),
          ("/v1/responses", {"input": "hi", "max_output_tokens": 1}),
          ("/v1/messages", {"messages": USER, "max_tokens": 1})]


async def test_every_route_hands_its_cache_ttl_to_the_engine(aiohttp_client, chat_dir):
    client = await aiohttp_client(make_app(chat_dir))
    core = client.app[ENGINE].engine
    seen, add = [], core.add_request

    def spy(request_id, ids, params, *args, **kwargs):
        seen.append(params.cache_ttl)
        return add(request_id, ids, params, *args, **kwargs)

    core.add_request = spy
    for path, body in ROUTES:
        for extra in ({"cache_ttl": "agent"}, {"extra_body": {"cache_ttl": "agent"}}, {}):
            r = await client.post(path, json={"model": MODEL, **body, **extra})
            assert r.status == 200, (path, extra, await r.text())
    assert seen == ["agent", "agent", None] * len(ROUTES)


@pytest.mark.parametrize("extra, param, message", [
    ({"cache_ttl": "forever"}, "cache_ttl", "cache_ttl must be one of ['agent', 'chat'], got 'forever'"),
    ({"cache_ttl": 3}, "cache_ttl", "cache_ttl must be one of"),
    ({"extra_body": {"cache_ttl": "week"}}, "cache_ttl", "got 'week'"),
    ({"extra_body": "agent"}, "extra_body", "'extra_body' must be an object"),
    ({"extra_body": {"top_k": 5}}, "extra_body.top_k", "only cache_ttl may be sent in 'extra_body'"),
    ({"cache_ttl": "chat", "extra_body": {"cache_ttl": "agent"}}, "cache_ttl", "differ"),
])
@pytest.mark.parametrize("path, body", ROUTES, ids=[p for p, _ in ROUTES])
async def test_a_bad_cache_ttl_is_a_400_naming_its_field(aiohttp_client, chat_dir, path, body, extra, param,
                                                         message):
    client = await aiohttp_client(make_app(chat_dir))
    r = await client.post(path, json={"model": MODEL, **body, **extra})
    assert r.status == 400, await r.text()
    error = (await r.json())["error"]
    assert message in error["message"] and error.get("param", param) == param, error  # Anthropic's errors name none


async def test_the_servers_default_class_is_kv_store_ttl_class(aiohttp_client, chat_dir, tmp_path):
    client = await aiohttp_client(make_app(chat_dir, engine={"kv_store": f"dir://{tmp_path}",
                                                             "kv_store_ttl_class": "agent"}))
    prompt = list(range(3, 3 + P + 5))
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
    assert r.status == 200, await r.text()
    tiers = client.app[ENGINE].engine.kv_tiers
    deadline = time.monotonic() + 10  # the block is copied out after the step, then written off the step loop
    while not list(tmp_path.rglob("*.blk")) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert tiers.flush(10)
    assert classes_on_disk(tmp_path) == {"agent": len(tiers.store_pools)}
