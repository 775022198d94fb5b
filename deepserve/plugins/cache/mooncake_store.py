"""`mooncake://master-host:port`: blocks in a Mooncake Store cluster (Mooncake's distributed KV cache pool), through
its Python client (`mooncake.store.MooncakeDistributedStore`, from the `mooncake-transfer-engine` wheels).

    key: <namespace>/<pool>/<block hash, hex>     value: the block's bytes

URI: `mooncake://<master host>:<port>?metadata=<metadata server URL>&local_hostname=<this host>&protocol=tcp&
segment_bytes=<bytes>&buffer_bytes=<bytes>&device=<RDMA devices>`. `metadata` defaults to the master's own HTTP
metadata server (`http://<master host>:8080/metadata`, a master started with `-enable_http_metadata_server=true`);
`segment_bytes` (default 64 MiB) is the memory this client contributes to the cluster's pool, `buffer_bytes` (16
MiB) its transfer buffer; `protocol` `tcp` (default) or `rdma` (with `device`).

- The client is synchronous (C++): every call runs on a worker thread (`asyncio.to_thread`), so the deadline of
  `GuardedStore` holds and the store's event loop never blocks.
- Batches are one client call each: `batch_is_exist`, `get_batch`, `upsert_batch`, `batch_remove`.
- Capacity and eviction are the cluster's: the master evicts past its high watermark
  (`-eviction_high_watermark_ratio`). Mooncake keeps no retention class: `ttl_class` is accepted and not used.
- Blocks live in the segments the clients mount: a block written by an engine whose client has closed is gone,
  unless a standalone `mooncake_client` contributed the memory that holds it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from urllib.parse import parse_qs, urlsplit

from deepserve.core.kv.store import BlockKey, BlockStore, StoreStats

_OPTIONS = ("metadata", "local_hostname", "protocol", "segment_bytes", "buffer_bytes", "device")


def parse_uri(uri: str) -> dict:
    """The client's setup arguments from a `mooncake://` URI."""
    parts = urlsplit(uri)
    if parts.scheme != "mooncake" or not parts.hostname or parts.path not in ("", "/"):
        raise ValueError(f"a Mooncake store URI is 'mooncake://master-host:port[?metadata=URL&protocol=tcp...]', "
                         f"got {uri!r}")
    try:
        port = parts.port or 50051
    except ValueError:
        raise ValueError(f"the Mooncake master port in {uri!r} must be a number") from None
    query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
    unknown = sorted(set(query) - set(_OPTIONS))
    if unknown:
        raise ValueError(f"unknown Mooncake store options {unknown} in {uri!r}; known: {list(_OPTIONS)}")
    sizes = {}
    for name, default in (("segment_bytes", 64 << 20), ("buffer_bytes", 16 << 20)):
        value = query.get(name, str(default))
        if not value.isdigit() or int(value) <= 0:
            raise ValueError(f"{name} must be a positive number of bytes, got {value!r} in {uri!r}")
        sizes[name] = int(value)
    protocol = query.get("protocol", "tcp")
    if protocol not in ("tcp", "rdma"):
        raise ValueError(f"protocol must be 'tcp' or 'rdma', got {protocol!r} in {uri!r}")
    return dict(master=f"{parts.hostname}:{port}",
                metadata=query.get("metadata", f"http://{parts.hostname}:8080/metadata"),
                local_hostname=query.get("local_hostname", "127.0.0.1"), protocol=protocol,
                device=query.get("device", ""), **sizes)


class MooncakeStore(BlockStore):
    def __init__(self, master: str, metadata: str, local_hostname: str = "127.0.0.1", protocol: str = "tcp",
                 device: str = "", segment_bytes: int = 64 << 20, buffer_bytes: int = 16 << 20) -> None:
        from mooncake.store import MooncakeDistributedStore  # the client loads only when this store is chosen

        self.client = MooncakeDistributedStore()
        rc = self.client.setup(local_hostname, metadata, segment_bytes, buffer_bytes, protocol, device, master)
        if rc != 0:
            raise ConnectionError(f"Mooncake Store setup failed (code {rc}) for master {master}, metadata {metadata}")
        self._counts = dict(num_hits=0, num_misses=0, num_puts=0, num_evictions=0)

    @classmethod
    def from_uri(cls, uri: str) -> MooncakeStore:
        return cls(**parse_uri(uri))

    @staticmethod
    def _key(key: BlockKey) -> str:
        return f"{key.namespace}/{key.pool}/{key.block_hash & (2**256 - 1):x}"

    async def longest_prefix(self, namespace: str, block_hashes: Sequence[int], pools: Sequence[str]) -> int:
        if not block_hashes or not pools:
            return len(block_hashes) if not pools else 0
        keys = [self._key(BlockKey(namespace, h, pool)) for h in block_hashes for pool in pools]
        present = await asyncio.to_thread(self.client.batch_is_exist, keys)
        for n in range(len(block_hashes)):
            if not all(p == 1 for p in present[n * len(pools):(n + 1) * len(pools)]):
                return n
        return len(block_hashes)

    async def get_many(self, keys: Sequence[BlockKey], buffers: Sequence[bytearray | memoryview]) -> list[bool]:
        if not keys:
            return []
        values = await asyncio.to_thread(self.client.get_batch, [self._key(k) for k in keys])
        found = []
        for value, buffer in zip(values, buffers):
            ok = value is not None and len(value) == len(buffer)  # missing: empty; another layout: another size
            if ok:
                buffer[:] = value
            found.append(ok)
        self._counts["num_hits"] += sum(found)
        self._counts["num_misses"] += len(found) - sum(found)
        return found

    async def put_many(self, items, ttl_class: str | None = None) -> int:
        if not items:
            return 0
        keys = [self._key(k) for k, _ in items]
        rc = await asyncio.to_thread(self.client.upsert_batch, keys, [bytes(v) for _, v in items])
        if rc != 0:
            return 0
        self._counts["num_puts"] += len(items)
        return len(items)

    async def evict(self, keys: Sequence[BlockKey]) -> int:
        if not keys:
            return 0
        codes = await asyncio.to_thread(self.client.batch_remove, [self._key(k) for k in keys], True)
        removed = sum(1 for c in codes if c == 0)
        self._counts["num_evictions"] += removed
        return removed

    async def stats(self) -> StoreStats:
        return StoreStats(num_blocks=0, num_bytes=0, **self._counts)  # the cluster's totals are the master's

    async def close(self) -> None:
        await asyncio.to_thread(self.client.close)
