"""What V4.1 keeps per sequence, by state owner (v41-architecture.md §7.1).

Only the kv sources grow per token (their compressed rows and index keys, and a ratio-2 source's open group);
every other layer owns nothing per token but its window ring, and reads its source's rows. Engram keeps the
last max_ngram-1 normalized token ids. The DSpark blocks own rings of main keys. The specs say what a cache must
allocate; `contiguous_state` builds self-contained storage (tests, one-off runs; the paged cache comes next).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .config import V41Config


@dataclass(frozen=True)
class V41LayerStateSpec:
    """One layer's per-sequence state. `role`: window, full (kv source), reuse, reindex, dspark."""

    layer: int
    role: str
    ratio: int
    window: int
    width: int  # bf16 key width (head_dim)
    kv_source: int | None  # the layer whose compressed rows this one reads (itself for a kv source)
    index_source: int | None  # the layer whose top-k this one uses
    owns_rows: bool  # appends compressed rows (kv sources)
    index_width: int  # index-key width a kv source appends (0: none)
    frontier: int  # tokens of an open compression group held in fp32 (ratio - 1 at most; 0 for ratio 1)
    candidate_source: bool = False

    def bytes_per_token(self) -> float:
        """Stored bytes per sequence token at bf16 (rows appear every `ratio` tokens)."""
        if not self.owns_rows:
            return 0.0
        return 2 * (self.width + self.index_width) / self.ratio


@dataclass(frozen=True)
class EngramStateSpec:
    history: int  # normalized token ids kept (max_ngram - 1)


def layer_specs(cfg: V41Config) -> list[V41LayerStateSpec]:
    out = []
    for j in range(cfg.n_layers):
        r = cfg.compress_ratios[j]
        kv = cfg.kv_source_of(j) if r else None
        owns = j in cfg.kv_source_layers
        out.append(V41LayerStateSpec(
            layer=j, role=cfg.role(j), ratio=r, window=cfg.window_size, width=cfg.head_dim, kv_source=kv,
            index_source=cfg.index_source_of(j) if r else None, owns_rows=owns,
            index_width=cfg.index_head_dim if owns and j in cfg.index_source_layers else 0,
            frontier=r - 1 if owns and r > 1 else 0, candidate_source=j == cfg.candidate_source_layer))
    return out


def dspark_specs(cfg: V41Config) -> list[V41LayerStateSpec]:
    return [V41LayerStateSpec(layer=cfg.n_layers + i, role="dspark", ratio=0, window=cfg.window_size,
                              width=cfg.head_dim, kv_source=None, index_source=None, owns_rows=False,
                              index_width=0, frontier=0) for i in range(cfg.n_mtp_layers)]


@dataclass
class LayerState:
    """Contiguous storage of one layer for one sequence. The ring holds slot = position % window."""

    spec: V41LayerStateSpec
    ring: torch.Tensor
    rows: torch.Tensor | None = None  # [n, width] bf16: compressed rows (RoPE'd, FP4 values)
    index_keys: torch.Tensor | None = None  # [n, index_width] bf16 (FP4 values)
    kv_open: torch.Tensor | None = None  # [ratio, width] fp32: the open group's projected kv
    score_open: torch.Tensor | None = None  # [ratio, width] fp32: its gate scores (-inf when empty)


@dataclass
class V41SequenceState:
    layers: list[LayerState]
    dspark: list[LayerState]
    engram_history: list[int] = field(default_factory=list)
    num_tokens: int = 0  # backbone tokens processed
    dspark_num_tokens: int = 0  # main positions whose keys the DSpark rings hold
    # The reference publishes index keys through one shared slot that only a kv source with a new row
    # overwrites, so an index source whose own group is still open scores against the keys published last
    # (docs/v41.md, "reference semantics"). The layer that published last is part of the sequence's state.
    index_key_publisher: int | None = None


