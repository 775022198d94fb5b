"""SWA host slots: a finished sequence's state past its last full page, kept in host memory for its next turn.

A page snapshot restores a sequence at a page boundary B; a sequence that ends at n tokens (B < n < B + P) also
holds, for every layer, its window ring at n, its compressors' frontiers (the open block and CSA's overlap half)
and the compressed rows of its partial page. The model side packs exactly that into one fixed-size payload
(MXFP8: `deepserve.model.swa_slots`), sized from the model's declared state; here it lives in one slot of a
`SlotPool` (a fixed number of fixed-size slots in one host buffer, least recently used reused first), and a
`SessionDirectory` says which (node, slot) holds which session's state. The next turn of the conversation, whose
prompt begins with the n tokens, takes the prefix's full pages from the cache (any tier) and the rest from the
slot instead of recomputing its tail.

A session's key is the request's `session_id` (the `conversation` field of the OpenAI Responses API means the
same), else the sequence itself: the chained hash of its last full page and its tail's tokens, found by walking a
new prompt's page boundaries. Each entry carries a CRC-32 of its payload and the layout it was packed with; a
payload that fails either is a miss (and its slot is freed), never a failed request.

Plain Python, no torch.
"""

from __future__ import annotations

import hashlib
import threading
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from deepserve.core.kv.prefix_hash import BlockHash, block_hashes


@dataclass(frozen=True, slots=True)
class SlotLocation:
    """Where a session's window state is: the engine (`node`) and the slot in its pool. What a router asks."""

    node: str
    slot: int
    num_tokens: int  # the sequence length the state is at


@dataclass(frozen=True, slots=True)
class SlotEntry:
    """One saved state: the session `key`, its `location`, the sequence it continues (the chained hash `base` of
    its last full page, or None when it has none, and the `tail` tokens after it), the payload's CRC-32 and the
    layout digest it was packed with."""

    key: str
    location: SlotLocation
    base: BlockHash | None
    tail: tuple[int, ...]
    cache_salt: str | None
    crc: int
    layout: str


@dataclass(frozen=True, slots=True)
class Resume:
    """A restore to do: the request continues a saved sequence of `num_tokens` tokens, whose first `base_tokens`
    (a multiple of the page size) come from cached pages and the rest from `payload`."""

    key: str
    base_tokens: int
    num_tokens: int
    payload: bytes


@dataclass(slots=True)
class SlotStats:
    num_saved: int = 0
    num_restored: int = 0  # lookups that found a slot (the request may still not use it: see Resume)
    num_evicted: int = 0  # slots reused for another session while theirs was unread
    num_corrupt: int = 0  # payloads that failed their CRC or layout check (misses)
    num_misses: int = 0  # lookups that found nothing
    num_applied: int = 0  # found slots the request's first step restored (`record_restore`)
    num_unused: int = 0  # found slots it could not use: its prefix hit was not exactly the slot's base pages


@dataclass(frozen=True, slots=True)
class SlotSnapshot:
    """The slots' counters and the pool's size at one moment, as a value (what `/metrics` reads)."""

    num_saves: int
    num_restores: int  # states restored into a request (its tail not recomputed)
    num_misses: int  # lookups with no usable slot: none found, a payload that failed its checks, or not usable
    num_corrupt: int
    num_evictions: int
    num_slots: int
    num_slots_used: int
    slot_bytes: int


