"""Per-request block tables over one `BlockPool`, with prefix reuse. Called by the scheduler only.

A request's block table lists the pages holding its tokens: page `table[i]` holds tokens
`[i * block_size, (i + 1) * block_size)`. In DeepSeek-V4 a page of P tokens holds, per layer, the compressed
rows those tokens emit (`rows_per_page`): P/4 CSA rows and P/4 index keys, or P/128 HCA rows. The sliding
window ring and the compression frontier are per-sequence state outside the pages.

Life of a request, as the scheduler drives it:

1. `get_computed_blocks(rid, prompt, salt)` once when the request is (re)scheduled from waiting: the request
   takes a reference to the pages of its longest cached prefix and starts with that many computed tokens.
2. `allocate_slots(rid, n)` before each step, with n = tokens that will hold KV after the step. None means the
   pool is short; nothing changed, and the scheduler preempts someone or keeps the request waiting.
3. `cache_full_blocks(rid, tokens, num_computed, salt)` after each step, so later requests can hit the blocks
   this one filled.
4. `free(rid)` exactly once when the request finishes, is aborted or is preempted, including after step 1 when
   step 2 failed. After `free`, every page the request held is back in the pool.

With cache tiers below the GPU (`deepserve.core.kv.tiers`): before step 1, `prepare_load(rid, hashes, first)`
takes pages for the blocks a lower tier found and registers them under their hashes (the caller copies the bytes
in before any step reads them); those pages, and the GPU-cached blocks before them, are *held* for the request
until its `get_computed_blocks` (or `free`), so nothing evicts them while it waits. With `record_new_blocks` on,
`take_new_blocks()` hands out the pages `cache_full_blocks` registered since the last call (what a step computed,
for the tiers to copy out). With an `emit` callback, every block registered and every page evicted is a KV event
(`deepserve.core.kv.events`: BlockStored / BlockRemoved, medium GPU) for cache-aware routers.

Each registered page also keeps the retention class (`agent`, `chat`: `deepserve.core.kv.store.TTL_DAYS`) its
block goes to a store under: the class of the request that computed it (`ttl_class` of `cache_full_blocks`, None:
`default_ttl_class`), or, for a page placed from a lower tier, of the request that loaded it. A prefix hit by a
request of a longer class raises the page's class and (with `record_new_blocks`) hands the block out again, marked
`reput`, so the tiers write it once more under the longer class; a hit never shortens a class.

Pages placed from a store that keeps no window snapshots (`kv_store_snapshots=False`) are marked
(`mark_unsnapshotted`): a prefix hit that ends on one records a *snapshot replay* (`take_snapshot_replay`), which
the engine has the runner do before the request's first step (SWA replay, docs/cache.md); a page allocated
afresh is computed, so it loses the mark.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from deepserve.core.kv.block_pool import BlockPool
from deepserve.core.kv.prefix_hash import BlockHash, extend_block_hashes, validate_block_size
from deepserve.core.kv.store import TTL_DAYS, check_ttl_class

RequestId = str

#: tokens per compressed row: CSA main rows and indexer keys, and HCA rows (spec section 4.4)
CSA_RATIO = 4
HCA_RATIO = 128


class NewBlock(NamedTuple):
    """A block for the tiers below the GPU to copy out of its page: one a step computed, or (`reput`) one a
    request of a longer retention class hit, to be stored again under `ttl_class`."""

    block_hash: BlockHash
    page: int
    ttl_class: str
    reput: bool = False


def rows_per_page(block_size: int, ratio: int) -> int:
    """How many rows of a stream emitting one row per `ratio` tokens a page of `block_size` tokens holds:
    `block_size // ratio` (CSA rows and index keys at ratio 4, HCA rows at ratio 128)."""
    validate_block_size(block_size)
    if ratio <= 0 or block_size % ratio:
        raise ValueError(f"a page of {block_size} tokens does not hold a whole number of rows at ratio {ratio}")
    return block_size // ratio


def pages_for_budget(kv_cache_bytes: int, bytes_per_page: int) -> int:
    """How many pages of `bytes_per_page` bytes (all layers' rows for one page) fit in `kv_cache_bytes`."""
    if bytes_per_page <= 0:
        raise ValueError(f"bytes_per_page must be positive, got {bytes_per_page}")
    num_pages = kv_cache_bytes // bytes_per_page
    if num_pages <= 0:
        raise ValueError(f"the KV cache budget of {kv_cache_bytes} bytes holds no page of {bytes_per_page} bytes; "
                         "raise kv_cache_bytes or gpu_memory_utilization, or use a smaller block_size")
    return num_pages


class KVCacheManager:
    """Block tables of the running requests, and the prefix cache shared between them."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 emit: Callable[[object], None] | None = None) -> None:
        """`emit`: called with a KV event (`deepserve.core.kv.events`) for each block registered and each page
        evicted, in the order they happen; None: no events."""
        self.block_size = validate_block_size(block_size)
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[RequestId, list[int]] = {}
        # per request: hashes of its full blocks known so far, its salt, and how many of its pages are registered
        self._hashes: dict[RequestId, list[BlockHash]] = {}
        self._salts: dict[RequestId, str | None] = {}
        self._num_registered: dict[RequestId, int] = {}
        #: prefix-cache lookups, in tokens: tokens asked about, and tokens found cached
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0
        self._held: dict[RequestId, list[int]] = {}  # pages held for requests waiting on a lower tier
        #: keep a `NewBlock` of every block `cache_full_blocks` registers (and of every re-put), for `take_new_blocks`
        self.record_new_blocks = False
        self._new_blocks: list[NewBlock] = []
        #: the retention class of blocks whose request names none (the engine's `kv_store_ttl_class`)
        self.default_ttl_class = "chat"
        self._page_ttl: dict[int, str] = {}  # registered page -> the retention class its block is stored under
        self._ttl: dict[RequestId, str | None] = {}  # request -> its own class (None: the default)
        self._unsnapshotted: set[int] = set()  # pages whose boundary snapshot is not there
        self._replays: dict[RequestId, tuple[int, list[int]]] = {}  # request -> (boundary, its hit pages)
        self.emit = emit
        if emit is not None:
            from deepserve.core.kv.events import BlockRemoved

            self.pool.on_evict = lambda block_hash: emit(BlockRemoved([block_hash], "GPU"))

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_computed_blocks(
        self, request_id: RequestId, token_ids: Sequence[int], cache_salt: str | None = None, use_hits: bool = True,
        ttl_class: str | None = None,
    ) -> tuple[list[int], int]:
        """Give a request with no pages the pages of its longest cached prefix of full blocks.

        Returns (pages, num_cached_tokens); the request now holds a reference to each page. The hit is capped at
        `len(token_ids) - 1` rounded down to a block boundary: the model must compute at least one token to
        produce logits. With prefix caching off this returns ([], 0) and only creates an empty table.
        `use_hits=False`: compute every token (a request that wants its prompt's logprobs), while its full blocks
        are still hashed and cached for others. `ttl_class`: the request's retention class (None: the default);
        a hit page of a shorter class takes this one and is handed out again (`NewBlock.reput`).
        """
        if request_id in self.block_tables:
            raise ValueError(f"request {request_id!r} already holds KV pages; free it before looking it up again")
        self.block_tables[request_id] = []
        self._num_registered[request_id] = 0
        if not self.enable_prefix_caching:
            return [], 0
        hashes = extend_block_hashes([], token_ids, self.block_size, cache_salt)
        self._hashes[request_id] = hashes
        self._salts[request_id] = cache_salt
        max_blocks = max(len(token_ids) - 1, 0) // self.block_size if use_hits else 0
        hit: list[int] = []
        for block_hash in hashes[:max_blocks]:
            page = self.pool.get_cached(block_hash)
            if page is None:
                break
            hit.append(page)
        self.pool.touch(hit)
        self._release_hold(request_id)  # after the touch: a held page stays referenced throughout
        ttl = self._ttl[request_id] = self._ttl_class(ttl_class)
        for block_hash, page in zip(hashes, hit):
            if TTL_DAYS[self._page_ttl.get(page, ttl)] < TTL_DAYS[ttl]:
                self._page_ttl[page] = ttl
                if self.record_new_blocks:
                    self._new_blocks.append(NewBlock(block_hash, page, ttl, reput=True))
        self.block_tables[request_id] = list(hit)
        self._num_registered[request_id] = len(hit)
        num_cached_tokens = len(hit) * self.block_size
        if hit and hit[-1] in self._unsnapshotted:
            self._replays[request_id] = (num_cached_tokens, list(hit))
        self.num_prefix_queries += len(token_ids)
        self.num_prefix_hits += num_cached_tokens
        return hit, num_cached_tokens

    def allocate_slots(self, request_id: RequestId, num_tokens_total: int) -> list[int] | None:
        """Grow the request's table to cover `num_tokens_total` tokens; return the pages added (maybe none).

        Returns None, changing nothing, when the pool has too few free pages. A request seen for the first time
        gets a new table.
        """
        table = self.block_tables.get(request_id, [])
        num_needed = -(-num_tokens_total // self.block_size) - len(table)
        if num_needed <= 0:
            return []
        if not self.pool.can_allocate(num_needed):
            return None
        if request_id not in self.block_tables:
            self.block_tables[request_id] = table
            self._num_registered[request_id] = 0
        new_pages = self.pool.allocate(num_needed)
        self._unsnapshotted.difference_update(new_pages)
        table.extend(new_pages)
        return new_pages

    def cache_full_blocks(
        self, request_id: RequestId, token_ids: Sequence[int], num_computed_tokens: int, cache_salt: str | None = None,
        ttl_class: str | None = None,
    ) -> None:
        """Register the request's blocks that are full and computed within its first `num_computed_tokens` tokens.

        `token_ids` are the request's tokens so far (prompt then output), at least `num_computed_tokens` of them;
        `cache_salt` must be the one given to `get_computed_blocks`. A partial last block is never registered.
        `ttl_class`: the retention class its blocks are stored under (None: the one given to
        `get_computed_blocks`, else the default).
        """
        if not self.enable_prefix_caching:
            return
        table = self.block_tables[request_id]
        if self._salts.setdefault(request_id, cache_salt) != cache_salt:
            raise ValueError(f"request {request_id!r} changed its cache_salt; its blocks would be cached for "
                             "the wrong tenant")
        if num_computed_tokens > len(token_ids):
            raise ValueError(f"{num_computed_tokens} computed tokens but only {len(token_ids)} token ids given")
        num_full = min(num_computed_tokens // self.block_size, len(table))
        start = self._num_registered[request_id]
        if num_full <= start:
            return
        hashes = extend_block_hashes(self._hashes.setdefault(request_id, []),
                                     token_ids[:num_full * self.block_size], self.block_size, cache_salt)
        ttl = self._ttl_class(ttl_class) if ttl_class is not None else self._ttl.get(request_id) \
            or self.default_ttl_class
        for i in range(start, num_full):
            if self.pool.cache_block(table[i], hashes[i]):
                self._page_ttl[table[i]] = ttl
                if self.record_new_blocks:
                    self._new_blocks.append(NewBlock(hashes[i], table[i], ttl))
                self._stored(hashes, i, token_ids)
        self._num_registered[request_id] = num_full

    def _stored(self, hashes: Sequence[BlockHash], i: int, token_ids: Sequence[int]) -> None:
        if self.emit is not None:
            from deepserve.core.kv.events import BlockStored

            self.emit(BlockStored([hashes[i]], hashes[i - 1] if i else None,
                                  list(token_ids[i * self.block_size:(i + 1) * self.block_size]), self.block_size,
                                  None, "GPU"))

    def _ttl_class(self, ttl_class: str | None) -> str:
        return check_ttl_class(ttl_class) if ttl_class is not None else self.default_ttl_class

    def ttl_class_of(self, page: int) -> str | None:
        """The retention class the block in registered `page` is stored under (None: the page holds none)."""
        return self._page_ttl.get(page) if self.pool.block_hash(page) is not None else None

    def take_new_blocks(self) -> list[NewBlock]:
        """The blocks registered by `cache_full_blocks`, and the hits re-put under a longer class, since the last
        call (with `record_new_blocks` on). Their pages hold the blocks' bytes until the next step is planned."""
        new, self._new_blocks = self._new_blocks, []
        return new

    def cached_prefix_length(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many of `block_hashes`, from the first on, the GPU pages hold now (a lookup; nothing is taken)."""
        for n, block_hash in enumerate(block_hashes):
            if self.pool.get_cached(block_hash) is None:
                return n
        return len(block_hashes)

    def prepare_load(self, request_id: RequestId, block_hashes: Sequence[BlockHash], first: int,
                     token_ids: Sequence[int] = (), ttl_class: str | None = None) -> list[tuple[int, int]]:
        """Hold pages for a request's prefix before it is admitted: the GPU-cached blocks of `block_hashes`, and
        a new page for each block from index `first` on that is not cached (a lower tier has its bytes), as far
        as free pages last. Blocks before `first` must be cached, or the prefix ends there. The new pages are
        registered under their hashes now; returns [(block index, page)] of those, which the caller must fill
        before any step reads them. The hold ends at the request's `get_computed_blocks` or `free`. `token_ids`:
        the request's tokens, for the KV events of the blocks registered. `ttl_class`: the loading request's
        retention class, which the new pages take (their copies below are not rewritten for it)."""
        if request_id in self._held or request_id in self.block_tables:
            raise ValueError(f"request {request_id!r} already holds KV pages")
        held: list[int] = []
        new: list[tuple[int, int]] = []
        for i, block_hash in enumerate(block_hashes):
            page = self.pool.get_cached(block_hash)
            if page is not None:
                self.pool.touch([page])
            elif i < first or not self.pool.can_allocate(1):
                break
            else:
                page = self.pool.allocate(1)[0]
                self._unsnapshotted.discard(page)
                self.pool.cache_block(page, block_hash)
                self._page_ttl[page] = self._ttl_class(ttl_class)
                new.append((i, page))
                if len(token_ids) >= (i + 1) * self.block_size:
                    self._stored(block_hashes, i, token_ids)
            held.append(page)
        self._held[request_id] = held
        return new

    def mark_unsnapshotted(self, pages: Sequence[int]) -> None:
        """These pages were placed without their boundary snapshot: a hit ending on one must replay it first."""
        self._unsnapshotted.update(pages)

    def take_snapshot_replay(self, request_id: RequestId) -> tuple[int, list[int]] | None:
        """(boundary, pages) when the request's prefix hit ended on a page without its snapshot, once."""
        return self._replays.pop(request_id, None)

    def snapshot_replayed(self, page: int) -> None:
        """The page's snapshot is rebuilt (before any step reads it): hits may end on it as on any other."""
        self._unsnapshotted.discard(page)

    def _release_hold(self, request_id: RequestId) -> None:
        held = self._held.pop(request_id, None)
        if held:
            self.pool.free(reversed(held))

    def free(self, request_id: RequestId) -> None:
        """Return every page the request holds. Unknown ids are ignored, so an abort may come at any time.

        Pages go back tail first: under LRU a prefix's last blocks are then evicted before its first ones, which
        every longer hit depends on.
        """
        self._release_hold(request_id)
        self._replays.pop(request_id, None)
        table = self.block_tables.get(request_id)
        if table is not None:
            self.pool.free(reversed(table))
        self.block_tables.pop(request_id, None)
        self._hashes.pop(request_id, None)
        self._salts.pop(request_id, None)
        self._num_registered.pop(request_id, None)
        self._ttl.pop(request_id, None)
