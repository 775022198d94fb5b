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
host values. `new_sequence(table, n)` after a prefix hit of n tokens starts from the snapshot of page
table[n / page_size - 1] with n / ratio rows in the shared pages. Only the runner writes; a page's rows are
written once, by the sequence that computed them (a hit starts after them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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


@dataclass
class _HostSnapshot:
    num_tokens: int
    engram_history: list[int]
    index_key_publisher: int | None
    dspark_num_tokens: int


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


def bytes_per_page(owners: dict[str, list], page_size: int) -> int:
    """What a page costs in the pools: the kv sources' rows and index keys, every layer's ring snapshot, the
    ratio-2 sources' open-group snapshots."""
    pools = [_Pools(s, 1, 1, page_size, "meta") for s in owners["layers"] + owners.get("dspark_layers", [])]
    return sum(p.bytes_per_page() for p in pools)


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
        self._host: dict[int, _HostSnapshot] = {}
        self._free_slots = list(range(num_slots))[::-1]

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def new_sequence(self, table: list[int], num_cached_tokens: int = 0) -> tuple[V41SequenceState, int]:
        """A state for a sequence whose pages are `table` (a list the caller keeps extending), its first
        `num_cached_tokens` (a multiple of the page size) served by a prefix hit, and its slot."""
        if not self._free_slots:
            raise RuntimeError(f"all {self.num_slots} V4.1 sequence slots are in use")
        if num_cached_tokens % self.page_size:
            raise ValueError(f"a prefix hit must end on a page boundary, got {num_cached_tokens} tokens")
        page = table[num_cached_tokens // self.page_size - 1] if num_cached_tokens else None
        host = self._host.get(page) if page is not None else None
        if page is not None and (host is None or host.num_tokens != num_cached_tokens):
            raise RuntimeError(f"page {page} holds no V4.1 snapshot at token {num_cached_tokens}")
        slot = self._free_slots.pop()
        state = V41SequenceState([p.state(slot, table, num_cached_tokens) for p in self.layers],
                                 [p.state(slot, table, num_cached_tokens) for p in self.dspark])
        if host is not None:
            for pools, st in zip(self.layers + self.dspark, state.layers + state.dspark):
                pools.restore(st, page)
            state.num_tokens, state.engram_history = host.num_tokens, list(host.engram_history)
            state.index_key_publisher, state.dspark_num_tokens = host.index_key_publisher, host.dspark_num_tokens
        return state, slot

    def snapshot(self, page: int, state: V41SequenceState) -> None:
        """Keep what `state` (a sequence at the end of `page`) holds beyond its rows, for prefix hits on `page`."""
        for pools, st in zip(self.layers + self.dspark, state.layers + state.dspark):
            pools.save(st, page)
        self._host[page] = _HostSnapshot(state.num_tokens, list(state.engram_history), state.index_key_publisher,
                                         state.dspark_num_tokens)

    def snapshot_dspark(self, page: int, state: V41SequenceState) -> None:
        """Update `page`'s snapshot with the DSpark rings, which the drafter seeds after the main forward."""
        for pools, st in zip(self.dspark, state.dspark):
            pools.save(st, page)
        self._host[page].dspark_num_tokens = state.dspark_num_tokens

    def free_sequence(self, slot: int) -> None:
        if slot in self._free_slots or not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} is not in use")
        self._free_slots.append(slot)