class SlotPool:
    """`num_slots` slots of `slot_bytes` each in one host buffer. `take` hands out a free slot, else the least
    recently used one (whose previous owner the caller forgets). Not thread-safe alone: `SWASlots` locks it."""

    def __init__(self, num_slots: int, slot_bytes: int) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"swa_host_slots must be a positive integer, got {num_slots!r}")
        if slot_bytes < 1:
            raise ValueError(f"an SWA slot needs a positive size, got {slot_bytes} bytes")
        self.num_slots, self.slot_bytes = num_slots, slot_bytes
        self.buffer = bytearray(num_slots * slot_bytes)
        self._free = list(range(num_slots - 1, -1, -1))
        self._used: OrderedDict[int, str] = OrderedDict()  # slot -> owner key, least recently used first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, key: str) -> tuple[int, str | None]:
        """A slot for `key`: (slot, the key it is taken from, or None when it was free)."""
        if self._free:
            slot, evicted = self._free.pop(), None
        else:
            slot, evicted = self._used.popitem(last=False)
        self._used[slot] = key
        return slot, evicted

    def touch(self, slot: int) -> None:
        self._used.move_to_end(slot)

    def free(self, slot: int) -> None:
        if self._used.pop(slot, None) is not None:
            self._free.append(slot)

    def write(self, slot: int, payload: bytes) -> None:
        if len(payload) != self.slot_bytes:
            raise ValueError(f"an SWA slot holds {self.slot_bytes} bytes, got a payload of {len(payload)}")
        self.buffer[slot * self.slot_bytes:(slot + 1) * self.slot_bytes] = payload

    def read(self, slot: int) -> bytes:
        return bytes(self.buffer[slot * self.slot_bytes:(slot + 1) * self.slot_bytes])

    def order(self) -> list[int]:
        """Slots in use, least recently used first (the order they are reused in)."""
        return list(self._used)


