"""The block-store seam: where KV blocks live beyond the GPU's pages (host memory, a 3FS directory, Redis, an
erasure-coded set of those), behind one async, batch-first interface that store plugins implement.

A block is addressed by `BlockKey(namespace, block_hash, pool)`:
- `namespace` (`StoreNamespace.key`): model, weights revision, KV layout version, KV dtype and the shard that
  owns the bytes, so that blocks of another model, layout or shard are never read as these;
- `block_hash`: the chained hash of the block's tokens that the prefix cache already uses (it carries the
  request's `cache_salt`, so tenants share blocks only when they share a salt);
- `pool`: which compressed stream the bytes are (CSA rows, indexer keys, HCA rows, window snapshots).

A store plugin implements `BlockStore` and registers the URI scheme it serves through
`deepserve_register_cache_backends` (`register("dir", factory)`, `factory(uri) -> BlockStore`); `StoreRegistry`
holds those factories from start-up on and opens a store by URI. The engine talks to a store only through
`GuardedStore`, which gives every call a deadline and turns an error or a timeout into a miss: a store can make a
request slower by at most its deadline, never fail it.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)

#: the retention classes of stored blocks, in days: DeepSeek's 3 days for agent traffic and 7 for chat. A request
#: picks one (`SamplingParams.cache_ttl`, the `cache_ttl` request field); the server's default is
#: `--kv-store-ttl-class`. Stores that keep retention (dir, Redis) keep each block for its class's days.
TTL_DAYS = {"agent": 3, "chat": 7}


def check_ttl_class(ttl_class: str, name: str = "ttl_class") -> str:
    """`ttl_class` if it is one of `TTL_DAYS`'s classes; else a ValueError that starts with `name`."""
    if not isinstance(ttl_class, str) or ttl_class not in TTL_DAYS:
        raise ValueError(f"{name} must be one of {sorted(TTL_DAYS)}, got {ttl_class!r}")
    return ttl_class


def longer_ttl(a: str, b: str) -> str:
    """The class of the two that keeps a block longer."""
    return a if TTL_DAYS[a] >= TTL_DAYS[b] else b


