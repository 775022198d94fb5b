"""`redis://` block store against a real redis-server (started here on a free loopback port; scripts/bootstrap.sh
installs one). Skipped, saying so, only where no redis-server binary exists."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest

from deepserve.core.kv.store import BlockKey, GuardedStore, StoreNamespace, StoreRegistry
from deepserve.core.plugins import collect_registrations, make_plugin_manager

NS = StoreNamespace("deepserve-tiny-v4", "rev0", "v4-paged-1", "float32").key
REDIS = shutil.which("redis-server")
pytestmark = pytest.mark.skipif(REDIS is None, reason="no redis-server on PATH (scripts/bootstrap.sh installs "
                                                      "Debian's redis-server where apt-get works)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    """A redis-server of our own: no persistence, 8 MiB maxmemory with allkeys-lru, on a free port."""
    port = free_port()
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen([REDIS, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--maxmemory", "8mb", "--maxmemory-policy", "allkeys-lru", "--dir", str(workdir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 20
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"redis-server did not start on port {port} (exit {proc.poll()})")
        time.sleep(0.05)
    yield port
    proc.terminate()
    proc.wait(timeout=10)


def registry() -> StoreRegistry:
    return StoreRegistry(collect_registrations(make_plugin_manager(load_entrypoints=False),
                                               "deepserve_register_cache_backends"))


def keys(hashes, pool="csa"):
    return [BlockKey(NS, h, pool) for h in hashes]


async def test_redis_store_round_trips_blocks_in_batches(redis_server):
    store = GuardedStore(registry().open(f"redis://127.0.0.1:{redis_server}/1?key_prefix=t1"))
    big = 2**255 + 12345  # a whole sha256-wide block hash
    assert await store.put_many([(k, bytes([i]) * 100) for i, k in enumerate(keys([big, 2, 3]))]) == 3
    assert await store.put_many([(k, b"h" * 100) for k in keys([big, 2], pool="hca")]) == 2
    assert await store.longest_prefix(NS, [big, 2, 3, 4], ["csa"]) == 3
    assert await store.longest_prefix(NS, [big, 2, 3], ["csa", "hca"]) == 2
    assert await store.longest_prefix("other/rev0/v4-paged-1/float32/0", [big], ["csa"]) == 0
    buffers = [bytearray(100), bytearray(100), bytearray(7)]
    assert await store.get_many(keys([2, 99, 3]), buffers) == [True, False, False]  # missing; wrong size
    assert bytes(buffers[0]) == bytes([1]) * 100
    assert await store.evict(keys([2, 2, 50])) == 1
    stats = await store.stats()
    assert (stats.num_blocks, stats.num_bytes, stats.num_hits, stats.num_misses) == (4, 400, 1, 2)
    await store.close()


async def test_redis_store_sets_the_ttl_of_each_class(redis_server):
    import redis.asyncio

    uri = f"redis://127.0.0.1:{redis_server}/2?ttl_class=agent&key_prefix=t2"
    store = registry().open(uri)
    await store.put_many([(keys([1])[0], b"a")])  # the URI's default class: agent
    await store.put_many([(keys([2])[0], b"c")], ttl_class="chat")
    raw = redis.asyncio.Redis(port=redis_server, db=2)
    ttl_agent = await raw.ttl(f"t2:{NS}:csa:1")
    ttl_chat = await raw.ttl(f"t2:{NS}:csa:2")
    assert 3 * 86400 - 60 < ttl_agent <= 3 * 86400 and 7 * 86400 - 60 < ttl_chat <= 7 * 86400
    await raw.delete(f"t2:{NS}:csa:2")  # expired (or evicted) by the server: a miss
    assert await store.get_many(keys([1, 2]), [bytearray(1), bytearray(1)]) == [True, False]
    with pytest.raises(ValueError, match="ttl_class"):
        await store.put_many([(keys([3])[0], b"x")], ttl_class="forever")
    await raw.aclose()
    await store.close()


async def test_the_servers_lru_bounds_what_the_store_holds(redis_server):
    store = registry().open(f"redis://127.0.0.1:{redis_server}/3?key_prefix=t3")
    block = b"z" * 65536
    for start in range(0, 400, 50):  # 400 blocks of 64 KiB = 25 MiB into an 8 MiB server
        assert await store.put_many([(k, block) for k in keys(range(start, start + 50))]) == 50
    assert await store.get_many(keys([399]), [bytearray(65536)]) == [True]  # the newest survived
    stats = await store.stats()
    assert 0 < stats.num_bytes <= 8 * 2**20 and stats.num_blocks < 400
    await store.close()


async def test_a_server_that_is_down_is_a_miss():
    store = GuardedStore(registry().open(f"redis://127.0.0.1:{free_port()}/0?socket_connect_timeout=0.2"),
                         deadline=2.0)
    assert await store.longest_prefix(NS, [1, 2], ["csa"]) == 0
    assert await store.get_many(keys([1]), [bytearray(4)]) == [False]
    assert await store.put_many([(keys([1])[0], b"abcd")]) == 0
    assert store.num_errors == 3


@pytest.mark.parametrize("uri, message", [
    ("redis://", "Redis store URI"),
    ("redis://host:6379/zero", "database"),
    ("redis://host:port/0", "port"),
    ("redis://host:6379/0?ttl_class=week", "ttl_class"),
    ("redis://host:6379/0?key_prefix=a:b", "key_prefix"),
])
def test_a_malformed_redis_uri_names_the_problem(uri, message):
    with pytest.raises(ValueError, match=message):
        registry().open(uri)


def test_a_restarted_engine_hits_redis_with_identical_outputs(redis_server, tiny_dir):
    import random

    from deepserve import LLM, SamplingParams

    rng = random.Random(3)
    prompt = [rng.randrange(2, 512) for _ in range(300)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    uri = f"redis://127.0.0.1:{redis_server}/4?key_prefix=engine"

    def run():
        llm = LLM(tiny_dir, dtype="float32", accelerator="cpu", block_size=128, kv_store=uri)
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        llm.engine.shutdown()  # its writes finish
        return out, llm.engine.snapshot().kv_tiers["store"]

    cold, written = run()
    warm, read = run()
    assert cold.num_cached_tokens == 0 and written.num_stored_blocks == 2 and written.num_errors == 0
    assert warm.num_cached_tokens == 256 and read.num_hit_tokens == 256
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
