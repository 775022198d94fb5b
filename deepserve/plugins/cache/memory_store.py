"""`memory://`: blocks in this process's memory, least recently used evicted past a capacity in bytes.

The simplest store behind the seam: tests use it, and it is the shape the host-memory tier takes. `memory://`
has no bound; `memory://?capacity_bytes=N` keeps at most N bytes of blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from urllib.parse import parse_qs, urlsplit

from deepserve.core.kv.store import BlockKey, BlockStore, StoreStats


def parse_capacity(uri: str) -> int | None:
    """The `capacity_bytes` of a `memory://` URI (None: unbounded); a malformed URI names what is wrong."""
    parts = urlsplit(uri)
    if parts.scheme != "memory" or parts.netloc or parts.path not in ("", "/"):
        raise ValueError(f"a memory store URI is 'memory://' or 'memory://?capacity_bytes=N', got {uri!r}")
    query = parse_qs(parts.query, strict_parsing=bool(parts.query))
    unknown = sorted(set(query) - {"capacity_bytes"})
    if unknown:
        raise ValueError(f"memory store URI {uri!r} has unknown option(s) {unknown}; it takes capacity_bytes")
    if "capacity_bytes" not in query:
        return None
    text = query["capacity_bytes"][-1]
    if not text.isdigit() or int(text) <= 0:
        raise ValueError(f"capacity_bytes must be a positive integer, got {text!r} in {uri!r}")
    return int(text)


class MemoryStore(BlockStore):
    def __init__(self, capacity_bytes: int | None = None) -> None:
        self.capacity_bytes = capacity_bytes
        self._blocks: OrderedDict[BlockKey, bytes] = OrderedDict()  # least recently used first
        self._num_bytes = 0
        self._counts = dict(num_hits=0, num_misses=0, num_puts=0, num_evictions=0)

    @classmethod
    def from_uri(cls, uri: str) -> MemoryStore:
        return cls(parse_capacity(uri))

    async def longest_prefix(self, namespace: str, block_hashes: Sequence[int], pools: Sequence[str]) -> int:
        for n, block_hash in enumerate(block_hashes):
            if not all(BlockKey(namespace, block_hash, pool) in self._blocks for pool in pools):
                return n
        return len(block_hashes)

    async def get_many(self, keys: Sequence[BlockKey], buffers: Sequence[bytearray | memoryview]) -> list[bool]:
        found = []
        for key, buffer in zip(keys, buffers):
            data = self._blocks.get(key)
            ok = data is not None and len(data) == memoryview(buffer).nbytes
            if ok:
                memoryview(buffer).cast("B")[:] = data
                self._blocks.move_to_end(key)
            self._counts["num_hits" if ok else "num_misses"] += 1
            found.append(ok)
        return found

    async def put_many(self, items, ttl_class: str | None = None) -> int:
        stored = 0
        for key, data in items:
            data = bytes(data)
            if self.capacity_bytes is not None and len(data) > self.capacity_bytes:
                continue  # larger than the whole store: dropped (writes are best effort)
            old = self._blocks.pop(key, None)
            self._num_bytes += len(data) - (len(old) if old is not None else 0)
            self._blocks[key] = data
            stored += 1
            self._evict_past_capacity()
        self._counts["num_puts"] += stored
        return stored

    def _evict_past_capacity(self) -> None:
        while self.capacity_bytes is not None and self._num_bytes > self.capacity_bytes:
            _, data = self._blocks.popitem(last=False)
            self._num_bytes -= len(data)
            self._counts["num_evictions"] += 1

    async def evict(self, keys: Sequence[BlockKey]) -> int:
        removed = 0
        for key in keys:
            data = self._blocks.pop(key, None)
            if data is not None:
                self._num_bytes -= len(data)
                removed += 1
        self._counts["num_evictions"] += removed
        return removed

    async def stats(self) -> StoreStats:
        return StoreStats(len(self._blocks), self._num_bytes, **self._counts)

    async def close(self) -> None:
        self._blocks.clear()
        self._num_bytes = 0
