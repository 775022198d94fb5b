"""`redis://host:port/db`: blocks as Redis strings, through redis-py's asyncio client, every batch in one pipeline.

    key: <key_prefix>:<namespace>:<pool>:<block hash, hex>     value: the block's bytes

- **Batches are one round trip**: `longest_prefix` pipelines an EXISTS per (block, pool), `get_many` a GET per
  block, `put_many` a SET per block, `evict` one DEL.
- **TTL per class**: a block is written with `SET ... EX` of its retention class (`agent`: 3 days, `chat`: 7 days,
  the dir store's classes; `?ttl_class=` picks the default, `put_many(ttl_class=)` per call). Redis expires it.
- **Capacity is the server's**: run the server with `maxmemory` and `maxmemory-policy allkeys-lru` and Redis
  evicts the least recently used blocks itself (a GET counts as a use); docs/cache.md shows the settings.

URI: `redis://[user:password@]host:port/db` with options `ttl_class` (chat) and `key_prefix` (deepserve); the
client's own URL options (`socket_timeout`, ...) pass through to redis-py. The client opens its connections on the
event loop that first uses it: use a store from one loop (the engine's store thread does).
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from deepserve.core.kv.store import BlockKey, BlockStore, StoreStats
from deepserve.plugins.cache.dir_store import DAY, TTL_DAYS, check_ttl_class

_OWN_OPTIONS = ("ttl_class", "key_prefix")


def parse_uri(uri: str) -> tuple[str, dict]:
    """(the URL redis-py connects to, this store's own options) from a `redis://` or `rediss://` URI."""
    parts = urlsplit(uri)
    if parts.scheme not in ("redis", "rediss") or not parts.hostname:
        raise ValueError(f"a Redis store URI is 'redis://host:port/db[?ttl_class=chat&key_prefix=deepserve]', "
                         f"got {uri!r}")
    db = parts.path.strip("/")
    if db and not db.isdigit():
        raise ValueError(f"the Redis database in {uri!r} must be a number, got {db!r}")
    try:
        parts.port  # noqa: B018 - raises ValueError on a port that is not a number
    except ValueError:
        raise ValueError(f"the Redis port in {uri!r} must be a number") from None
    query = parse_qsl(parts.query, keep_blank_values=True)
    own = {k: v for k, v in query if k in _OWN_OPTIONS}
    options = {"ttl_class": own.get("ttl_class", "chat"), "key_prefix": own.get("key_prefix", "deepserve")}
    if options["ttl_class"] not in TTL_DAYS:
        raise ValueError(f"ttl_class must be one of {sorted(TTL_DAYS)}, got {options['ttl_class']!r} in {uri!r}")
    if not options["key_prefix"] or ":" in options["key_prefix"]:
        raise ValueError(f"key_prefix must be a non-empty string without ':', got {options['key_prefix']!r}")
    client_url = urlunsplit(parts._replace(query=urlencode([(k, v) for k, v in query if k not in _OWN_OPTIONS])))
    return client_url, options


class RedisStore(BlockStore):
    def __init__(self, url: str, ttl_class: str = "chat", key_prefix: str = "deepserve") -> None:
        import redis.asyncio  # the client loads only when a Redis store is chosen

        self.client = redis.asyncio.Redis.from_url(url)
        self.ttl_class, self.key_prefix = ttl_class, key_prefix
        self._counts = dict(num_hits=0, num_misses=0, num_puts=0, num_evictions=0)

    @classmethod
    def from_uri(cls, uri: str) -> RedisStore:
        url, options = parse_uri(uri)
        return cls(url, **options)

    def _key(self, key: BlockKey) -> str:
        return f"{self.key_prefix}:{key.namespace}:{key.pool}:{key.block_hash & (2**256 - 1):x}"

    async def longest_prefix(self, namespace: str, block_hashes: Sequence[int], pools: Sequence[str]) -> int:
        if not block_hashes or not pools:
            return len(block_hashes) if not pools else 0
        pipe = self.client.pipeline(transaction=False)
        for block_hash in block_hashes:
            for pool in pools:
                pipe.exists(self._key(BlockKey(namespace, block_hash, pool)))
        present = await pipe.execute()
        for n in range(len(block_hashes)):
            if not all(present[n * len(pools):(n + 1) * len(pools)]):
                return n
        return len(block_hashes)

    async def get_many(self, keys: Sequence[BlockKey], buffers) -> list[bool]:
        if not keys:
            return []
        values = await self.client.mget([self._key(k) for k in keys])
        found = []
        for value, buffer in zip(values, buffers):
            view = memoryview(buffer).cast("B")
            ok = value is not None and len(value) == view.nbytes
            if ok:
                view[:] = value
            found.append(ok)
        self._counts["num_hits"] += sum(found)
        self._counts["num_misses"] += len(found) - sum(found)
        return found

    async def put_many(self, items, ttl_class: str | None = None) -> int:
        ttl_class = ttl_class or self.ttl_class
        check_ttl_class(ttl_class)
        if not items:
            return 0
        pipe = self.client.pipeline(transaction=False)
        for key, data in items:
            pipe.set(self._key(key), bytes(data), ex=TTL_DAYS[ttl_class] * DAY)
        stored = sum(bool(ok) for ok in await pipe.execute(raise_on_error=False) if not isinstance(ok, Exception))
        self._counts["num_puts"] += stored
        return stored

    async def evict(self, keys: Sequence[BlockKey]) -> int:
        if not keys:
            return 0
        removed = int(await self.client.delete(*{self._key(k) for k in keys}))
        self._counts["num_evictions"] += removed
        return removed

    async def stats(self) -> StoreStats:
        """Walks this prefix's keys (SCAN, then STRLEN pipelined): for `/metrics` scrapes and tests, not per step."""
        names = [name async for name in self.client.scan_iter(match=f"{self.key_prefix}:*", count=1000)]
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            pipe.strlen(name)
        sizes = await pipe.execute() if names else []
        return StoreStats(len(names), int(sum(sizes)), **self._counts)

    async def close(self) -> None:
        await self.client.aclose()
