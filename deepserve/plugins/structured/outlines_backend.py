"""The outlines grammar backend: outlines_core's token index for regexes and JSON schemas (outlines' own
json-schema-to-regex), and choices as a regex. No grammars: outlines_core has none (outlines' `CFG` type maps to
a Lark grammar that the llguidance backend compiles).

One `OutlinesBackend` per tokenizer holds outlines_core's `Vocabulary` (each token's bytes; special tokens left
out, so never allowed). A compile builds an `Index`: a DFA over the regex with, per state, the tokens that keep
it alive. That costs time and memory growing with the regex (a JSON schema's regex can take tens of seconds: the
compile timeout bounds it; the build releases the GIL, so the engine thread runs on). Each request gets a
`Guide` over the shared index, which writes its bitmask row in Rust.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import Any

import llguidance
import torch

from deepserve.core.interfaces import BackendUnavailable
from deepserve.core.structured import GrammarBackend, GrammarError, GrammarMatcher, GrammarSpec, TokenizerInfo
from deepserve.plugins.structured.llguidance_backend import JSON_OBJECT_SCHEMA, check_bitmask, escape_regex
from deepserve.plugins.structured.vocabulary import token_bytes

try:
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema
except ImportError as exc:  # raised when the backend is built, i.e. when a request first asks for it
    raise BackendUnavailable("the outlines grammar backend needs the outlines-core package: "
                             "pip install 'deepserve[outlines]'") from exc

#: how many tokens a matcher can roll back (speculative decoding's drafts)
MAX_ROLLBACK = 64
#: the most tokens `forced_tokens` returns at once
MAX_FORCED = 64
#: the widest integer range written out as an enum (outlines_core's regex ignores minimum and maximum)
MAX_ENUM_RANGE = 1024
_RANGE_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


def enforce_integer_ranges(schema: Any) -> Any:
    """`schema` with each bounded integer range (`minimum`/`maximum`, exclusive or not, at most
    `MAX_ENUM_RANGE` values, `multipleOf` included) written as the enum of its values, which outlines_core does
    enforce: its json-schema-to-regex drops numeric bounds, so `{"type": "integer", "maximum": 9}` would allow
    123. Raises GrammarError for a range it cannot write out (one-sided, too wide, or on a `number`)."""
    if isinstance(schema, list):
        return [enforce_integer_ranges(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: enforce_integer_ranges(value) for key, value in schema.items()}
    bounds = [key for key in _RANGE_KEYWORDS if key in schema]
    if not bounds or "enum" in schema or "const" in schema:
        return out
    low, high = schema.get("minimum"), schema.get("maximum")
    if isinstance(schema.get("exclusiveMinimum"), (int, float)) and not isinstance(schema["exclusiveMinimum"], bool):
        low = schema["exclusiveMinimum"] + 1 if low is None else max(low, schema["exclusiveMinimum"] + 1)
    if isinstance(schema.get("exclusiveMaximum"), (int, float)) and not isinstance(schema["exclusiveMaximum"], bool):
        high = schema["exclusiveMaximum"] - 1 if high is None else min(high, schema["exclusiveMaximum"] - 1)
    step = schema.get("multipleOf", 1)
    exact = all(isinstance(v, int) and not isinstance(v, bool) for v in (low, high, step))
    if schema.get("type") != "integer" or not exact or step <= 0 or high - low >= MAX_ENUM_RANGE * step:
        raise GrammarError(f"the outlines backend cannot enforce {', '.join(bounds)} here (only integer ranges of "
                           f"at most {MAX_ENUM_RANGE} values, bounded on both sides): use the llguidance backend")
    for key in (*_RANGE_KEYWORDS, "type"):
        out.pop(key, None)
    out["enum"] = [v for v in range(low, high + 1) if v % step == 0]
    return out


class OutlinesGrammar:
    """A compiled spec: the index, and which of its states are complete (only EOS may follow), found lazily."""

    __slots__ = ("index", "_terminal", "_lock")

    def __init__(self, index: outlines_core.Index) -> None:
        self.index = index
        self._terminal: dict[int, bool] = {}
        self._lock = threading.Lock()

    def __reduce__(self):  # compiled in a child process, sent back by pickle (the index pickles; the lock does not)
        return OutlinesGrammar, (self.index,)

    def is_terminal(self, state: int, eos: int) -> bool:
        with self._lock:
            known = self._terminal.get(state)
        if known is None:
            known = self.index.is_final_state(state) and set(self.index.get_allowed_tokens(state) or ()) <= {eos}
            with self._lock:
                self._terminal[state] = known
        return known


class OutlinesMatcher(GrammarMatcher):
    __slots__ = ("grammar", "guide", "backend", "_error")

    def __init__(self, grammar: OutlinesGrammar, backend: OutlinesBackend) -> None:
        self.grammar, self.backend = grammar, backend
        self.guide = outlines_core.Guide(grammar.index, max_rollback=MAX_ROLLBACK)
        self._error = ""

    def consume(self, token_id: int) -> bool:
        if self._error:
            return False
        if token_id in self.backend.extra_eos and self.guide.is_finished():
            token_id = self.backend.eos  # the index knows one EOS; every EOS id ends a complete output alike
        try:
            self.guide.advance(token_id, return_tokens=False)
        except ValueError:
            self._error = f"token {token_id} is not allowed here"
            return False
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        target = bitmask[row]
        if self._error:
            target.zero_()
            return
        check_bitmask(bitmask)
        self.guide.write_mask_into(target.data_ptr(), target.numel(), 4)
        if self.backend.extra_eos and self.guide.is_finished():
            for token in self.backend.extra_eos:
                target[token >> 5] |= _bit(token)

    def is_terminated(self) -> bool:
        return not self._error and self.grammar.is_terminal(self.guide.get_state(), self.backend.eos)

    def is_stop_token(self, token_id: int) -> bool:
        return token_id == self.backend.eos or token_id in self.backend.extra_eos

    def is_error(self) -> bool:
        return bool(self._error)

    def error_message(self) -> str:
        return self._error

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            try:
                self.guide.rollback_state(num_tokens)
            except ValueError as exc:
                raise ValueError(f"cannot roll back {num_tokens} tokens: {exc}") from None

    def forced_tokens(self) -> list[int]:
        """While a state allows exactly one token and is not complete, that token is forced."""
        index, state, forced = self.grammar.index, self.guide.get_state(), []
        while not self._error and len(forced) < MAX_FORCED and not index.is_final_state(state):
            allowed = index.get_allowed_tokens(state)
            if allowed is None or len(allowed) != 1:
                break
            forced.append(allowed[0])
            state = index.get_next_state(state, allowed[0])
            if state is None:
                break
        return forced


def _bit(token: int) -> int:
    bit = 1 << (token & 31)
    return bit - (1 << 32) if bit >= 1 << 31 else bit  # as a signed int32


class OutlinesBackend(GrammarBackend):
    name = "outlines"
    isolated_compiles = True  # an Index build grows with the regex and cannot be interrupted

    def __init__(self, tokenizer: TokenizerInfo) -> None:
        if not tokenizer.eos_token_ids:
            raise GrammarError("the outlines backend needs an EOS token id")
        self.vocab_size = tokenizer.vocab_size
        self.eos, *extra = tokenizer.eos_token_ids
        self.extra_eos = frozenset(extra)
        tokens: dict[bytes, list[int]] = {}
        for token, data in enumerate(token_bytes(tokenizer)):
            if data is not None and token not in tokenizer.eos_token_ids:
                tokens.setdefault(data, []).append(token)
        self.vocabulary = outlines_core.Vocabulary(self.eos, tokens)

    def regex(self, spec: GrammarSpec) -> str:
        """The regex outlines_core compiles for `spec`."""
        whitespace = "" if spec.compact_json else None  # None: outlines' default, an optional space
        if spec.kind == "json":
            schema = enforce_integer_ranges(json.loads(spec.spec))
            return build_regex_from_schema(json.dumps(schema), whitespace)
        if spec.kind == "json_object":
            return build_regex_from_schema(JSON_OBJECT_SCHEMA, whitespace)
        if spec.kind == "regex":
            # llguidance's converter spells \d, \w, \s as ASCII classes (Rust regex syntax, which outlines_core reads)
            return llguidance.regex_to_lark(spec.spec, "dws" if spec.ascii_classes else "")
        if spec.kind == "choice":
            return "|".join(escape_regex(c) for c in spec.choices)
        raise GrammarError("the outlines backend compiles regexes, JSON schemas and choices; outlines_core has no "
                           "grammars: use the llguidance backend for a grammar")

    def compile(self, spec: GrammarSpec) -> OutlinesGrammar:
        try:
            regex = self.regex(spec)
        except GrammarError:
            raise
        except (ValueError, TypeError, RuntimeError) as exc:
            raise GrammarError(f"invalid {spec.description}: {exc}") from None
        try:
            return OutlinesGrammar(outlines_core.Index(regex, self.vocabulary))
        except (ValueError, TypeError, RuntimeError) as exc:
            raise GrammarError(f"invalid {spec.description}: {exc}") from None

    def new_matcher(self, compiled: OutlinesGrammar) -> OutlinesMatcher:
        return OutlinesMatcher(compiled, self)

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        return torch.full((num_rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32,
                          pin_memory=torch.cuda.is_available())

    def fill_bitmasks(self, bitmask: torch.Tensor, rows: Sequence[tuple[GrammarMatcher, int]]) -> list[int]:
        dead = []
        for matcher, row in rows:
            matcher.fill_bitmask(bitmask, row)
            if matcher.is_error() or not bool(bitmask[row].any()):
                dead.append(row)
        return dead
