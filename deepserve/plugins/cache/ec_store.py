"""`ec:K+M:<child URI>[,<child URI>...]`: a block stored as K + M erasure-coded fragments, one per child store, so
that any K children decode it (DeepInfer's 10+2 over its storage nodes). pyeclib's Reed-Solomon codes, on ISA-L
(`isa_l_rs_vand`, shipped in pyeclib's wheel; liberasurecode's own `liberasurecode_rs_vand` where ISA-L is absent).

Children: exactly K + M comma-separated URIs of any stores (`ec:10+2:redis://n1:6379/0,...,redis://n12:6379/0`),
or one `dir://` root that holds the K + M shard directories (`ec:10+2:dir:///mnt/3fs/kv` -> `.../shard00` ..
`.../shard11`, each a `dir://` store with the root's options, so `capacity_bytes` is per shard).

- **Write**: the block (with its length and CRC-32 in front) is encoded into K + M fragments; fragment i goes to
  child i under the block's own key, framed with its own CRC-32. A write counts where K children took it.
- **Read** (the one-straggler rule): ask K + 1 children (the K data fragments' and one parity) and decode each
  block from the first K good fragments that come back; the rest are asked when a child fails, when the first
  ones cannot make K for some block (fragments lost or corrupt), or when `straggler_seconds` pass without an
  answer. A fragment whose CRC fails is discarded, and a block whose decode does not check out is a miss.
- **Lookup**: every child is asked how much of the prefix it holds; the prefix is as long as the K-th longest
  answer (what K children hold). Answers past `straggler_seconds` are not waited for once K are in.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import struct
import zlib
from collections.abc import Awaitable, Callable, Sequence
from functools import lru_cache

from deepserve.core.kv.store import BlockKey, BlockStore, StoreStats

logger = logging.getLogger(__name__)

_FRAME = struct.Struct("<4sI")  # magic, crc32 of the fragment
_FRAME_MAGIC = b"DSEC"
_BLOCK = struct.Struct("<QI")  # payload length, crc32 of the payload (inside the encoded data)
_MAX_DECODE_TRIES = 80  # K-subsets tried per block: every one of 12 choose 10 (66)
EC_TYPES = ("isa_l_rs_vand", "liberasurecode_rs_vand")


def parse_uri(uri: str) -> tuple[int, int, list[str]]:
    """(k, m, child URIs) of an `ec:K+M:<children>` URI."""
    scheme, _, rest = uri.partition(":")
    code, sep, children = rest.partition(":")
    k_text, plus, m_text = code.partition("+")
    if scheme != "ec" or not sep or not plus or not k_text.isdigit() or not m_text.isdigit():
        raise ValueError(f"an erasure-coded store URI is 'ec:K+M:<child URI>[,<child URI>...]' "
                         f"(e.g. 'ec:10+2:dir:///mnt/kv'), got {uri!r}")
    k, m = int(k_text), int(m_text)
    if k < 1 or m < 1 or k + m > 32:
        raise ValueError(f"an erasure code needs K >= 1, M >= 1 and K + M <= 32, got {k}+{m} in {uri!r}")
    uris = [c for c in children.split(",") if c]
    if len(uris) == 1 and uris[0].startswith("dir:"):
        root, q, query = uris[0].partition("?")
        uris = [f"{root.rstrip('/')}/shard{i:02d}{q}{query}" for i in range(k + m)]
    if len(uris) != k + m:
        raise ValueError(f"'ec:{k}+{m}' needs {k + m} child store URIs (or one dir:// root for the shard "
                         f"directories), got {len(uris)} in {uri!r}")
    return k, m, uris


class ErasureCodedStore(BlockStore):
    def __init__(self, children: Sequence[BlockStore], k: int, m: int, ec_type: str | None = None,
                 straggler_seconds: float = 0.05) -> None:
        from pyeclib.ec_iface import ECDriver, VALID_EC_TYPES  # loads only when an ec: store is chosen

        if len(children) != k + m:
            raise ValueError(f"a {k}+{m} code needs {k + m} child stores, got {len(children)}")
        if not straggler_seconds > 0:
            raise ValueError(f"straggler_seconds must be positive, got {straggler_seconds!r}")
        if ec_type is None:
            ec_type = next((t for t in EC_TYPES if t in VALID_EC_TYPES), None)
            if ec_type is None:
                raise RuntimeError(f"pyeclib offers none of {EC_TYPES} (it offers {VALID_EC_TYPES})")
        self.children, self.k, self.m, self.ec_type = list(children), k, m, ec_type
        self.driver = ECDriver(k=k, m=m, ec_type=ec_type)
        self.straggler_seconds = straggler_seconds
        self._counts = dict(num_hits=0, num_misses=0, num_puts=0, num_evictions=0)
        self.num_child_errors = 0
        self._fragment_size = lru_cache(maxsize=64)(self._measure_fragment)

    @classmethod
    def from_uri(cls, uri: str, registry) -> ErasureCodedStore:
        k, m, uris = parse_uri(uri)
        return cls([registry.open(child) for child in uris], k, m)

    # -- coding ------------------------------------------------------------------------------------------------
    def _measure_fragment(self, payload_len: int) -> int:
        """Framed bytes of one fragment of a `payload_len`-byte block (the same for every block of that size)."""
        return _FRAME.size + len(self.driver.encode(bytes(_BLOCK.size + payload_len))[0])

    def encode(self, payload) -> list[bytes]:
        """The K + M framed fragments of one block."""
        payload = bytes(payload)
        fragments = self.driver.encode(_BLOCK.pack(len(payload), zlib.crc32(payload)) + payload)
        return [_FRAME.pack(_FRAME_MAGIC, zlib.crc32(f)) + f for f in fragments]

    @staticmethod
    def _unframe(framed) -> bytes | None:
        framed = bytes(framed)
        if len(framed) < _FRAME.size:
            return None
        magic, crc = _FRAME.unpack_from(framed)
        fragment = framed[_FRAME.size:]
        return fragment if magic == _FRAME_MAGIC and zlib.crc32(fragment) == crc else None

    def decode(self, fragments: Sequence[bytes], size: int) -> bytes | None:
        """The block from K or more good fragments (unframed), or None when it does not check out."""
        try:
            data = self.driver.decode(list(fragments))
        except Exception as exc:  # noqa: BLE001 - pyeclib raises its own hierarchy for bad fragment sets
            logger.debug("erasure decode failed: %s", exc)
            return None
        if len(data) < _BLOCK.size:
            return None
        length, crc = _BLOCK.unpack_from(data)
        payload = data[_BLOCK.size:]
        return payload if length == len(payload) == size and zlib.crc32(payload) == crc else None

    # -- asking children -------------------------------------------------------------------------------------------
    async def _child(self, call: Callable[[BlockStore], Awaitable], index: int):
        try:
            return await call(self.children[index])
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a child's failure is one lost fragment, never the block's
            self.num_child_errors += 1
            logger.warning("erasure-coded store: child %d failed (%s: %s)", index, type(exc).__name__, exc)
            return None

    async def _ask(self, call, first: Sequence[int], rest: Sequence[int], settled: Callable[[dict, bool], bool]):
        """Ask children `first`; ask `rest` as well once one fails, once every asked child answered without
        `settled`, or once `straggler_seconds` pass with no answer. Returns {child index: answer, None where it
        failed} as of when `settled(answers, timed_out)` held or every asked child answered; the others are
        cancelled."""
        answers: dict[int, object] = {}
        rest, timed_out = list(rest), False
        pending = {asyncio.ensure_future(self._child(call, i)): i for i in first}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, timeout=self.straggler_seconds,
                                             return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    answers[pending.pop(task)] = task.result()
                timed_out = timed_out or not done
                if settled(answers, timed_out):
                    break
                if rest and (timed_out or not pending or None in answers.values()):
                    pending.update({asyncio.ensure_future(self._child(call, i)): i for i in rest})
                    rest = []
        finally:
            for task in pending:
                task.cancel()
        return answers

    # -- the BlockStore interface --------------------------------------------------------------------------------
    async def longest_prefix(self, namespace: str, block_hashes: Sequence[int], pools: Sequence[str]) -> int:
        n = len(self.children)

        def settled(answers: dict, timed_out: bool) -> bool:
            return len(answers) == n or (timed_out and sum(v is not None for v in answers.values()) >= self.k)

        answers = await self._ask(lambda child: child.longest_prefix(namespace, block_hashes, pools),
                                  range(n), (), settled)
        counts = sorted((int(v) for v in answers.values() if v is not None), reverse=True)
        return counts[self.k - 1] if len(counts) >= self.k else 0  # what K children hold

    async def get_many(self, keys: Sequence[BlockKey], buffers) -> list[bool]:
        if not keys:
            return []
        views = [memoryview(b).cast("B") for b in buffers]
        sizes = [self._fragment_size(v.nbytes) for v in views]
        n = len(self.children)

        async def read(child: BlockStore, which: Sequence[int]) -> list[bytes | None]:
            frames = [bytearray(sizes[j]) for j in which]
            found = await child.get_many([keys[j] for j in which], frames)
            got: list[bytes | None] = [None] * len(keys)
            for j, ok, frame in zip(which, found, frames):
                got[j] = self._unframe(frame) if ok else None
            return got

        def settled(answers: dict, timed_out: bool) -> bool:
            for j in range(len(keys)):  # every block decodable, or past saving (fewer than K children could have it)
                good = sum(1 for a in answers.values() if a is not None and a[j] is not None)
                if good < self.k and n - (len(answers) - good) >= self.k:
                    return False
            return True

        every = range(len(keys))
        answers = await self._ask(lambda child: read(child, every), range(self.k + 1), range(self.k + 1, n), settled)
        payloads = [self._decode_from(answers, j, v.nbytes) for j, v in enumerate(views)]
        retry = [j for j, p in enumerate(payloads) if p is None and self._fragments(answers, j)]
        unasked = [i for i in range(n) if i not in answers]
        if retry and unasked:  # K good-looking fragments that do not decode (a stale one): ask the others too
            more = await asyncio.gather(*(self._child(lambda child: read(child, retry), i) for i in unasked))
            answers.update(zip(unasked, more))
            for j in retry:
                payloads[j] = self._decode_from(answers, j, views[j].nbytes)
        for view, payload in zip(views, payloads):
            if payload is not None:
                view[:] = payload
        found = [p is not None for p in payloads]
        self._counts["num_hits"] += sum(found)
        self._counts["num_misses"] += len(found) - sum(found)
        return found

    @staticmethod
    def _fragments(answers: dict, j: int) -> list[bytes]:
        return [a[j] for _, a in sorted(answers.items()) if a is not None and a[j] is not None]

    def _decode_from(self, answers: dict, j: int, size: int) -> bytes | None:
        """Block j from the children's answers: the first K good fragments, or where those do not check out (a
        stale fragment among them, framed right but from another write) other K-subsets of what came back."""
        for subset in itertools.islice(itertools.combinations(self._fragments(answers, j), self.k),
                                       _MAX_DECODE_TRIES):
            payload = self.decode(subset, size)
            if payload is not None:
                return payload
        return None

    async def put_many(self, items, ttl_class: str | None = None) -> int:
        if not items:
            return 0
        encoded = [(key, self.encode(data)) for key, data in items]
        answers = await asyncio.gather(*(
            self._child(lambda child, i=i: child.put_many([(key, frags[i]) for key, frags in encoded], ttl_class), i)
            for i in range(len(self.children))))
        counts = sorted((int(a) if a is not None else 0 for a in answers), reverse=True)
        stored = min(counts[self.k - 1], len(items))  # what K children hold
        self._counts["num_puts"] += stored
        return stored

    async def evict(self, keys: Sequence[BlockKey]) -> int:
        answers = await asyncio.gather(*(self._child(lambda child: child.evict(keys), i)
                                         for i in range(len(self.children))))
        removed = max((int(a) for a in answers if a is not None), default=0)
        self._counts["num_evictions"] += removed
        return removed

    async def stats(self) -> StoreStats:
        """Blocks as the most any child holds fragments of; bytes as every child's fragments together."""
        answers = await asyncio.gather(*(self._child(lambda child: child.stats(), i)
                                         for i in range(len(self.children))))
        got = [a for a in answers if a is not None]
        return StoreStats(max((s.num_blocks for s in got), default=0), sum(s.num_bytes for s in got),
                          num_errors=self.num_child_errors, **self._counts)

    async def close(self) -> None:
        await asyncio.gather(*(self._child(lambda child: child.close(), i) for i in range(len(self.children))))
