"""`dir:///path`: blocks as plain files under a directory, the layout a 3FS FUSE mount (or any shared POSIX
file system) holds, so every engine that mounts it reads every block, and the blocks outlive the process.

    <root>/<ttl class>/<day>/<namespace digest>/<pool>/<block hash>.blk

- **Atomic writes**: a block is written to a temporary file beside its place and renamed over it, so a reader sees
  a whole block or none.
- **Checksums**: each file is a header (magic, payload length, CRC-32) and the payload; a block whose file is short,
  too long or fails its checksum is a miss, and its file is removed.
- **TTL classes as time buckets**: a block goes into its class's directory for the day it was written (`agent`:
  3 days, `chat`: 7 days, DeepSeek's retention; `?ttl_class=` picks the default, `put_many(ttl_class=)` per call).
  Reads look only at the days still alive; `gc()` removes whole expired day directories. The clock is injectable.
- **LRU past a watermark**: a write or a read sets its file's mtime to the store's clock; when the store holds more than `capacity_bytes *
  high`, `gc()` (run by the writes that cross it) removes the least recently used files down to `capacity_bytes *
  low`. A block a read has found is pinned until the read is done: `gc()` passes over it, so nothing is evicted
  under a reader (it goes at the next `gc()`).

URI options: `capacity_bytes`, `high` (0.9), `low` (0.8), `ttl_class` (`chat`). File I/O runs on a worker thread,
never on the caller's event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import struct
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from deepserve.core.kv.store import TTL_DAYS, BlockKey, BlockStore, StoreStats, check_ttl_class

#: the classes from the longest retention to the shortest: the order reads look in, so that a block re-put under
#: a longer class (a later request of that class hit it) is read, and kept fresh, there
_LONGEST_FIRST = sorted(TTL_DAYS, key=TTL_DAYS.get, reverse=True)
DAY = 86400
_HEADER = struct.Struct("<4sQI")  # magic, payload length, crc32
_MAGIC = b"DSKV"


def parse_uri(uri: str) -> dict:
    parts = urlsplit(uri)
    if parts.scheme != "dir" or parts.netloc or not parts.path.startswith("/"):
        raise ValueError(f"a directory store URI is 'dir:///absolute/path[?capacity_bytes=N]', got {uri!r}")
    query = {k: v[-1] for k, v in parse_qs(parts.query, strict_parsing=bool(parts.query)).items()}
    unknown = sorted(set(query) - {"capacity_bytes", "high", "low", "ttl_class"})
    if unknown:
        raise ValueError(f"directory store URI {uri!r} has unknown option(s) {unknown}; it takes capacity_bytes, "
                         "high, low, ttl_class")
    options: dict = {"root": parts.path}
    try:
        if "capacity_bytes" in query:
            options["capacity_bytes"] = int(query["capacity_bytes"])
        for name in ("high", "low"):
            if name in query:
                options[name] = float(query[name])
    except ValueError:
        raise ValueError(f"directory store URI {uri!r}: capacity_bytes must be an integer, high and low numbers") \
            from None
    if "ttl_class" in query:
        options["ttl_class"] = query["ttl_class"]
    return options


class DirStore(BlockStore):
    def __init__(self, root: str | os.PathLike, capacity_bytes: int | None = None, high: float = 0.9,
                 low: float = 0.8, ttl_class: str = "chat", clock: Callable[[], float] = time.time) -> None:
        if capacity_bytes is not None and capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        if not 0 < low < high <= 1:
            raise ValueError(f"the watermarks must satisfy 0 < low < high <= 1, got low={low}, high={high}")
        check_ttl_class(ttl_class)
        self.root, self.capacity_bytes, self.high, self.low = Path(root), capacity_bytes, high, low
        self.ttl_class, self.clock = ttl_class, clock
        self.root.mkdir(parents=True, exist_ok=True)
        self._counts = dict(num_hits=0, num_misses=0, num_puts=0, num_evictions=0)
        self._num_bytes: int | None = None  # bytes of block files, counted at the first write, kept after
        self._pinned: Counter[Path] = Counter()  # block files being read, which gc() leaves alone
        self._pin_lock = threading.Lock()

    @classmethod
    def from_uri(cls, uri: str) -> DirStore:
        return cls(**parse_uri(uri))

    # -- layout ------------------------------------------------------------------------------------------------
    def _live_days(self, ttl_class: str) -> list[int]:
        today = int(self.clock() // DAY)
        return list(range(today, today - TTL_DAYS[ttl_class], -1))

    def _relative(self, key: BlockKey) -> Path:
        ns = hashlib.sha256(key.namespace.encode()).hexdigest()[:16]
        pool = "".join(c if c.isalnum() or c in "-_" else "_" for c in key.pool) or "_"
        return Path(ns) / pool / f"{key.block_hash & (2**256 - 1):016x}.blk"

    def _find(self, key: BlockKey) -> Path | None:
        rel = self._relative(key)
        for ttl_class in _LONGEST_FIRST:
            for day in self._live_days(ttl_class):
                path = self.root / ttl_class / str(day) / rel
                if path.is_file():
                    return path
        return None

    # -- blocking operations (on a worker thread) --------------------------------------------------------------
    def _read(self, key: BlockKey, buffer) -> bool:
        view = memoryview(buffer).cast("B")
        with self._pin_lock:  # found and pinned at once: a gc() between the two could take it
            path = self._find(key)
            if path is None:
                return False
            self._pinned[path] += 1
        try:
            data = self._read_file(path)
        except OSError:
            return False
        finally:
            with self._pin_lock:
                self._pinned[path] -= 1
                if not self._pinned[path]:
                    del self._pinned[path]
        if len(data) < _HEADER.size:
            return self._drop(path)
        magic, length, crc = _HEADER.unpack_from(data)
        payload = data[_HEADER.size:]
        if magic != _MAGIC or length != len(payload) or zlib.crc32(payload) != crc:
            return self._drop(path)  # corrupt or truncated: a miss, and gone
        if length != view.nbytes:
            return False
        view[:] = payload
        now = self.clock()
        os.utime(path, (now, now))  # the LRU's clock: when the block was last used
        return True

    @staticmethod
    def _read_file(path: Path) -> bytes:
        return path.read_bytes()

    def _drop(self, path: Path) -> bool:
        path.unlink(missing_ok=True)
        return False

    def _write(self, key: BlockKey, data, ttl_class: str) -> None:
        path = self.root / ttl_class / str(self._live_days(ttl_class)[0]) / self._relative(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = bytes(data)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{id(payload)}.tmp")
        tmp.write_bytes(_HEADER.pack(_MAGIC, len(payload), zlib.crc32(payload)) + payload)
        old = path.stat().st_size if path.exists() else 0
        os.replace(tmp, path)
        now = self.clock()
        os.utime(path, (now, now))
        if self._num_bytes is not None:
            self._num_bytes += _HEADER.size + len(payload) - old

    def _files(self) -> list[tuple[float, int, Path]]:
        out = []
        for path in self.root.rglob("*.blk"):
            try:
                st = path.stat()
            except OSError:
                continue
            out.append((st.st_mtime, st.st_size, path))
        return out

    def gc(self) -> int:
        """Remove expired day directories, then, past the high watermark, the least recently used blocks down to
        the low one. Returns how many block files went."""
        removed = 0
        for ttl_class in TTL_DAYS:
            live = {str(d) for d in self._live_days(ttl_class)}
            for day_dir in (self.root / ttl_class).glob("*") if (self.root / ttl_class).is_dir() else ():
                if day_dir.name not in live:
                    with self._pin_lock:
                        if any(path.is_relative_to(day_dir) for path in self._pinned):
                            continue  # a read still holds one of its files: the next gc() takes the day
                    files = list(day_dir.rglob("*.blk"))
                    removed += len(files)
                    for f in sorted(day_dir.rglob("*"), reverse=True):
                        f.unlink() if f.is_file() else f.rmdir()
                    day_dir.rmdir()
        files = sorted(self._files())
        total = sum(size for _, size, _ in files)
        if self.capacity_bytes is not None:
            if total > self.capacity_bytes * self.high:
                with self._pin_lock:
                    for _, size, path in files:
                        if total <= self.capacity_bytes * self.low:
                            break
                        if path in self._pinned:
                            continue  # being read: not evicted under its reader
                        path.unlink(missing_ok=True)
                        total -= size
                        removed += 1
        self._num_bytes = total
        self._counts["num_evictions"] += removed
        return removed

    # -- the BlockStore interface --------------------------------------------------------------------------------
    async def longest_prefix(self, namespace: str, block_hashes: Sequence[int], pools: Sequence[str]) -> int:
        def run() -> int:
            for n, block_hash in enumerate(block_hashes):
                if not all(self._find(BlockKey(namespace, block_hash, pool)) for pool in pools):
                    return n
            return len(block_hashes)

        return await asyncio.to_thread(run)

    async def get_many(self, keys: Sequence[BlockKey], buffers) -> list[bool]:
        found = await asyncio.to_thread(lambda: [self._read(k, b) for k, b in zip(keys, buffers)])
        self._counts["num_hits"] += sum(found)
        self._counts["num_misses"] += len(found) - sum(found)
        return found

    async def put_many(self, items, ttl_class: str | None = None) -> int:
        ttl_class = ttl_class or self.ttl_class
        check_ttl_class(ttl_class)

        def run() -> int:
            if self._num_bytes is None:
                self._num_bytes = sum(size for _, size, _ in self._files())
            for key, data in items:
                self._write(key, data, ttl_class)
            if self.capacity_bytes is not None and self._num_bytes > self.capacity_bytes * self.high:
                self.gc()
            return len(items)

        stored = await asyncio.to_thread(run)
        self._counts["num_puts"] += stored
        return stored

    async def evict(self, keys: Sequence[BlockKey]) -> int:
        def run() -> int:
            removed = 0
            for key in keys:
                path = self._find(key)
                if path is not None:
                    if self._num_bytes is not None:
                        self._num_bytes -= path.stat().st_size
                    path.unlink(missing_ok=True)
                    removed += 1
            return removed

        removed = await asyncio.to_thread(run)
        self._counts["num_evictions"] += removed
        return removed

    async def stats(self) -> StoreStats:
        files = await asyncio.to_thread(self._files)
        return StoreStats(len(files), sum(size - _HEADER.size for _, size, _ in files), **self._counts)
