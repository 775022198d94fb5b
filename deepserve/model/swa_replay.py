"""SWA replay: rebuild a page's boundary snapshot (every layer's window tail and CSA overlap state at the page's
end) from its compressed rows and the last tokens before the boundary, when the snapshot itself is not there.

A replay of the `length` tokens [B - length, B) before boundary B runs them through the model on throwaway
contiguous states: each layer's compressed rows (main and indexer) are the exact rows the cached pages hold for
[0, B) (what the replay emits for them is dropped), and its sliding window starts empty at B - length: window
keys before the segment are masked out, so the segment attends within itself for its window and to the whole
prefix for its compressed rows. The replayed window tail and overlap halves at B are written as the page's
snapshot, which a prefix hit at B then restores as usual.

- `exact_length(cache)` = window x depth: a layer's window rows at B depend on the layer below at the window
  before, down to the first layer, so a segment that long gives the exact snapshot (up to float rounding).
- `BOUNDED_LENGTH` = 128: DeepInfer's bounded replay, a fixed cost, approximate where window x depth is longer.

`bench/swa_replay.py` measures what bounded costs in logprobs and greedy agreement and what it saves.
"""

from __future__ import annotations

import torch

from .batch import make_batch
from .kv_cache import PagedKVCache
from .layouts.contiguous import ContiguousLayer, ContiguousStep
from .state import AttentionState, CompressorState, SequenceState, WindowRing

BOUNDED_LENGTH = 128


def exact_length(cache: PagedKVCache) -> int:
    """Tokens a replay needs for the exact snapshot: the window times the main layers' depth."""
    return max(layer.spec.window for layer in cache.layers) * len(cache.layers)


class _FixedRows:
    """A row store holding the exact rows of the prefix: what the replay emits is dropped (its first block would
    be pooled with an unknown overlap half), queries see the rows their position allows."""

    __slots__ = ("rows", "num_rows")

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows, self.num_rows = rows, rows.shape[0]

    def view(self) -> torch.Tensor:
        return self.rows

    def append(self, rows: torch.Tensor) -> None:
        pass

    def truncate(self, num_rows: int) -> None:
        pass


class _SegmentLayer(ContiguousLayer):
    """The contiguous layout with every window key before `floor` masked (-1): the segment's window is its own."""

    def __init__(self, batch, backend, states, floor: int) -> None:
        super().__init__(batch, backend, states)
        self.floor = floor

    def keys(self, kv, compressed):
        pool, indices = super().keys(kv, compressed)
        W = self.window
        key_pos = self.positions[:, None] - W + 1 + torch.arange(W, device=indices.device)[None, :]
        indices[:, :W] = torch.where(key_pos < self.floor, torch.full_like(key_pos, -1), indices[:, :W])
        return pool, indices


class _SegmentStep(ContiguousStep):
    def __init__(self, batch, layer_states, backend, floor: int) -> None:
        super().__init__(batch, layer_states, backend)
        self.floor = floor

    def layer(self, index: int) -> _SegmentLayer:
        return _SegmentLayer(self.batch, self.backend, [states[index] for states in self.layer_states], self.floor)


def _prefix_rows(pools, table: list[int], num_pages: int) -> torch.Tensor:
    pages = torch.tensor(table[:num_pages], dtype=torch.long, device=pools.rows.device)
    return pools.codec.decode(pools.rows.index_select(0, pages)).reshape(-1, pools.spec.dim)


@torch.inference_mode()
def replay_snapshot(cache: PagedKVCache, table: list[int], boundary: int, token_ids, length: int) -> int:
    """Rebuild the snapshot of page `table[boundary / P - 1]` by recomputing the `length` tokens before `boundary`
    (fewer where the sequence is shorter) over the compressed rows the pages of `table` hold. `token_ids`: the
    sequence's tokens, at least `boundary` of them. Returns how many tokens it computed. The main layers only
    (a drafter's state owner is not replayed)."""
    P = cache.page_size
    if boundary <= 0 or boundary % P or len(table) < boundary // P or len(token_ids) < boundary:
        raise ValueError(f"cannot replay to boundary {boundary} with {len(table)} pages and {len(token_ids)} tokens")
    if length < 1:
        raise ValueError(f"a replay needs at least one token, got length {length}")
    start = max(0, boundary - length)
    model, layers = cache.model, cache.layers
    states = []
    for layer in layers:
        spec = layer.spec
        ring = torch.zeros((spec.window, spec.width), dtype=layer.dtype, device=layer.storage.device)

        def stream(pools):
            if pools is None:
                return None
            s, f32 = pools.spec, dict(dtype=torch.float32, device=ring.device)
            overlap = (lambda: torch.zeros((s.ratio, s.dim), **f32)) if s.overlap else (lambda: None)
            return CompressorState(_FixedRows(_prefix_rows(pools, table, boundary // P)),
                                   torch.zeros((s.ratio, s.frontier_width), **f32),
                                   torch.zeros((s.ratio, s.frontier_width), **f32), overlap(), overlap())

        states.append(AttentionState(WindowRing(ring), stream(layer.compressor), stream(layer.indexer)))
    batch = make_batch([list(token_ids[start:boundary])], [start], ring.device)
    seq = SequenceState(layers=states, num_tokens=start)
    model(batch, [seq], layout=_SegmentStep(batch, [states], model.backend, start))
    page = table[boundary // P - 1]
    for layer, st in zip(layers, states):
        layer.snap_window[page] = layer.codec.encode(st.window.read(boundary - layer.spec.window, boundary))
        for pools, comp in ((layer.compressor, st.compressor), (layer.indexer, st.indexer)):
            if pools is not None and pools.spec.overlap:
                pools.snap_kv[page] = comp.prev_kv
                pools.snap_gate[page] = comp.prev_gate
    return boundary - start
