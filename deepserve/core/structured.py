"""Structured output: what a request asks for (`GrammarSpec`) and what a grammar engine implements
(`GrammarBackend`, `GrammarMatcher`). `grammar_compiler.GrammarCompiler` compiles specs off the step loop;
`grammar_gate` starts a constraint after a token (the end of a thinking section).

Life of a constrained request: `SamplingParams(structured_outputs={...})` turns the user's dict into a
`GrammarSpec`; the engine hands it to `GrammarCompiler.submit`, which compiles it on a small thread pool (an
LRU cache keyed by backend and spec makes repeats free) while the request prefills; once ready, the request
gets its own `GrammarMatcher`, which consumes every sampled token and fills the request's row of the step's
token bitmask on the host while the device runs the forward.

Grammar engines are plugins (`deepserve_register_grammar_backends`): a factory that takes the model's
`TokenizerInfo` and returns a `GrammarBackend`; the compiler builds each one once, when first used. Plain
Python: nothing here imports torch or a grammar engine; bitmasks are opaque objects the backend allocates.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

#: the kinds of constraint a request can ask for, as the keys of `structured_outputs`
GRAMMAR_KINDS = ("json", "json_object", "regex", "grammar", "choice")
_OPTIONS = ("backend", "compact_json", "ascii_classes", "after_token")
_DESCRIPTIONS = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex", "grammar": "grammar",
                 "choice": "choice list"}


class GrammarError(ValueError):
    """A structured-output spec that cannot be used: invalid schema, regex or grammar, an unknown backend, or a
    compile that ran past its timeout. The message names the problem."""


class GrammarTimeout(GrammarError):
    """The spec's compile ran past the grammar compile timeout (and was stopped, where its backend allows)."""


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """One request's constraint, canonical and hashable (it is part of the compile cache's key).

    `kind` is one of `GRAMMAR_KINDS`; `spec` is its text: the JSON schema serialized compactly (key order kept:
    properties are generated in the order given), the regex,
    the grammar (Lark, or GBNF/EBNF), the JSON list of choices, or "" for `json_object`. `backend` picks a
    grammar engine by its registered name (None: the engine's default). `compact_json`: JSON without free
    whitespace (the default; False allows whitespace between tokens). `ascii_classes`: `\\d`, `\\w`, `\\s` in
    regexes match ASCII only (the default). `after_token`: the constraint starts after this token id is generated
    (every token but EOS is allowed until then, that one included): a thinking model's `</think>`, so the
    reasoning is free and the answer is constrained. None: from the first output token.
    """

    kind: str
    spec: str
    backend: str | None = None
    compact_json: bool = True
    ascii_classes: bool = True
    after_token: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"structured output kind must be one of {list(GRAMMAR_KINDS)}, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise ValueError(f"the {self.description} must be given as text, got {type(self.spec).__name__}")
        if self.backend is not None and (not isinstance(self.backend, str) or not self.backend):
            raise ValueError(f"structured_outputs 'backend' must be a non-empty string, got {self.backend!r}")
        for name in ("compact_json", "ascii_classes"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs {name!r} must be a bool, got {getattr(self, name)!r}")
        token = self.after_token
        if token is not None and (isinstance(token, bool) or not isinstance(token, int) or token < 0):
            raise ValueError(f"structured_outputs 'after_token' must be a token id (an int >= 0), got {token!r}")

    @classmethod
    def parse(cls, value: Any) -> GrammarSpec:
        """Validate the `structured_outputs` of `SamplingParams`: a `GrammarSpec`, or a dict with exactly one of
        `{"json": schema (dict or JSON text)}`, `{"regex": str}`, `{"grammar": str}`, `{"choice": [str, ...]}`,
        `{"json_object": True}`, plus optional `backend`, `compact_json`, `ascii_classes`, `after_token`; or a
        typed constraint (see `typed_constraint`: a Pydantic model class, an outlines type), alone or as the
        value of its kind's key (`{"json": Model, "backend": "outlines"}`). Raises ValueError."""
        if isinstance(value, GrammarSpec):
            return value
        typed = typed_constraint(value)
        if typed is not None:
            value = typed
        if not isinstance(value, Mapping):
            raise ValueError(f"structured_outputs must be a dict such as {{'json': schema}}, a Pydantic model class "
                             f"or an outlines type, got {value!r}")
        unknown = [k for k in value if k not in GRAMMAR_KINDS and k not in _OPTIONS]
        if unknown:
            raise ValueError(f"structured_outputs has unknown keys {unknown}; it takes one of "
                             f"{list(GRAMMAR_KINDS)} and optionally {list(_OPTIONS)}")
        kinds = [k for k in GRAMMAR_KINDS if k in value]
        if len(kinds) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {list(GRAMMAR_KINDS)}, got {kinds or 'none'}")
        kind = kinds[0]
        options = {k: value[k] for k in _OPTIONS if k in value}
        typed = typed_constraint(value[kind])
        if typed is not None:  # {"json": Model, ...}: the typed value stands for its own kind and options
            if kind not in typed:
                raise ValueError(f"structured_outputs {kind!r} got a {type(value[kind]).__name__}, which is a "
                                 f"{next(k for k in GRAMMAR_KINDS if k in typed)!r} constraint")
            return cls.parse({**typed, **options})
        return cls(kind, _canonical_text(kind, value[kind]), **options)

    @property
    def description(self) -> str:
        return _DESCRIPTIONS.get(self.kind, self.kind)

    @property
    def choices(self) -> list[str]:
        """The choices of a `choice` spec."""
        return json.loads(self.spec) if self.kind == "choice" else []


def typed_constraint(value: Any) -> dict[str, Any] | None:
    """The `structured_outputs` dict a typed constraint stands for, or None when `value` is not one.

    A Pydantic model class is its JSON schema (`model_json_schema()`). An outlines type (outlines >= 1.0,
    `outlines.types`) maps through `deepserve.core.outlines_types`: `JsonSchema` -> json, `Regex`
    and every other regex term (`integer`, `either(...)`, ...) -> regex, `CFG` -> grammar (compiled as Lark by
    the engine's default backend: outlines_core has no grammars), `Choice` of strings -> choice. Neither
    Pydantic nor outlines is imported unless the value comes from it."""
    if isinstance(value, type) and callable(getattr(value, "model_json_schema", None)):
        return {"json": value.model_json_schema()}
    if type(value).__module__.partition(".")[0] == "outlines":
        from deepserve.core.outlines_types import outlines_constraint  # imports outlines

        return outlines_constraint(value)
    return None


def _canonical_text(kind: str, value: Any) -> str:
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"structured_outputs 'json' is not valid JSON: {exc}") from None
        if not isinstance(value, (dict, bool)):
            raise ValueError(f"structured_outputs 'json' must be a JSON schema object, got {type(value).__name__}")
        try:
            return json.dumps(value, separators=(",", ":"), ensure_ascii=False)  # property order matters
        except (TypeError, ValueError) as exc:
            raise ValueError(f"structured_outputs 'json' is not serializable as JSON: {exc}") from None
    if kind == "json_object":
        if value is not True:
            raise ValueError(f"structured_outputs 'json_object' must be True, got {value!r}")
        return ""
    if kind == "choice":
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
            raise ValueError(f"structured_outputs 'choice' must be a non-empty list of strings, got {value!r}")
        bad = [c for c in value if not isinstance(c, str)]
        if bad:
            raise ValueError(f"structured_outputs 'choice' must hold only strings, got {bad[0]!r}")
        return json.dumps(list(value), ensure_ascii=False)
    if not isinstance(value, str) or not value:
        raise ValueError(f"structured_outputs {kind!r} must be a non-empty string, got {value!r}")
    return value


