"""SWA bounded replay on V4.1 (issue 22 item 3; V4's is `deepserve/model/swa_replay.py`): rebuild a sequence's
state at a page boundary B from the kv sources' exact compressed rows and index keys of [0, B) (what the pages
hold) and only the last `length` tokens before B, instead of recomputing the prefix.

The replay runs tokens [B - length, B) as one prompt chunk over a state whose window rings start empty at
B - length (`Shared.fresh_window`: no key before the segment is read) and whose kv sources hold the prefix's exact
rows and keys, so that the segment's compressed attention and indexer read what a cold prefill reads (what the
replay itself would emit for them is dropped). Engram's history comes from the token ids, exactly. What is
approximate is every ring at B: a layer's window keys at B depend on the layer below over its window, down to
the first layer, so only `length` >= window x depth gives them exactly (`exact_length`). V4.1's consumer layers
(the ratio-1 Reuse and Reindex layers after the last kv source) own nothing per token but that ring, which is
why a bounded replay of DeepInfer's 128 tokens rebuilds them at a fixed cost.

In the engine: a block store that keeps no window snapshots (`kv_store_snapshots=False`) hands back a prefix's
rows without its last page's snapshot, and `V41ModelRunner.replay_snapshot` rebuilds that snapshot here before
the hit's first step (`swa_replay`: `exact` = `exact_length`, `bounded` = `BOUNDED_LENGTH`). `bench/v41_replay.py`
measures the quality cost and the compute a bounded replay saves.
"""

from __future__ import annotations

import torch

from .state import LayerState, V41SequenceState

BOUNDED_LENGTH = 128


def exact_length(cfg) -> int:
    """Tokens a replay needs for exact rings: the window times the backbone's depth."""
    return cfg.window_size * cfg.n_layers


class _FixedRowsState(LayerState):
    """A kv source's state holding the prefix's exact rows and index keys: the replay's own are dropped."""

    def append_rows(self, rows: torch.Tensor) -> None:
        pass

    def append_index_keys(self, keys: torch.Tensor) -> None:
        pass


@torch.inference_mode()
def replay_state(model, token_ids, boundary: int, length: int, exact: V41SequenceState) -> V41SequenceState:
    """The state at `boundary` rebuilt from the last `length` tokens before it and the kv sources' rows and
    index keys in `exact` (a state at `boundary` or past it: only its first boundary / ratio rows are read).
    `boundary` - `length` must close every ratio-2 group (an even position), as a page boundary does. `exact`'s
    rings are not read (the engine passes `V41PagedStates.prefix_state`, which has none)."""
    ids = list(token_ids[:boundary])
    if len(ids) != boundary:
        raise ValueError(f"a replay to {boundary} needs the {boundary} token ids before it, got {len(ids)}")
    if not 0 < length <= boundary:
        raise ValueError(f"replay length {length} must be in (0, {boundary}]")
    begin = boundary - length
    if begin % 2:
        raise ValueError(f"a replay must start where every ratio-2 group is closed; {begin} is odd")
    state = model.make_state(model.embed.device)
    layers = []
    for st, ex in zip(state.layers, exact.layers):
        if not st.spec.owns_rows:
            layers.append(st)
            continue
        n, rows = boundary // st.spec.ratio, ex.rows  # a paged state gathers its rows at each read: once
        if rows is None or rows.shape[0] < n:
            raise ValueError(f"layer {st.spec.layer}: the exact state holds fewer than the {n} rows before "
                             f"{boundary}")
        keys = ex.index_keys
        layers.append(_FixedRowsState(st.spec, st.ring, rows[:n], keys[:n] if keys is not None else None,
                                      st.kv_open, st.score_open))
    state.layers = layers
    if model.hasher is not None and begin:
        _, state.engram_history = model.hasher.hash([], torch.tensor(ids[:begin]))
    state.num_tokens = begin
    if begin == 0:
        model.forward(ids, state, prompt=True)
    else:
        model.forward(ids[begin:], state, prompt=True, fresh_window=True)
    # the rebuilt state continues as an ordinary one: its rows are the exact ones, growing from here
    for j, st in enumerate(state.layers):
        if isinstance(st, _FixedRowsState):
            state.layers[j] = LayerState(st.spec, st.ring, st.rows.clone(),
                                         st.index_keys.clone() if st.index_keys is not None else None,
                                         st.kv_open, st.score_open)
    return state
