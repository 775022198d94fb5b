"""Bookkeeping of the paged DeepSeek-V4 KV cache, in plain Python: which pages each request holds, and which
full blocks of tokens can be reused by a later request with the same prefix.

* `block_pool`: `BlockPool`, reference-counted pages with an LRU free queue and a block-hash index.
* `prefix_hash`: chained sha256 hashes of full blocks, with a per-request `cache_salt` for tenant isolation.
* `manager`: `KVCacheManager`, the scheduler's view: block tables, prefix hits, allocation, freeing; and the
  sizing helpers `rows_per_page` and `pages_for_budget`.

The tensors behind the pages live in the model runner; nothing here imports torch.
"""

from deepserve.core.kv.block_pool import BlockPool, NoFreeBlocksError
from deepserve.core.kv.manager import CSA_RATIO, HCA_RATIO, KVCacheManager, pages_for_budget, rows_per_page
from deepserve.core.kv.prefix_hash import (
    BLOCK_SIZE_ALIGNMENT,
    BlockHash,
    block_hashes,
    extend_block_hashes,
    hash_block,
    validate_block_size,
)

__all__ = [
    "BLOCK_SIZE_ALIGNMENT",
    "CSA_RATIO",
    "HCA_RATIO",
    "BlockHash",
    "BlockPool",
    "KVCacheManager",
    "NoFreeBlocksError",
    "block_hashes",
    "extend_block_hashes",
    "hash_block",
    "pages_for_budget",
    "rows_per_page",
    "validate_block_size",
]
