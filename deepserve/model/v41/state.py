"""What V4.1 keeps per sequence, by state owner (v41-architecture.md §7.1).

Only the kv sources grow per token (their compressed rows and index keys, and a ratio-2 source's open group);
every other layer owns nothing per token but its window ring, and reads its source's rows. Engram keeps the
last max_ngram-1 normalized token ids. The DSpark blocks own rings of main keys. The specs say what a cache must
allocate; `contiguous_state` builds self-contained storage (tests, one-off runs); `paged.py` keeps the engine's
sequences in pages.
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

    # a layer state's interface to the attention (`paged.PagedLayerState` keeps the same one over pages):
    # `ring`, `kv_open`, `score_open` are written in place; `rows` and `index_keys` read the rows so far
    def append_rows(self, rows: torch.Tensor) -> None:
        self.rows = torch.cat([self.rows, rows])

    def append_index_keys(self, keys: torch.Tensor) -> None:
        self.index_keys = torch.cat([self.index_keys, keys])

    def save(self) -> tuple:
        """What `load` puts back: copies of what changes in place; the rows so far (they only grow by
        concatenation, so the tensors themselves stay as they are)."""
        return (self.ring.clone(), clone_or_none(self.kv_open), clone_or_none(self.score_open), self.rows,
                self.index_keys)

    def load(self, saved: tuple) -> None:
        ring, kv_open, score_open, self.rows, self.index_keys = saved
        copy_into(self, ring, kv_open, score_open)


def clone_or_none(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.clone()


def copy_into(st: LayerState, ring, kv_open, score_open) -> None:
    st.ring.copy_(ring)
    if kv_open is not None:
        st.kv_open.copy_(kv_open)
        st.score_open.copy_(score_open)


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

    def save(self) -> tuple:
        """The whole state as it is now, for `load` (a speculative pass's rollback)."""
        return ([s.save() for s in self.layers], [s.save() for s in self.dspark], list(self.engram_history),
                self.num_tokens, self.dspark_num_tokens, self.index_key_publisher)

    def load(self, saved: tuple) -> None:
        layers, dspark, history, self.num_tokens, self.dspark_num_tokens, self.index_key_publisher = saved
        self.engram_history = list(history)
        for st, s in zip(self.layers + self.dspark, layers + dspark):
            st.load(s)


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