@dataclass(frozen=True, slots=True)
class StoreNamespace:
    """What a block's bytes mean; blocks are shared only within one namespace."""

    model: str
    weights_revision: str
    kv_layout: str
    kv_dtype: str
    shard: str = "0"

    def __post_init__(self) -> None:
        for name in ("model", "weights_revision", "kv_layout", "kv_dtype", "shard"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value or "/" in value:
                raise ValueError(f"StoreNamespace.{name} must be a non-empty string without '/', got {value!r}")

    @property
    def key(self) -> str:
        return "/".join((self.model, self.weights_revision, self.kv_layout, self.kv_dtype, self.shard))


@dataclass(frozen=True, slots=True)
class BlockKey:
    namespace: str
    block_hash: int
    pool: str


@dataclass(frozen=True, slots=True)
class StoreStats:
    """A store's counters since it opened (what `/metrics` shows per tier)."""

    num_blocks: int
    num_bytes: int
    num_hits: int = 0
    num_misses: int = 0
    num_puts: int = 0
    num_evictions: int = 0
    num_errors: int = 0  # calls that failed or ran past their deadline (counted by `GuardedStore`)


class BlockStore(ABC):
    """A store of KV blocks. Every method is a coroutine, takes many blocks at once, and may be slow or fail: the
    caller (`GuardedStore`) bounds it with a deadline. Implementations must be safe to call concurrently from one
    event loop; a block a `get_many` is reading is not evicted under it."""

    @abstractmethod
    async def longest_prefix(self, namespace: str, block_hashes: Sequence[int], pools: Sequence[str]) -> int:
        """How many of `block_hashes`, from the first on, the store holds in every one of `pools`."""

    @abstractmethod
    async def get_many(self, keys: Sequence[BlockKey], buffers: Sequence[bytearray | memoryview]) -> list[bool]:
        """Copy block `keys[i]` into `buffers[i]` (the caller's memory, sized for the block); True where it did.
        A block that is missing, of another size or corrupt is False (and the store may drop it)."""

    @abstractmethod
    async def put_many(self, items: Sequence[tuple[BlockKey, bytes | bytearray | memoryview]],
                       ttl_class: str | None = None) -> int:
        """Store the blocks (best effort: a full store may drop some); returns how many it stored. `ttl_class`
        names the retention class (`agent`, `chat`) for stores that keep one."""

    @abstractmethod
    async def evict(self, keys: Sequence[BlockKey]) -> int:
        """Remove the blocks; returns how many were there."""

    @abstractmethod
    async def stats(self) -> StoreStats:
        """The store's counters."""

    async def close(self) -> None:
        """Release connections and files. The default has nothing to release."""


class GuardedStore:
    """A `BlockStore` as the engine uses it: each call finishes within `deadline` seconds, and an error or a
    timeout reads as a miss (nothing found, nothing stored) and is counted, never raised."""

    def __init__(self, store: BlockStore, deadline: float = 1.0) -> None:
        if not deadline > 0:
            raise ValueError(f"a store deadline must be a positive number of seconds, got {deadline!r}")
        self.store, self.deadline, self.num_errors = store, deadline, 0

    async def _bounded(self, what: str, call, miss):
        try:
            return await asyncio.wait_for(call, self.deadline)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a store's failure is a miss by contract
            self.num_errors += 1
            reason = "timed out" if isinstance(exc, TimeoutError) else f"failed ({type(exc).__name__}: {exc})"
            logger.warning("block store %s %s %s: treated as a miss", type(self.store).__name__, what, reason)
            return miss

    async def longest_prefix(self, namespace: str, block_hashes: Sequence[int], pools: Sequence[str]) -> int:
        found = await self._bounded("longest_prefix", self.store.longest_prefix(namespace, block_hashes, pools), 0)
        return max(0, min(int(found), len(block_hashes)))

    async def get_many(self, keys: Sequence[BlockKey], buffers: Sequence[bytearray | memoryview]) -> list[bool]:
        if len(keys) != len(buffers):
            raise ValueError(f"get_many got {len(keys)} keys but {len(buffers)} buffers")
        got = await self._bounded("get_many", self.store.get_many(keys, buffers), [False] * len(keys))
        return list(got) if len(got) == len(keys) else [False] * len(keys)

    async def put_many(self, items, ttl_class: str | None = None) -> int:
        return await self._bounded("put_many", self.store.put_many(items, ttl_class), 0)

    async def evict(self, keys: Sequence[BlockKey]) -> int:
        return await self._bounded("evict", self.store.evict(keys), 0)

    async def stats(self) -> StoreStats:
        stats = await self._bounded("stats", self.store.stats(), StoreStats(0, 0))
        return StoreStats(stats.num_blocks, stats.num_bytes, stats.num_hits, stats.num_misses, stats.num_puts,
                          stats.num_evictions, stats.num_errors + self.num_errors)

    async def close(self) -> None:
        await self._bounded("close", self.store.close(), None)


class StoreRegistry:
    """The block stores the plugins offer, by URI scheme: resolved from `deepserve_register_cache_backends` once at
    start-up, then `open(uri)` builds the store a URI names (`dir:///mnt/3fs/kv`, `redis://host:6379/0`)."""

    def __init__(self, factories: Mapping[str, Callable[[str], BlockStore]]) -> None:
        self.factories = dict(factories)

    @property
    def schemes(self) -> list[str]:
        return sorted(self.factories)

    def open(self, uri: str) -> BlockStore:
        """The store `uri` names. A factory that takes a `registry` keyword gets this registry, to open the child
        stores its URI names (the `ec:` wrapper over `dir://` or `redis://` children)."""
        scheme, sep, _ = uri.partition(":")
        if not sep or not scheme:
            raise ValueError(f"a block store is named by a URI such as 'memory://', got {uri!r}")
        if scheme not in self.factories:
            raise ValueError(f"no block store serves the scheme {scheme!r} (of {uri!r}); installed: {self.schemes}")
        factory = self.factories[scheme]
        try:
            composite = "registry" in inspect.signature(factory).parameters
        except (TypeError, ValueError):  # a builtin or C callable: an ordinary factory
            composite = False
        store = factory(uri, registry=self) if composite else factory(uri)
        if not isinstance(store, BlockStore):
            raise TypeError(f"the {scheme!r} store factory returned {type(store).__name__}, not a BlockStore")
        return store
