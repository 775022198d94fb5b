"""The KV cache tiers below the GPU pages: a host-memory LRU of blocks, then the configured block store.

    GPU pages (`KVCacheManager`)  ->  host memory (`HostTier`, `host_cache_bytes`)  ->  store (`kv_store` URI)

A block here is one full page of one sequence prefix, as bytes per *pool* (each compressed stream of every layer:
CSA rows, indexer keys, HCA rows, the page-boundary snapshots; the model side names them and copies pages in and
out, `deepserve.model.kv_cache.read_pages` / `write_pages`). Blocks are keyed by the chained block hash the prefix
cache already uses, within a `StoreNamespace` (model, weights, layout, dtype, shard).

How the engine uses this (`EngineCore`):
- **Lookup, when a request arrives**: past the blocks the GPU already holds, `start_load` takes what the host
  tier has at once and asks the store (on the store thread, under the store's deadline) for the rest. The request
  waits in the scheduler (`Scheduler.add_request(loading_kv=True)`) until `poll` hands back its `Load`; then the
  engine puts the blocks into free pages (copied in on the runner's thread, before any step reads them) and the
  request is admitted with those pages as prefix hits. Blocks the store returned are promoted to the host tier.
- **Writes, after a step**: the blocks a step completed are copied out of their pages on the runner's thread and
  `offload` puts them into the host tier and (asynchronously, best effort, bounded in flight) into the store,
  under the retention class of the request that computed them (`SamplingParams.cache_ttl`, else `ttl_class`);
  a block that a request of a longer class hit is written to the store again under that class.
- A store error or timeout is a miss (`GuardedStore`); nothing here can fail a request.

Plain Python, no torch: the page copies are the caller's callables.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from deepserve.core.kv.prefix_hash import BlockHash
from deepserve.core.kv.store import BlockKey, GuardedStore

logger = logging.getLogger(__name__)

#: one block's bytes, by pool name
Block = Mapping[str, bytes]
#: store writes in flight past which new ones are dropped (writes are best effort; reads must not queue behind them)
MAX_WRITES_IN_FLIGHT = 64


def store_hash(block_hash: BlockHash) -> int:
    """The store key's integer form of a chained block hash (all 256 bits)."""
    return int.from_bytes(block_hash, "big")


@dataclass(slots=True)
class TierStats:
    """One tier's counters since start (what `/metrics` exports per tier)."""

    num_hit_blocks: int = 0
    num_hit_tokens: int = 0
    num_hit_bytes: int = 0
    num_stored_blocks: int = 0
    num_stored_bytes: int = 0
    num_evicted_blocks: int = 0
    num_errors: int = 0  # calls that failed or timed out (read as misses)
    num_dropped_writes: int = 0  # blocks not written because too many writes were in flight
    load_seconds: float = 0.0  # time requests waited for this tier's reads


class HostTier:
    """Blocks in this process's memory, least recently used evicted past `capacity_bytes`. Thread-safe: the
    engine's thread reads it, the runner's thread writes it."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"host_cache_bytes must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._blocks: OrderedDict[BlockHash, Block] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self.num_bytes = 0
        self.stats = TierStats()

    def __contains__(self, block_hash: BlockHash) -> bool:
        with self._lock:
            return block_hash in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def get_run(self, block_hashes: Sequence[BlockHash]) -> list[Block]:
        """The blocks of `block_hashes` it holds, from the first on, up to the first it lacks (each now the most
        recently used)."""
        out = []
        with self._lock:
            for block_hash in block_hashes:
                block = self._blocks.get(block_hash)
                if block is None:
                    break
                self._blocks.move_to_end(block_hash)
                out.append(block)
        return out

    def put(self, block_hash: BlockHash, block: Block) -> bool:
        size = sum(map(len, block.values()))
        if size > self.capacity_bytes:
            return False
        with self._lock:
            old = self._blocks.pop(block_hash, None)
            if old is not None:
                self.num_bytes -= sum(map(len, old.values()))
            self._blocks[block_hash] = block
            self.num_bytes += size
            self.stats.num_stored_blocks += 1
            self.stats.num_stored_bytes += size
            while self.num_bytes > self.capacity_bytes:
                _, evicted = self._blocks.popitem(last=False)
                self.num_bytes -= sum(map(len, evicted.values()))
                self.stats.num_evicted_blocks += 1
        return True

    def order(self) -> list[BlockHash]:
        """Held blocks, least recently used first (the order they would be evicted in)."""
        with self._lock:
            return list(self._blocks)


class StoreThread:
    """A daemon thread running one asyncio loop, where every call to the store runs (a store's client lives on
    one loop); `submit` hands it a coroutine from any thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="deepserve-kv-store", daemon=True)
        self._thread.start()

    def submit(self, coro) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self, timeout: float) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()


