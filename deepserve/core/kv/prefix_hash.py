"""Content hashes of full token blocks, chained so that a block's hash names its whole prefix.

`hash_block(parent, tokens, extra)` is sha256 over a stable, length-prefixed byte encoding of the parent hash,
the block's token ids and any extra keys, so it is the same in every process and on every run (Python's
`hash()` is salted per process and could not be shared). Two blocks get the same hash only if every token
before them and in them is the same: a hit on block i implies hits on blocks 0..i-1.

Only full blocks are hashed; a partial last block is never cached. The per-request `cache_salt` goes into the
extra keys of the *first* block; since every later hash chains on it, requests with different salts (or one
with a salt and one without) never share a page. `None` means "no salt"; any string, the empty one included,
is a salt.

Block sizes: the V4 engine needs pages of a multiple of 128 tokens (`validate_block_size`), because HCA layers
emit one row per 128 tokens and a prefix hit must land where the HCA frontier is empty (spec section 4.4).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

#: a block hash: 32 bytes of sha256
BlockHash = bytes
#: extra keys a block's hash depends on besides its tokens (cache salt today; adapters or images later)
ExtraKey = str | int | bytes

#: page sizes must be multiples of this: the HCA compression ratio of DeepSeek-V4
BLOCK_SIZE_ALIGNMENT = 128

_DOMAIN = b"deepserve.kv.block.v1"


def validate_block_size(block_size: int) -> int:
    """Return `block_size` if it is a positive multiple of 128 tokens, else raise `ValueError`."""
    if not isinstance(block_size, int) or block_size <= 0 or block_size % BLOCK_SIZE_ALIGNMENT:
        raise ValueError(f"block_size must be a positive multiple of {BLOCK_SIZE_ALIGNMENT} tokens for "
                         f"DeepSeek-V4 (one HCA row per 128 tokens), got {block_size!r}")
    return block_size


def hash_block(parent_hash: BlockHash | None, token_ids: Sequence[int], extra: Sequence[ExtraKey] = ()) -> BlockHash:
    """The hash of one block given its parent's hash (None for the first block), its token ids and extra keys."""
    h = hashlib.sha256(_DOMAIN)
    h.update(b"\x00" if parent_hash is None else b"\x01" + _length(parent_hash) + parent_hash)
    h.update(_length(token_ids))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    h.update(_length(extra))
    for key in extra:
        h.update(_encode_extra(key))
    return h.digest()


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, cache_salt: str | None = None
) -> list[BlockHash]:
    """Append to `hashes` (the chain of `token_ids`' first blocks, as far as already known) the hashes of the
    remaining full blocks of `token_ids`, and return it. Lets a caller hash a growing sequence incrementally."""
    num_full = len(token_ids) // block_size
    for i in range(len(hashes), num_full):
        parent = hashes[i - 1] if i else None
        extra = () if i or cache_salt is None else (cache_salt,)
        hashes.append(hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], extra))
    return hashes


def block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None) -> list[BlockHash]:
    """The chained hashes of the full blocks of `token_ids` (`len(token_ids) // block_size` of them)."""
    return extend_block_hashes([], token_ids, validate_block_size(block_size), cache_salt)


def _length(items: Sequence[object] | bytes) -> bytes:
    return struct.pack("<Q", len(items))


def _encode_extra(key: ExtraKey) -> bytes:
    # a type tag and a length prefix keep ("ab",) and ("a", "b"), or 1 and "1", apart
    if isinstance(key, bool) or not isinstance(key, str | int | bytes):
        raise TypeError(f"extra hash keys must be str, int or bytes, got {type(key).__name__}")
    if isinstance(key, int):
        return b"i" + struct.pack("<q", key)
    raw, tag = (key.encode("utf-8"), b"s") if isinstance(key, str) else (key, b"b")
    return tag + _length(raw) + raw