def _layer_state(spec: V41LayerStateSpec, device) -> LayerState:
    st = LayerState(spec, torch.zeros(spec.window, spec.width, dtype=torch.bfloat16, device=device))
    if spec.owns_rows:
        st.rows = torch.zeros(0, spec.width, dtype=torch.bfloat16, device=device)
        if spec.index_width:
            st.index_keys = torch.zeros(0, spec.index_width, dtype=torch.bfloat16, device=device)
        if spec.ratio > 1:
            st.kv_open = torch.zeros(spec.ratio, spec.width, dtype=torch.float32, device=device)
            st.score_open = torch.full((spec.ratio, spec.width), -torch.inf, dtype=torch.float32, device=device)
    return st


def contiguous_state(owners: dict[str, list], device="cpu") -> V41SequenceState:
    """A fresh self-contained state for one sequence from the model's `state_owners()`."""
    return V41SequenceState(layers=[_layer_state(s, device) for s in owners["layers"]],
                            dspark=[_layer_state(s, device) for s in owners.get("dspark_layers", [])])


def _copy_layer(st: LayerState) -> LayerState:
    """A copy that later forwards of `st`'s sequence cannot change: compressed rows and index keys only ever
    grow by concatenation (a new tensor), so they are shared; the ring and the open group change in place."""
    clone = (lambda t: None if t is None else t.clone())
    return LayerState(st.spec, st.ring.clone(), st.rows, st.index_keys, clone(st.kv_open), clone(st.score_open))


def copy_state(state: V41SequenceState) -> V41SequenceState:
    """An independent copy of a sequence's state (a prefix-cache snapshot, or a sequence restored from one)."""
    return V41SequenceState([_copy_layer(s) for s in state.layers], [_copy_layer(s) for s in state.dspark],
                            list(state.engram_history), state.num_tokens, state.dspark_num_tokens,
                            state.index_key_publisher)


class V41StatePool:
    """The engine runner's V4.1 sequence states: a slot per running sequence (`max_num_seqs`), each with its own
    contiguous state, and page-boundary snapshots for prefix caching.

    The KV manager's pages account for the tokens and carry the prefix hashes; the state itself is contiguous
    per sequence (the paged layout of every role comes next). `snapshot(page, state)` keeps the state a
    sequence had at the end of `page` (the runner stops a forward at each boundary the engine asks for);
    `new_sequence(table, num_cached_tokens)` starts a sequence from the snapshot of the last hit page. A page's
    snapshot is replaced when the page is snapshotted again (the manager reuses a page only after evicting its
    hash, so an older snapshot is never restored for other tokens)."""

    def __init__(self, owners: dict[str, list], num_slots: int, page_size: int, device="cpu") -> None:
        if num_slots < 1 or page_size < 1:
            raise ValueError(f"a state pool needs at least one slot and page_size >= 1 ({num_slots}, {page_size})")
        self.owners, self.num_slots, self.page_size, self.device = owners, num_slots, page_size, device
        self._free_slots = list(range(num_slots))[::-1]
        self._snapshots: dict[int, V41SequenceState] = {}

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def new_sequence(self, table: list[int], num_cached_tokens: int = 0) -> tuple[V41SequenceState, int]:
        """A state for a sequence whose pages are `table`, its first `num_cached_tokens` (a multiple of the page
        size) served by a prefix hit, and its slot."""
        if not self._free_slots:
            raise RuntimeError(f"all {self.num_slots} V4.1 sequence slots are in use")
        if num_cached_tokens % self.page_size:
            raise ValueError(f"a prefix hit must end on a page boundary, got {num_cached_tokens} tokens")
        if num_cached_tokens:
            page = table[num_cached_tokens // self.page_size - 1]
            saved = self._snapshots.get(page)
            if saved is None or saved.num_tokens != num_cached_tokens:
                raise RuntimeError(f"page {page} holds no V4.1 state snapshot at token {num_cached_tokens}")
            state = copy_state(saved)
        else:
            state = contiguous_state(self.owners, self.device)
        return state, self._free_slots.pop()

    def snapshot(self, page: int, state: V41SequenceState) -> None:
        """Keep `state` (a sequence at the end of `page`) for prefix hits on `page`."""
        self._snapshots[page] = copy_state(state)

    def free_sequence(self, slot: int) -> None:
        if slot in self._free_slots or not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} is not in use")
        self._free_slots.append(slot)