class SessionDirectory:
    """Session key -> its `SlotEntry`, plus an index by base hash for sessions found by their tokens. The
    interface a router queries (`locate`); one engine's directory here (a router over several engines keeps the
    union of their entries, each tagged with its node)."""

    def __init__(self) -> None:
        self._entries: dict[str, SlotEntry] = {}
        self._by_base: dict[tuple[BlockHash | None, str | None], set[str]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> SlotEntry | None:
        return self._entries.get(key)

    def locate(self, key: str) -> SlotLocation | None:
        """Where session `key`'s window state is (None: nowhere known)."""
        entry = self._entries.get(key)
        return entry.location if entry is not None else None

    def put(self, entry: SlotEntry) -> None:
        self.remove(entry.key)
        self._entries[entry.key] = entry
        self._by_base.setdefault((entry.base, entry.cache_salt), set()).add(entry.key)

    def remove(self, key: str) -> SlotEntry | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            keys = self._by_base.get((entry.base, entry.cache_salt), set())
            keys.discard(key)
            if not keys:
                self._by_base.pop((entry.base, entry.cache_salt), None)
        return entry

    def continued_by(self, base: BlockHash | None, cache_salt: str | None, rest: Sequence[int]) -> SlotEntry | None:
        """The longest entry under `base` whose tail `rest` (the prompt's tokens after that page) begins with,
        leaving at least one token after it."""
        best = None
        for key in self._by_base.get((base, cache_salt), ()):
            entry = self._entries[key]
            n = len(entry.tail)
            if n < len(rest) and tuple(rest[:n]) == entry.tail and (best is None or n > len(best.tail)):
                best = entry
        return best


def sequence_key(base: BlockHash | None, tail: Sequence[int], cache_salt: str | None) -> str:
    """The session key of a sequence without a `session_id`: sha256 of its last full page's chained hash (which
    carries the salt) and its tail's tokens."""
    h = hashlib.sha256(base if base is not None else (cache_salt or "").encode())
    h.update(b"".join(t.to_bytes(4, "little") for t in tail))
    return "seq:" + h.hexdigest()


class SWASlots:
    """One engine's SWA host slots: the pool, the directory, and the checks. Thread-safe (the runner's thread
    saves, the engine's thread looks up)."""

    def __init__(self, num_slots: int, slot_bytes: int, page_size: int, layout: str, node: str) -> None:
        self.pool = SlotPool(num_slots, slot_bytes)
        self.directory = SessionDirectory()
        self.page_size, self.layout, self.node = page_size, layout, node
        self.stats = SlotStats()
        self._lock = threading.Lock()

    def save(self, session_id: str | None, token_ids: Sequence[int], cache_salt: str | None,
             payload: bytes, replaces: str | None = None) -> SlotEntry | None:
        """Keep `payload`, the state after `token_ids`, for the session (`session_id`, else the sequence's own
        key). Nothing to keep (None) when the sequence ends on a page boundary: its last page's snapshot holds it.
        `replaces`: the key of the slot this sequence was restored from, freed now (the conversation moved on)."""
        P = self.page_size
        n = len(token_ids)
        base_tokens = n // P * P
        if n == base_tokens:
            return None
        base = block_hashes(token_ids[:base_tokens], P, cache_salt)[-1] if base_tokens else None
        tail = tuple(token_ids[base_tokens:])
        key = session_id if session_id is not None else sequence_key(base, tail, cache_salt)
        with self._lock:
            for stale in {key, replaces} - {None}:
                old = self.directory.remove(stale)
                if old is not None:
                    self.pool.free(old.location.slot)
            slot, evicted = self.pool.take(key)
            if evicted is not None:
                self.directory.remove(evicted)
                self.stats.num_evicted += 1
            self.pool.write(slot, payload)
            entry = SlotEntry(key, SlotLocation(self.node, slot, n), base, tail, cache_salt,
                              zlib.crc32(payload), self.layout)
            self.directory.put(entry)
            self.stats.num_saved += 1
        return entry

    def record_restore(self, applied: bool) -> None:
        """Count a found slot as restored into its request (`applied`) or not usable after all."""
        with self._lock:
            if applied:
                self.stats.num_applied += 1
            else:
                self.stats.num_unused += 1

    def snapshot(self) -> SlotSnapshot:
        with self._lock:
            st = self.stats
            return SlotSnapshot(st.num_saved, st.num_applied, st.num_misses + st.num_corrupt + st.num_unused,
                                st.num_corrupt, st.num_evicted, self.pool.num_slots,
                                self.pool.num_slots - self.pool.num_free, self.pool.slot_bytes)

    def find(self, session_id: str | None, prompt_token_ids: Sequence[int], cache_salt: str | None) -> Resume | None:
        """The saved state the prompt continues (its session's, or else the longest sequence it begins with),
        with a copy of the payload; None when there is none, the prompt does not continue it, or the payload fails
        its checks (then the slot is freed)."""
        P = self.page_size
        with self._lock:
            entry = self._match(session_id, prompt_token_ids, cache_salt)
            if entry is None:
                self.stats.num_misses += 1
                return None
            payload = self.pool.read(entry.location.slot)
            if zlib.crc32(payload) != entry.crc or entry.layout != self.layout:
                self.stats.num_corrupt += 1
                self.directory.remove(entry.key)
                self.pool.free(entry.location.slot)
                return None
            self.pool.touch(entry.location.slot)
            self.stats.num_restored += 1
        n = entry.location.num_tokens
        return Resume(entry.key, n // P * P, n, payload)

    def _match(self, session_id, prompt, cache_salt) -> SlotEntry | None:
        P = self.page_size
        if session_id is not None:
            entry = self.directory.get(session_id)
            if entry is None or entry.cache_salt != cache_salt:
                return None
            n = entry.location.num_tokens
            base_tokens = n // P * P
            if n >= len(prompt) or tuple(prompt[base_tokens:n]) != entry.tail:
                return None
            base = block_hashes(prompt[:base_tokens], P, cache_salt)[-1] if base_tokens else None
            return entry if base == entry.base else None
        hashes = block_hashes(prompt[:(len(prompt) - 1) // P * P], P, cache_salt)
        for num_pages in range(len(hashes), -1, -1):  # the longest continued sequence first
            base = hashes[num_pages - 1] if num_pages else None
            entry = self.directory.continued_by(base, cache_salt, prompt[num_pages * P:])
            if entry is not None:
                return entry
        return None