@dataclass(frozen=True, slots=True, eq=False)
class TokenizerInfo:
    """What a grammar backend needs to know about the model's tokenizer. `tokenizer_json` is the Hugging Face
    `tokenizer.json` text; `vocab_size` is the model's (padded) vocabulary, the width of a bitmask row;
    `eos_token_ids` are the ids that end a request, allowed only where the grammar accepts."""

    tokenizer_json: str = field(repr=False)
    vocab_size: int
    eos_token_ids: tuple[int, ...]


class GrammarMatcher(ABC):
    """One request's position in its grammar. Used from the engine thread only, one token at a time."""

    @abstractmethod
    def consume(self, token_id: int) -> bool:
        """Advance by one sampled token. False when the grammar rejects it; the matcher is then in error."""

    @abstractmethod
    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        """Write the tokens allowed next into row `row` of a bitmask from `GrammarBackend.allocate_bitmask`."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True when the grammar is complete: nothing but EOS may follow, so the request is done."""

    @abstractmethod
    def is_error(self) -> bool:
        """True once the matcher has hit a dead end or rejected a token; it stays so."""

    @abstractmethod
    def error_message(self) -> str:
        """Why the matcher is in error ("" when it is not)."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` consumed tokens (speculative decoding rejects draft tokens)."""

    def is_stop_token(self, token_id: int) -> bool:
        """True for an end-of-sequence id (the tokenizer's EOS ids the backend was built with): a sampled one
        ends the request rather than being consumed. Backends override this; the default knows none."""
        return False

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next, whatever the model says (fast-forward); [] when none or unknown.

        Does not change the matcher: a caller that appends them consumes them like sampled tokens. Backends
        that know (llguidance, xgrammar, outlines) override this; the list is at most a few dozen tokens."""
        return []

    def fill_draft_masks(self, draft_tokens: Sequence[int], bitmask: Any, first_row: int) -> int:
        """Verify speculative draft tokens against the grammar and fill the masks their verification samples with.

        With k = len(draft_tokens) and n the returned count: n is the number of leading draft tokens the grammar
        accepts in a row (0 <= n <= k). Row `first_row + i` of `bitmask` (from `GrammarBackend.allocate_bitmask`)
        is filled, for i = 0..n, with the tokens allowed after `draft_tokens[:i]`: the mask to sample position i
        of the verify step with. So rows first_row..first_row+n are written, n + 1 rows: when every draft is
        accepted (n == k) the last one is the mask for the bonus token after them; when draft i = n is rejected,
        row first_row + n is the mask that rejects it, which the verifier resamples with. Rows past
        first_row + n are not written: a verifier never samples past the first rejected draft. A token outside
        the bitmask's width counts as rejected. An end-of-sequence draft (`is_stop_token`) that its row allows
        is accepted and ends the verification there: it is the n-th accepted token, nothing after it is looked
        at, and no row follows it (rows first_row..first_row+n-1 are written).

        The matcher ends in the state it started in (the accepted drafts are consumed, then rolled back): the
        caller then `consume`s the tokens it keeps, as it does sampled ones. A matcher already in error accepts
        nothing and fills row first_row as its `fill_bitmask` does. Uses `consume`, `fill_bitmask` and
        `rollback`, so it holds for every backend; a token is consumed only when its row allows it, so the
        matcher never enters an error state here.
        """
        num_accepted = 0
        try:
            for token in draft_tokens:
                row = first_row + num_accepted
                self.fill_bitmask(bitmask, row)
                if self.is_error() or not _allows(bitmask, row, token):
                    return num_accepted
                if self.is_stop_token(token):  # the sequence ends here: counted, not consumed
                    return num_accepted + 1
                if not self.consume(token):
                    return num_accepted
                num_accepted += 1
            self.fill_bitmask(bitmask, first_row + num_accepted)
            return num_accepted
        finally:
            if num_accepted:
                self.rollback(num_accepted)

def _allows(bitmask: Any, row: int, token: int) -> bool:
    """Bit `token` of row `row` (the shared layout: bit j of word w is token 32 w + j)."""
    words = bitmask[row]
    return 0 <= token < 32 * len(words) and (int(words[token >> 5]) >> (token & 31)) & 1 == 1

class GrammarBackend(ABC):
    """A grammar engine bound to one tokenizer: built once by its plugin factory, `factory(TokenizerInfo)`.

    Bitmask layout, shared by every backend so one step's rows can come from several: a CPU int32 tensor of
    shape [rows, ceil(vocab_size / 32)]; bit j of word w set means token 32 * w + j is allowed.
    `compile` runs on the compiler's worker threads, so it must be thread-safe; the rest runs on the engine thread.
    """

    #: the name it is registered under
    name: str = "abstract"
    #: True: `compile` may run for unbounded time and cannot be interrupted, so the compiler runs it in child
    #: processes (each builds this backend once with its factory) and ends one that overruns the timeout;
    #: `compile`'s result must then pickle
    isolated_compiles: bool = False

    @abstractmethod
    def compile(self, spec: GrammarSpec) -> Any:
        """Validate and compile `spec` into whatever `new_matcher` takes. Raise `GrammarError` naming the problem
        (the invalid schema, regex or grammar, or a kind this backend does not support)."""

    @abstractmethod
    def new_matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher at the start of a compiled grammar; cheap (compiled grammars are shared)."""

    @abstractmethod
    def allocate_bitmask(self, num_rows: int) -> Any:
        """A bitmask of `num_rows` rows with every bit set (rows nobody fills allow everything)."""

    def fill_bitmasks(self, bitmask: Any, rows: Sequence[tuple[GrammarMatcher, int]]) -> list[int]:
        """Fill the row of each (matcher, row) pair; return the rows that allow no token at all (dead ends).
        Backends override this to fill in parallel."""
        dead = []
        for matcher, row in rows:
            matcher.fill_bitmask(bitmask, row)
            if matcher.is_error():
                dead.append(row)
        return dead
