"""The page pool: which KV pages are in use, by how many requests, and which hold a reusable prefix block.

A page is an int id in `[0, num_blocks)`; the tensors behind it live in the model runner, which indexes its
preallocated row pools by page id. This module only does the bookkeeping, all in O(1) per page:

* every page has a reference count (how many requests' block tables hold it) and, once its block of tokens
  is full and computed, an optional block hash (`cache_block`);
* a page whose count drops to 0 is not forgotten: it joins the free queue *with its hash*, so a later
  request with the same prefix can revive it (`get_cached` + `touch`);
* `allocate` takes pages from the front of the free queue, i.e. the least recently freed first (LRU), and a
  cached page taken this way is evicted: its hash mapping is dropped, so no stale hit can ever find it.

Callers (only `KVCacheManager` in the engine) must return every page they got from `allocate` or `touch`
through `free`, once per reference taken.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

from deepserve.core.kv.prefix_hash import BlockHash


class NoFreeBlocksError(RuntimeError):
    """`allocate` was asked for more pages than the pool has free (cached-but-unreferenced ones included)."""


class BlockPool:
    """Reference-counted KV pages with an LRU free queue and a hash -> page map for prefix reuse."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts: list[int] = [0] * num_blocks
        self._hashes: list[BlockHash | None] = [None] * num_blocks
        # page ids with ref count 0, front = evicted first; an OrderedDict gives O(1) removal from the middle,
        # which a prefix hit on a free cached page needs
        self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        #: called with each block hash whose page is evicted (the KV events' BlockRemoved); None: nobody listens
        self.on_evict: Callable[[BlockHash], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Pages `allocate` can hand out now: never used, or unreferenced (possibly still cached)."""
        return len(self._free_queue)

    @property
    def num_cached_blocks(self) -> int:
        """Pages that currently carry a block hash, referenced or not."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of pages referenced by at least one request, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self._hashes[block_id]

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` pages, each with reference count 1, evicting cached free pages LRU-first.

        All or nothing: raises `NoFreeBlocksError` (and changes nothing) when fewer pages are free.
        """
        if num_blocks < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({num_blocks})")
        if not self.can_allocate(num_blocks):
            raise NoFreeBlocksError(f"asked for {num_blocks} KV pages but only {self.num_free_blocks} "
                                    f"of {self.num_blocks} are free")
        pages = []
        for _ in range(num_blocks):
            page, _ = self._free_queue.popitem(last=False)
            self._evict(page)
            self._ref_counts[page] = 1
            pages.append(page)
        return pages

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each page, in order. A page left unreferenced goes to the back of the free
        queue and keeps its hash, so pages freed earlier in `block_ids` are evicted earlier.

        Raises `ValueError` on a page that has no reference left (a double free is a bookkeeping bug).
        """
        for page in block_ids:
            if self._ref_counts[page] <= 0:
                raise ValueError(f"KV page {page} freed more often than it was taken")
            self._ref_counts[page] -= 1
            if self._ref_counts[page] == 0:
                self._free_queue[page] = None

    def get_cached(self, block_hash: BlockHash) -> int | None:
        """The page holding the block with this hash, or None. A pure lookup: call `touch` to use the page."""
        return self._cached.get(block_hash)

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference to each page (a prefix hit). A free page leaves the free queue, so it can no
        longer be evicted; its contents and hash are kept."""
        for page in block_ids:
            if self._ref_counts[page] == 0:
                del self._free_queue[page]
            self._ref_counts[page] += 1

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Register a referenced page as holding the full, computed block with `block_hash`.

        Returns False and leaves the page uncached when another page already holds that block (two requests
        computed the same prefix at once): the first copy stays the one that hits. Re-registering the same
        page under the same hash is a no-op that returns True.
        """
        if self._ref_counts[block_id] <= 0:
            raise ValueError(f"KV page {block_id} is not in use; only pages a request holds can be cached")
        current = self._hashes[block_id]
        if current is not None:
            if current != block_hash:
                raise ValueError(f"KV page {block_id} is already cached under another block hash")
            return True
        if block_hash in self._cached:
            return False
        self._cached[block_hash] = block_id
        self._hashes[block_id] = block_hash
        return True

    def _evict(self, page: int) -> None:
        block_hash = self._hashes[page]
        if block_hash is not None:
            del self._cached[block_hash]
            self._hashes[page] = None
            if self.on_evict is not None:
                self.on_evict(block_hash)
