"""Structured output: what a request asks for (`GrammarSpec`), what a grammar engine implements
(`GrammarBackend`, `GrammarMatcher`), and `GrammarCompiler`, which compiles specs off the step loop.

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
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from typing import Any

#: the kinds of constraint a request can ask for, as the keys of `structured_outputs`
GRAMMAR_KINDS = ("json", "json_object", "regex", "grammar", "choice")
_OPTIONS = ("backend", "compact_json", "ascii_classes", "after_token")
_DESCRIPTIONS = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex", "grammar": "grammar",
                 "choice": "choice list"}


class GrammarError(ValueError):
    """A structured-output spec that cannot be used: invalid schema, regex or grammar, an unknown backend, or a
    compile that ran past its timeout. The message names the problem."""


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
    `outlines.types`) maps through `deepserve.plugins.structured.outlines_types`: `JsonSchema` -> json, `Regex`
    and every other regex term (`integer`, `either(...)`, ...) -> regex, `CFG` -> grammar (compiled as Lark by
    the engine's default backend: outlines_core has no grammars), `Choice` of strings -> choice. Neither
    Pydantic nor outlines is imported unless the value comes from it."""
    if isinstance(value, type) and callable(getattr(value, "model_json_schema", None)):
        return {"json": value.model_json_schema()}
    if type(value).__module__.partition(".")[0] == "outlines":
        from deepserve.plugins.structured.outlines_types import outlines_constraint  # imports outlines

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


def _int32(value: int) -> int:
    """`value`'s low 32 bits as a signed int32 (what an int32 bitmask word holds)."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def _allows(bitmask: Any, row: int, token: int) -> bool:
    """Bit `token` of row `row` (the shared layout: bit j of word w is token 32 w + j)."""
    words = bitmask[row]
    return 0 <= token < 32 * len(words) and (int(words[token >> 5]) >> (token & 31)) & 1 == 1


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


class GrammarBackend(ABC):
    """A grammar engine bound to one tokenizer: built once by its plugin factory, `factory(TokenizerInfo)`.

    Bitmask layout, shared by every backend so one step's rows can come from several: a CPU int32 tensor of
    shape [rows, ceil(vocab_size / 32)]; bit j of word w set means token 32 * w + j is allowed.
    `compile` runs on the compiler's worker threads, so it must be thread-safe; the rest runs on the engine thread.
    """

    #: the name it is registered under
    name: str = "abstract"

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


@dataclass(frozen=True, slots=True)
class CompiledGrammar:
    """A compiled spec and the backend that compiled it (and makes its matchers)."""

    backend: GrammarBackend
    compiled: Any
    seconds: float

    def new_matcher(self) -> GrammarMatcher:
        return self.backend.new_matcher(self.compiled)


class GrammarCompiler:
    """Compiles specs on `max_workers` threads, keeps the last `cache_size` results (LRU, keyed by backend, kind,
    canonical spec and options), and builds each backend once, on first use. Thread-safe.

    `factories` maps backend names to plugin factories; `default_backend` serves specs that name none.
    `timeout` is the per-request compile budget in seconds the engine enforces.
    """

    def __init__(self, factories: Mapping[str, Callable[[TokenizerInfo], GrammarBackend]], tokenizer: TokenizerInfo,
                 default_backend: str = "llguidance", timeout: float = 10.0, max_workers: int = 2,
                 cache_size: int = 256) -> None:
        if default_backend not in factories:
            raise ValueError(f"structured-output backend {default_backend!r} is not registered; "
                             f"registered: {sorted(factories) or 'none'}")
        if not timeout > 0:
            raise ValueError(f"the grammar compile timeout must be positive, got {timeout}")
        self.factories, self.tokenizer = dict(factories), tokenizer
        self.default_backend, self.timeout, self.cache_size = default_backend, float(timeout), cache_size
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="deepserve-grammar")
        self._lock = threading.Lock()
        self._backends: dict[str, GrammarBackend] = {}
        self._backend_locks = {name: threading.Lock() for name in self.factories}
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._gated_backends: dict[tuple[str, int], GatedBackend] = {}

    def backend_name(self, spec: GrammarSpec) -> str:
        name = spec.backend or self.default_backend
        if name not in self.factories:
            raise GrammarError(f"structured-output backend {name!r} is not registered; "
                               f"registered: {sorted(self.factories)}")
        return name

    def backend(self, name: str) -> GrammarBackend:
        """The backend registered as `name`, built on first use (its factory may take a second or two)."""
        with self._backend_locks[name]:
            if name not in self._backends:
                backend = self.factories[name](self.tokenizer)
                if not isinstance(backend, GrammarBackend):
                    raise GrammarError(f"the factory registered as {name!r} returned a {type(backend).__name__}, "
                                       "not a deepserve.core.structured.GrammarBackend")
                self._backends[name] = backend
            return self._backends[name]

    def warm_up(self) -> Future:
        """Build the default backend on a worker thread now, so the first request does not wait for it."""
        return self._pool.submit(self.backend, self.default_backend)

    def submit(self, spec: GrammarSpec) -> Future:
        """Start compiling `spec` (or share the compile already cached). The future gives a `CompiledGrammar` or
        raises `GrammarError`. Raises `GrammarError` at once for an unknown backend. A spec with `after_token`
        shares the compile of the same spec without it; its matchers are `GatedMatcher`s."""
        if spec.after_token is not None:
            return self._gated(self.submit(replace(spec, after_token=None)), spec.after_token)
        name = self.backend_name(spec)
        key = (name, spec.kind, spec.spec, spec.compact_json, spec.ascii_classes)
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                future = self._cache[key] = self._pool.submit(self._compile, name, spec)
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        return future

    def compile(self, spec: GrammarSpec, timeout: float | None = None) -> CompiledGrammar:
        """Compile and wait (at most `timeout`, default the compiler's); raises `GrammarError` naming the problem."""
        future = self.submit(spec)
        timeout = self.timeout if timeout is None else timeout
        try:
            return future.result(timeout=timeout)
        except FutureTimeout:
            raise GrammarError(timeout_message(spec, timeout)) from None

    def _gated(self, compiling: Future, open_token: int) -> Future:
        gated: Future = Future()

        def done(future: Future) -> None:
            if gated.cancelled():
                return
            if future.cancelled():
                gated.cancel()
            elif future.exception() is not None:
                gated.set_exception(future.exception())
            else:
                compiled = future.result()
                gated.set_result(replace(compiled, backend=self._gated_backend(compiled.backend, open_token)))

        compiling.add_done_callback(done)
        return gated

    def _gated_backend(self, inner: GrammarBackend, open_token: int) -> GatedBackend:
        with self._lock:
            key = (inner.name, open_token)
            if key not in self._gated_backends:
                self._gated_backends[key] = GatedBackend(inner, open_token, self.tokenizer.eos_token_ids)
            return self._gated_backends[key]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, name: str, spec: GrammarSpec) -> CompiledGrammar:
        began = time.perf_counter()
        try:
            backend = self.backend(name)
            compiled = backend.compile(spec)
        except GrammarError:
            raise
        except Exception as exc:  # a grammar engine's own error type: still the user's spec, named as such
            raise GrammarError(f"{name} could not compile the {spec.description}: {exc}") from exc
        return CompiledGrammar(backend, compiled, time.perf_counter() - began)


def timeout_message(spec: GrammarSpec, timeout: float) -> str:
    return (f"compiling the {spec.description} took longer than the {timeout:g} s grammar compile timeout; "
            "simplify it or raise grammar_compile_timeout")
