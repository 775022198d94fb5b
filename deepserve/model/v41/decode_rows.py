"""The rows of one batched decode forward (`DeepseekV41ForCausalLM.forward_decode`), where a sequence may have
several consecutive rows: a verifying chunk [token, drafts...] in one forward, each row with the bits of its own
one-token decode step after the rows before it.

The forward runs layer by layer, and inside a layer each sequence's attention row by row, in order; a layer's
state (ring, open group, rows, index keys) then sees row i after rows 0..i-1 of that layer, as decode steps one
after another would leave it. What a row reads across layers is kept per row: its `Shared` (the rows, top-k and
candidates its own kv and index sources handed down), and here the index-key publisher (the reference's stale
index keys: a layer reads the keys the last publishing kv source wrote, which, for a ratio-2 group still open,
is a later layer of the previous token). A row's publisher at its first layer is the publisher after the row
before it, which this forward has not finished yet; whether a kv source publishes at a position depends on the
position only (a ratio-1 source at every token, a ratio-2 source where its group closes), so it is computed
ahead (`_entry_publishers`) and checked after the forward.

A row that reads a later layer's keys reads only keys that existed before this forward when the sequence is at
least as long as its rows (`DecodeRows` refuses otherwise: the caller steps those tokens one at a time).
"""

from __future__ import annotations

from collections.abc import Sequence

from .state import V41SequenceState


class _RowView:
    """What one row's attention reads and writes of its sequence beyond the layer states."""

    __slots__ = ("layers", "index_key_publisher")

    def __init__(self, layers: list, publisher: int | None) -> None:
        self.layers, self.index_key_publisher = layers, publisher


def _publishes(attn, position: int) -> bool:
    """Whether `attn`'s decode step at `position` publishes index keys (`Attention._index`): a kv source that
    owns index keys, when it emits a row (ratio 1: every token; ratio 2: the token that closes a group)."""
    return attn.owns_index_keys and (position + 1) % attn.ratio == 0


class DecodeRows:
    """Row bookkeeping of one `forward_decode`: each row's position, the view its attention gets, and (rows in
    `keep`) the sequence's state after the row, in `V41SequenceState.save`'s form."""

    def __init__(self, layers, states: list[V41SequenceState], keep: Sequence[bool] | None) -> None:
        self.states = states
        self.keep = list(keep) if keep is not None else [False] * len(states)
        if len(self.keep) != len(states):
            raise ValueError(f"keep has {len(self.keep)} entries for {len(states)} rows")
        count: dict[int, int] = {}
        self.starts = []
        for st in states:
            self.starts.append(st.num_tokens + count.get(id(st), 0))
            count[id(st)] = count.get(id(st), 0) + 1
        self.repeated = {i for i, st in enumerate(states) if count[id(st)] > 1}
        for i in self.repeated:
            if states[i].num_tokens < count[id(states[i])]:
                raise ValueError(f"a sequence at {states[i].num_tokens} tokens cannot take {count[id(states[i])]} "
                                 "rows of one decode forward (fewer tokens than rows): step them one at a time")
        self._attns = [blk.attn for blk in layers]
        self.entry = self._entry_publishers()
        self.views = [_RowView(st.layers, self.entry[i]) if i in self.repeated else st for i, st in enumerate(states)]
        self._layer_saves: dict[int, list] = {i: [] for i, k in enumerate(self.keep) if k}
        self._histories: dict[int, list[int]] = {}

    def _entry_publishers(self) -> list[int | None]:
        """Per row, the publisher its decode step starts from: the sequence's for its first row, else the one
        the row before leaves."""
        entry, last = [], {}
        for i, st in enumerate(self.states):
            publisher = last.get(id(st), st.index_key_publisher)
            entry.append(publisher)
            for attn in self._attns:
                if _publishes(attn, self.starts[i]):
                    publisher = attn.layer
            last[id(st)] = publisher
        return entry

    def hashed(self, i: int) -> None:
        """Row i's Engram history is in its sequence now."""
        if self.keep[i]:
            self._histories[i] = list(self.states[i].engram_history)

    def attended(self, i: int, j: int) -> None:
        """Row i has run layer j's attention: keep that layer's state if the row is kept."""
        if self.keep[i]:
            self._layer_saves[i].append(self.states[i].layers[j].save())

    def finish(self) -> dict[int, tuple]:
        """After the forward: each sequence's token count and publisher; returns the kept rows' states."""
        final: list[int | None] = []
        for i, (st, view) in enumerate(zip(self.states, self.views)):
            st.num_tokens = self.starts[i] + 1
            final.append(view.index_key_publisher)
            if i in self.repeated:
                st.index_key_publisher = view.index_key_publisher
        nxt: dict[int, int] = {}
        for i in range(len(self.states) - 1, -1, -1):  # each row's publisher is where the next one started
            st = self.states[i]
            if id(st) in nxt and final[i] != self.entry[nxt[id(st)]]:
                raise RuntimeError(f"row {i} left index-key publisher {final[i]}, the next row started from "
                                   f"{self.entry[nxt[id(st)]]}")
            nxt[id(st)] = i
        return {i: (self._layer_saves[i], [d.save() for d in self.states[i].dspark], self._histories[i],
                    self.starts[i] + 1, self.states[i].dspark_num_tokens, final[i]) for i in self._layer_saves}
