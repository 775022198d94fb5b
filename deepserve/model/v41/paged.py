"""The engine's V4.1 state in pages: what grows with a sequence lives in the KV manager's pages, what is fixed
per sequence in its slot, and each page keeps a boundary snapshot for prefix hits (V4's layout, v41 roles).

Per role (`state.V41LayerStateSpec`):
* kv sources ("Full", ratio 1 or 2): their compressed rows and, for index sources, index keys, `page_size //
  ratio` rows a page (row w, standing for position w * ratio, is in the page of that position), so pages a
  prefix hit shares carry their rows;
* every layer (window-only, Full, Reuse, Reindex, share-index) and every DSpark block: its window ring, per
  slot; a ratio-2 source also its open group (fp32 kv and scores), per slot;
* Engram: the sequence's last max_ngram - 1 normalized ids, and the index-key publisher: host values.

A page's snapshot holds what a sequence had at its end beyond the rows: every ring, the open groups, and the
host values (a row of int64 in host memory: token count, index-key publisher, DSpark count, Engram history).
`new_sequence(table, n)` after a prefix hit of n tokens starts from the snapshot of page table[n / page_size - 1]
with n / ratio rows in the shared pages. Only the runner writes; a page's rows are written once, by the sequence
that computed them (a hit starts after them).

For the cache tiers below the pages (docs/cache.md) every per-page tensor is one of the block stores' pools
(`V41PagedStates.page_pools`): `layers.rows` and `layers.index` (the kv sources' rows and index keys),
`layers.snapshot` and `dspark_layers.snapshot` (rings and open groups at the page's end) and `sequence.snapshot`
(the host values), copied to and from host memory by V4's page copies (`deepserve.model.kv_cache`). A store
that keeps no snapshots (`kv_store_snapshots=False`) holds the first two; the engine then rebuilds a hit's
snapshot by SWA replay (`V41ModelRunner.replay_snapshot`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..kv_cache import pool_page_bytes, read_pool_pages, write_pool_pages
from .state import LayerState, V41LayerStateSpec, V41SequenceState, clone_or_none, copy_into


class PagedLayerState(LayerState):
    """One layer of one sequence over the pools: `ring`, `kv_open`, `score_open` are views of its slot; its
    rows and index keys are read from and appended to the pages of `table` (the runner's list, which grows)."""

    def __init__(self, spec: V41LayerStateSpec, ring, kv_open, score_open, row_pool, key_pool, table: list[int],
                 num_rows: int) -> None:
        super().__init__(spec, ring, None, None, kv_open, score_open)
        self._row_pool, self._key_pool, self._table = row_pool, key_pool, table
        self._table_on_device: torch.Tensor | None = None  # `_where`'s copy of the table
        self.num_rows = num_rows
        self.num_keys = num_rows if key_pool is not None else 0

    def _where(self, first: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(page, row within it) of rows first..first+n, as index tensors where the pool is. The table is
        copied there once per new page (it only grows), not at every read: on a GPU each copy is a host sync."""
        pool = self._row_pool
        per_page = pool.shape[1]
        if self._table_on_device is None or self._table_on_device.shape[0] != len(self._table):
            self._table_on_device = torch.tensor(self._table, dtype=torch.long, device=pool.device)
        rows = torch.arange(first, first + n, device=pool.device)
        return self._table_on_device[rows // per_page], rows % per_page

    @property
    def rows(self) -> torch.Tensor | None:
        if self._row_pool is None:
            return None
        return self._row_pool[self._where(0, self.num_rows)]

    @rows.setter
    def rows(self, value) -> None:  # LayerState's constructor; the pages hold the rows
        if value is not None:
            raise AttributeError("a paged layer state's rows live in its pages: append_rows")

    @property
    def index_keys(self) -> torch.Tensor | None:
        if self._key_pool is None:
            return None
        return self._key_pool[self._where(0, self.num_keys)]

    @index_keys.setter
    def index_keys(self, value) -> None:
        if value is not None:
            raise AttributeError("a paged layer state's index keys live in its pages: append_index_keys")

    def read_rows(self, first: int, n: int) -> torch.Tensor:
        """Rows first..first+n (an SWA host slot packs a partial page's)."""
        return self._row_pool[self._where(first, n)]

    def read_index_keys(self, first: int, n: int) -> torch.Tensor:
        return self._key_pool[self._where(first, n)]

    def save(self) -> tuple:
        return (self.ring.clone(), clone_or_none(self.kv_open), clone_or_none(self.score_open), self.num_rows,
                self.num_keys)

    def load(self, saved: tuple) -> None:
        ring, kv_open, score_open, self.num_rows, self.num_keys = saved  # rows past the counts are dead
        copy_into(self, ring, kv_open, score_open)

    def append_rows(self, rows: torch.Tensor) -> None:
        self._row_pool[self._where(self.num_rows, rows.shape[0])] = rows
        self.num_rows += rows.shape[0]

    def append_index_keys(self, keys: torch.Tensor) -> None:
        self._key_pool[self._where(self.num_keys, keys.shape[0])] = keys
        self.num_keys += keys.shape[0]


class _Pools:
    """One layer's tensors: slot-indexed ring and open group, page-indexed rows, index keys and snapshots."""

    def __init__(self, spec: V41LayerStateSpec, num_slots: int, num_pages: int, page_size: int, device) -> None:
        bf16, f32 = torch.bfloat16, torch.float32
        self.spec = spec
        self.ring = torch.zeros(num_slots, spec.window, spec.width, dtype=bf16, device=device)
        self.ring_snap = torch.zeros(num_pages, spec.window, spec.width, dtype=bf16, device=device)
        self.kv_open = self.score_open = self.open_snap = self.rows = self.keys = None
        if spec.owns_rows:
            if page_size % spec.ratio:
                raise ValueError(f"page_size {page_size} is not a multiple of layer {spec.layer}'s ratio {spec.ratio}")
            self.rows = torch.zeros(num_pages, page_size // spec.ratio, spec.width, dtype=bf16, device=device)
            if spec.index_width:
                self.keys = torch.zeros(num_pages, page_size // spec.ratio, spec.index_width, dtype=bf16,
                                        device=device)
            if spec.ratio > 1:
                self.kv_open = torch.zeros(num_slots, spec.ratio, spec.width, dtype=f32, device=device)
                self.score_open = torch.zeros(num_slots, spec.ratio, spec.width, dtype=f32, device=device)
                self.open_snap = torch.zeros(num_pages, 2, spec.ratio, spec.width, dtype=f32, device=device)

    def state(self, slot: int, table: list[int], num_tokens: int) -> PagedLayerState:
        if self.score_open is not None:
            self.score_open[slot] = -torch.inf
        kv_open = self.kv_open[slot] if self.kv_open is not None else None
        score_open = self.score_open[slot] if self.score_open is not None else None
        num_rows = num_tokens // self.spec.ratio if self.spec.owns_rows else 0
        return PagedLayerState(self.spec, self.ring[slot], kv_open, score_open, self.rows, self.keys, table,
                               num_rows)

    def save(self, st: PagedLayerState, page: int) -> None:
        self.ring_snap[page] = st.ring
        if self.open_snap is not None:
            self.open_snap[page, 0], self.open_snap[page, 1] = st.kv_open, st.score_open

    def restore(self, st: PagedLayerState, page: int) -> None:
        st.ring.copy_(self.ring_snap[page])
        if self.open_snap is not None:
            st.kv_open.copy_(self.open_snap[page, 0])
            st.score_open.copy_(self.open_snap[page, 1])

    def bytes_per_page(self) -> int:
        tensors = (self.ring_snap, self.rows, self.keys, self.open_snap)
        return sum(t[0].numel() * t.element_size() for t in tensors if t is not None)

    def page_tensors(self, pool: str) -> list[torch.Tensor]:
        """This layer's tensors in the block stores' pool `pool` (`rows`, `index` or `snapshot`)."""
        tensors = {"rows": [self.rows], "index": [self.keys], "snapshot": [self.ring_snap, self.open_snap]}[pool]
        return [t for t in tensors if t is not None]


def bytes_per_page(owners: dict[str, list], page_size: int) -> int:
    """What a page costs in the pools: the kv sources' rows and index keys, every layer's ring snapshot, the
    ratio-2 sources' open-group snapshots."""
    pools = [_Pools(s, 1, 1, page_size, "meta") for s in owners["layers"] + owners.get("dspark_layers", [])]
    return sum(p.bytes_per_page() for p in pools)


# columns of `V41PagedStates.host_snap`
_HOST_NUM_TOKENS, _HOST_PUBLISHER, _HOST_DSPARK_NUM_TOKENS, _HOST_HISTORY_LEN, _HOST_HISTORY = range(5)


class V41PagedStates:
    """The runner's V4.1 sequences: `num_slots` slots and `num_pages` pages of `page_size` tokens (the KV
    manager's page ids), every role's tensors allocated once (`_Pools`)."""

    def __init__(self, owners: dict[str, list], num_slots: int, num_pages: int, page_size: int,
                 device="cpu") -> None:
        if num_slots < 1 or num_pages < 1:
            raise ValueError(f"V4.1 states need a slot and a page at least (got {num_slots}, {num_pages})")
        self.page_size, self.num_slots, self.num_pages = page_size, num_slots, num_pages
        self.layers = [_Pools(s, num_slots, num_pages, page_size, device) for s in owners["layers"]]
        self.dspark = [_Pools(s, num_slots, num_pages, page_size, device) for s in owners.get("dspark_layers", [])]
        self.history_size = sum(s.history for s in owners.get("engram", []))
        # per page, the snapshot's host values (`_HOST_*` columns, then the Engram history); -1: none taken
        self.host_snap = torch.full((num_pages, _HOST_HISTORY + self.history_size), -1, dtype=torch.int64)
        self._free_slots = list(range(num_slots))[::-1]

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def new_sequence(self, table: list[int], num_cached_tokens: int = 0,
                     from_snapshot: bool = True) -> tuple[V41SequenceState, int]:
        """A state for a sequence whose pages are `table` (a list the caller keeps extending), its first
        `num_cached_tokens` (a multiple of the page size) served by a prefix hit, and its slot. Without
        `from_snapshot` the state has the pages' rows only and the caller sets everything a snapshot holds (an
        SWA host slot's restore, `swa_slots.py`, which holds all of it)."""
        if not self._free_slots:
            raise RuntimeError(f"all {self.num_slots} V4.1 sequence slots are in use")
        if num_cached_tokens % self.page_size:
            raise ValueError(f"a prefix hit must end on a page boundary, got {num_cached_tokens} tokens")
        page = table[num_cached_tokens // self.page_size - 1] if num_cached_tokens and from_snapshot else None
        host = self.host_snap[page].tolist() if page is not None else None
        if host is not None and host[_HOST_NUM_TOKENS] != num_cached_tokens:
            raise RuntimeError(f"page {page} holds no V4.1 snapshot at token {num_cached_tokens}")
        slot = self._free_slots.pop()
        state = V41SequenceState([p.state(slot, table, num_cached_tokens) for p in self.layers],
                                 [p.state(slot, table, num_cached_tokens) for p in self.dspark])
        if host is not None:
            for pools, st in zip(self.layers + self.dspark, state.layers + state.dspark):
                pools.restore(st, page)
            publisher = host[_HOST_PUBLISHER]
            state.num_tokens, state.dspark_num_tokens = num_cached_tokens, host[_HOST_DSPARK_NUM_TOKENS]
            state.index_key_publisher = None if publisher < 0 else publisher
            state.engram_history = host[_HOST_HISTORY : _HOST_HISTORY + host[_HOST_HISTORY_LEN]]
        return state, slot

    def prefix_state(self, table: list[int], num_tokens: int) -> V41SequenceState:
        """The kv sources' rows and index keys that the pages of `table` hold for the first `num_tokens` tokens,
        as a state without a slot (no rings, no open groups): what `replay.replay_state` reads."""
        return V41SequenceState([PagedLayerState(p.spec, None, None, None, p.rows, p.keys, list(table),
                                                 num_tokens // p.spec.ratio if p.spec.owns_rows else 0)
                                 for p in self.layers], [])

    def snapshot(self, page: int, state: V41SequenceState) -> None:
        """Keep what `state` (a sequence at the end of `page`) holds beyond its rows, for prefix hits on `page`."""
        for pools, st in zip(self.layers + self.dspark, state.layers + state.dspark):
            pools.save(st, page)
        history = state.engram_history
        if len(history) > self.history_size:
            raise ValueError(f"an Engram history of {len(history)} ids; the snapshot keeps {self.history_size}")
        publisher = state.index_key_publisher
        row = [state.num_tokens, -1 if publisher is None else publisher, state.dspark_num_tokens, len(history)]
        self.host_snap[page] = torch.tensor(row + history + [-1] * (self.history_size - len(history)))

    def snapshot_dspark(self, page: int, state: V41SequenceState) -> None:
        """Update `page`'s snapshot with the DSpark rings, which the drafter seeds after the main forward."""
        for pools, st in zip(self.dspark, state.dspark):
            pools.save(st, page)
        self.host_snap[page, _HOST_DSPARK_NUM_TOKENS] = state.dspark_num_tokens

    def free_sequence(self, slot: int) -> None:
        if slot in self._free_slots or not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} is not in use")
        self._free_slots.append(slot)

    def page_pools(self) -> dict[str, list[torch.Tensor]]:
        """What one page holds, as the block stores' pools: name -> the tensors indexed by page on their first
        axis, in layer order (the module docstring names them)."""
        pools: dict[str, list[torch.Tensor]] = {}
        for owner, layers in (("layers", self.layers), ("dspark_layers", self.dspark)):
            for name in ("rows", "index", "snapshot"):
                tensors = [t for p in layers for t in p.page_tensors(name)]
                if tensors:
                    pools[f"{owner}.{name}"] = tensors
        pools["sequence.snapshot"] = [self.host_snap]
        return pools


# the cache tiers' page copies (`deepserve.build` wires them as the engine's `PageIO`)
def page_pool_bytes(states: V41PagedStates) -> dict[str, int]:
    return pool_page_bytes(states.page_pools())


def read_pages(states: V41PagedStates, pages: Sequence[int]) -> list[dict[str, bytes]]:
    return read_pool_pages(states.page_pools(), pages)


def write_pages(states: V41PagedStates, pages: Sequence[int], blocks: Sequence[dict[str, bytes]]) -> None:
    write_pool_pages(states.page_pools(), pages, blocks)