@dataclass(slots=True)
class Load:
    """A request's blocks past its GPU prefix, being fetched: `first` is the index (in the request's block chain)
    of the first one; `host` came from the host tier at once; `future` gives the store's blocks after those
    (already done when there is nothing to ask)."""

    request_id: str
    block_hashes: list[BlockHash]  # the request's whole chain, capped at the blocks a hit may use
    first: int
    host: list[Block]
    future: Future
    asked_store: bool = False
    began: float = field(default_factory=time.perf_counter)

    def blocks(self) -> list[Block]:
        """Every block found, in chain order from `first` on (call once `future` is done)."""
        try:
            stored = self.future.result(timeout=0)
        except Exception:  # noqa: BLE001 - cancelled, or the store thread failed: nothing beyond the host tier
            stored = []
        return self.host + stored


class KVTiers:
    """The host tier and the store behind the GPU pages, for one engine. `pool_bytes`: each pool's bytes per block
    (the page layout); `page_size`: tokens per block."""

    def __init__(self, namespace: str, pool_bytes: Mapping[str, int], page_size: int,
                 host: HostTier | None = None, store: GuardedStore | None = None, ttl_class: str | None = None,
                 store_pools: Sequence[str] | None = None) -> None:
        """`store_pools`: the pools the store keeps (default all; without the snapshot pools, blocks read from the
        store lack them and their pages need an SWA replay)."""
        if host is None and store is None:
            raise ValueError("KVTiers needs a host tier, a store, or both")
        if not pool_bytes:
            raise ValueError("a block needs at least one pool")
        self.namespace, self.pool_bytes, self.page_size = namespace, dict(pool_bytes), page_size
        self.store_pools = list(pool_bytes) if store_pools is None else list(store_pools)
        unknown = [p for p in self.store_pools if p not in self.pool_bytes]
        if unknown or not self.store_pools:
            raise ValueError(f"store_pools {self.store_pools} must be some of the pools {list(self.pool_bytes)}")
        self.host, self.store, self.ttl_class = host, store, ttl_class
        self.store_stats = TierStats()
        self._thread = StoreThread() if store is not None else None
        self._loads: dict[str, Load] = {}
        self._writes: set[Future] = set()
        self._writes_lock = threading.Lock()

    @property
    def block_bytes(self) -> int:
        return sum(self.pool_bytes.values())

    @property
    def num_loading(self) -> int:
        return len(self._loads)

    # -- reads ---------------------------------------------------------------------------------------------------
    def start_load(self, request_id: str, block_hashes: list[BlockHash], first: int) -> bool:
        """Look up the request's blocks from `first` on (the GPU holds those before it). Returns False when no
        tier can have any (nothing to wait for); else True, and `poll` returns the request's `Load` once done."""
        if request_id in self._loads:
            raise ValueError(f"request {request_id!r} is already loading KV blocks")
        wanted = block_hashes[first:]
        if not wanted:
            return False
        host = self.host.get_run(wanted) if self.host is not None else []
        rest = wanted[len(host):]
        if rest and self.store is not None:
            future = self._thread.submit(self._read_store(rest))
        elif host:
            future = Future()
            future.set_result([])
        else:
            return False
        self._loads[request_id] = Load(request_id, block_hashes, first, host, future,
                                       asked_store=bool(rest) and self.store is not None)
        return True

    async def _read_store(self, block_hashes: list[BlockHash]) -> list[Block]:
        pools = self.store_pools
        keys = [store_hash(h) for h in block_hashes]
        errors = self.store.num_errors
        n = await self.store.longest_prefix(self.namespace, keys, pools)
        if not n:
            self.store_stats.num_errors += self.store.num_errors - errors
            return []
        block_keys = [BlockKey(self.namespace, key, pool) for key in keys[:n] for pool in pools]
        buffers = [bytearray(self.pool_bytes[pool]) for _ in range(n) for pool in pools]
        found = await self.store.get_many(block_keys, buffers)
        self.store_stats.num_errors += self.store.num_errors - errors
        blocks = []
        for i in range(n):
            row = slice(i * len(pools), (i + 1) * len(pools))
            if not all(found[row]):
                break  # a missing or corrupt pool ends the prefix there
            blocks.append({pool: bytes(buf) for pool, buf in zip(pools, buffers[row])})
        return blocks

    def poll(self) -> list[Load]:
        """Loads whose lookups have finished, removed from the pending ones; blocks the store supplied are
        promoted to the host tier."""
        done = [load for load in self._loads.values() if load.future.done()]
        for load in done:
            del self._loads[load.request_id]
            blocks = load.blocks()
            if self.host is not None:
                start = load.first + len(load.host)
                for block_hash, block in zip(load.block_hashes[start:], blocks[len(load.host):]):
                    self.host.put(block_hash, block)  # the next hit on it is a host hit
        return done

    def record(self, load: Load, num_used: int) -> None:
        """Count the first `num_used` blocks of a finished load as hits of the tiers that supplied them (the
        engine may use fewer than were found: pages ran short, or an earlier GPU page went meanwhile)."""
        from_host = min(num_used, len(load.host))
        if self.host is not None:
            self._count(self.host.stats, from_host, 0.0)
        if load.asked_store:
            self._count(self.store_stats, num_used - from_host, time.perf_counter() - load.began)

    def _count(self, stats: TierStats, num_blocks: int, seconds: float) -> None:
        stats.num_hit_blocks += num_blocks
        stats.num_hit_tokens += num_blocks * self.page_size
        stats.num_hit_bytes += num_blocks * self.block_bytes
        stats.load_seconds += seconds

    def wait(self, timeout: float) -> None:
        """Block until some pending load finishes, or `timeout` seconds (an engine with nothing else to run)."""
        from concurrent.futures import FIRST_COMPLETED, wait

        pending = [load.future for load in self._loads.values()]
        if pending:
            wait(pending, timeout, FIRST_COMPLETED)

    def cancel(self, request_id: str) -> None:
        """Forget a request's load (it was aborted while waiting)."""
        load = self._loads.pop(request_id, None)
        if load is not None:
            load.future.cancel()

    # -- writes --------------------------------------------------------------------------------------------------
    def offload(self, block_hashes: Sequence[BlockHash], blocks: Sequence[Block],
                ttl_classes: Sequence[str | None] | None = None, reputs: Sequence[bool] | None = None) -> None:
        """Blocks a step completed (copied out of their pages): into the host tier, and to the store without
        waiting, each under its retention class (`ttl_classes[i]`; None: this engine's `ttl_class`). A block
        marked in `reputs` is one the tiers hold already, hit by a request of a longer class: it goes to the
        store again under that class (one write per class), and not to the host tier. Safe to call from any
        thread."""
        ttl_classes = ttl_classes or [None] * len(block_hashes)
        reputs = reputs or [False] * len(block_hashes)
        fresh: dict[str | None, list[tuple[BlockHash, Block]]] = {}  # by class: one batch each
        for block_hash, block, ttl_class, reput in zip(block_hashes, blocks, ttl_classes, reputs):
            if self.host is not None and not reput:
                if block_hash in self.host:
                    continue  # computed again after its GPU page went: the tiers below hold it already
                self.host.put(block_hash, block)
            fresh.setdefault(ttl_class or self.ttl_class, []).append((block_hash, block))
        if self.store is None:
            return
        for ttl_class, batch in fresh.items():
            with self._writes_lock:
                if len(self._writes) >= MAX_WRITES_IN_FLIGHT:
                    self.store_stats.num_dropped_writes += len(batch)
                    continue
                future = self._thread.submit(self._write_store(batch, ttl_class))
                self._writes.add(future)
            future.add_done_callback(self._write_done)

    def _write_done(self, future: Future) -> None:
        with self._writes_lock:
            self._writes.discard(future)

    async def _write_store(self, blocks: list[tuple[BlockHash, Block]], ttl_class: str | None) -> None:
        items = [(BlockKey(self.namespace, store_hash(h), pool), block[pool]) for h, block in blocks
                 for pool in self.store_pools]
        errors = self.store.num_errors
        stored = await self.store.put_many(items, ttl_class)
        self.store_stats.num_errors += self.store.num_errors - errors
        whole = stored // len(self.store_pools) if stored == len(items) else 0
        self.store_stats.num_stored_blocks += whole
        self.store_stats.num_stored_bytes += whole * sum(self.pool_bytes[p] for p in self.store_pools)

    def flush(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the store writes in flight; True when none is left."""
        from concurrent.futures import wait

        with self._writes_lock:
            pending = list(self._writes)
        _, not_done = wait(pending, timeout) if pending else ((), ())
        return not not_done

    def close(self) -> None:
        """Finish the writes in flight (each within the store's deadline), then close the store."""
        if self._thread is None:
            return
        self.flush(self.store.deadline * 2)
        try:
            self._thread.submit(self.store.close()).result(self.store.deadline * 2)
        except Exception as exc:  # noqa: BLE001 - closing is best effort too
            logger.warning("closing the KV block store failed: %s", exc)
        self._thread.stop(timeout=5.0)
        self._thread = None

    def snapshot(self) -> dict[str, TierStats]:
        """Copies of each tier's counters, by tier name (`host`, `store`)."""
        out = {}
        if self.host is not None:
            out["host"] = _copy(self.host.stats)
        if self.store is not None:
            out["store"] = _copy(self.store_stats)
        return out


def _copy(stats: TierStats) -> TierStats:
    return TierStats(*(getattr(stats, name) for name in TierStats.__slots__))
