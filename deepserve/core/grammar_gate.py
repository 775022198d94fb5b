"""A constraint that starts after a token: the end of a thinking model's reasoning (`</think>`).

`GatedMatcher` lets every token but EOS through until the opening token has been consumed, then hands over to
the grammar's own matcher; `GatedBackend` makes such matchers over any backend's. Plain Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from deepserve.core.structured import GrammarBackend, GrammarMatcher, GrammarSpec


def _int32(value: int) -> int:
    """`value`'s low 32 bits as a signed int32 (what an int32 bitmask word holds)."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


class GatedMatcher(GrammarMatcher):
    """A constraint that starts after a token: every token but EOS is allowed until `open_token` has been
    consumed, then `inner` (a fresh matcher of the grammar) decides. That is a thinking model's constraint: free
    reasoning up to `</think>`, then the constrained answer. EOS (`eos_token_ids`) is held back while the gate is
    closed because ending there would end the request without the answer its constraint promises. Rollback
    reaches back across the opening token (speculative decoding may reject it), closing the gate again with
    `inner` back at its start."""

    __slots__ = ("inner", "open_token", "eos_token_ids", "is_open", "num_before", "num_inner")

    def __init__(self, inner: GrammarMatcher, open_token: int, eos_token_ids: Sequence[int] = ()) -> None:
        self.inner, self.open_token, self.eos_token_ids = inner, open_token, tuple(eos_token_ids)
        self.is_open = False
        self.num_before = 0  # tokens consumed while closed, the opening token included
        self.num_inner = 0  # tokens `inner` has consumed since the gate opened

    def consume(self, token_id: int) -> bool:
        if not self.is_open:
            self.num_before += 1
            self.is_open = token_id == self.open_token
            return True
        if not self.inner.consume(token_id):
            return False
        self.num_inner += 1
        return True

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        if self.is_open:
            self.inner.fill_bitmask(bitmask, row)
            return
        bitmask[row] = -1  # every bit set: any token (the shared int32 layout)...
        for token in self.eos_token_ids:  # ...but EOS
            if token < 32 * len(bitmask[row]):
                bitmask[row, token >> 5] &= _int32(~(1 << (token & 31)))

    def is_terminated(self) -> bool:
        return self.is_open and self.inner.is_terminated()

    def is_error(self) -> bool:
        return self.is_open and self.inner.is_error()

    def error_message(self) -> str:
        return self.inner.error_message() if self.is_open else ""

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self.num_before + self.num_inner:
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self.num_before + self.num_inner} were "
                             "consumed")
        from_inner = min(num_tokens, self.num_inner)
        if from_inner:
            self.inner.rollback(from_inner)
            self.num_inner -= from_inner
        if num_tokens > from_inner:  # the opening token goes back too
            self.is_open = False
            self.num_before -= num_tokens - from_inner

    def is_stop_token(self, token_id: int) -> bool:
        return self.inner.is_stop_token(token_id)

    def forced_tokens(self) -> list[int]:
        return self.inner.forced_tokens() if self.is_open else []


class GatedBackend(GrammarBackend):
    """The backend of `GatedMatcher`s over `inner`'s: one per (inner backend, opening token), so one step's rows
    of both kinds still fill in one `fill_bitmasks` call of the inner backend (in parallel where it can)."""

    def __init__(self, inner: GrammarBackend, open_token: int, eos_token_ids: Sequence[int] = ()) -> None:
        self.inner, self.open_token, self.eos_token_ids = inner, open_token, tuple(eos_token_ids)
        self.name = inner.name

    def compile(self, spec: GrammarSpec) -> Any:
        return self.inner.compile(spec)

    def new_matcher(self, compiled: Any) -> GatedMatcher:
        return GatedMatcher(self.inner.new_matcher(compiled), self.open_token, self.eos_token_ids)

    def allocate_bitmask(self, num_rows: int) -> Any:
        return self.inner.allocate_bitmask(num_rows)

    def fill_bitmasks(self, bitmask: Any, rows: Sequence[tuple[GrammarMatcher, int]]) -> list[int]:
        open_rows = []
        for matcher, row in rows:
            if matcher.is_open:
                open_rows.append((matcher.inner, row))
            else:
                matcher.fill_bitmask(bitmask, row)
        return self.inner.fill_bitmasks(bitmask, open_rows) if open_rows else []
