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
from dataclasses import dataclass, field
from typing import Any

#: the kinds of constraint a request can ask for, as the keys of `structured_outputs`
GRAMMAR_KINDS = ("json", "json_object", "regex", "grammar", "choice")
_OPTIONS = ("backend", "compact_json", "ascii_classes")
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
    regexes match ASCII only (the default).
    """

    kind: str
    spec: str
    backend: str | None = None
    compact_json: bool = True
    ascii_classes: bool = True

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

    @classmethod
    def parse(cls, value: Any) -> GrammarSpec:
        """Validate the `structured_outputs` of `SamplingParams`: a `GrammarSpec`, or a dict with exactly one of
        `{"json": schema (dict or JSON text)}`, `{"regex": str}`, `{"grammar": str}`, `{"choice": [str, ...]}`,
        `{"json_object": True}`, plus optional `backend`, `compact_json`, `ascii_classes`. Raises ValueError."""
        if isinstance(value, GrammarSpec):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"structured_outputs must be a dict such as {{'json': schema}}, got {value!r}")
        unknown = [k for k in value if k not in GRAMMAR_KINDS and k not in _OPTIONS]
        if unknown:
            raise ValueError(f"structured_outputs has unknown keys {unknown}; it takes one of "
                             f"{list(GRAMMAR_KINDS)} and optionally {list(_OPTIONS)}")
        kinds = [k for k in GRAMMAR_KINDS if k in value]
        if len(kinds) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {list(GRAMMAR_KINDS)}, got {kinds or 'none'}")
        kind = kinds[0]
        options = {k: value[k] for k in _OPTIONS if k in value}
        return cls(kind, _canonical_text(kind, value[kind]), **options)

    @property
    def description(self) -> str:
        return _DESCRIPTIONS.get(self.kind, self.kind)

    @property
    def choices(self) -> list[str]:
        """The choices of a `choice` spec."""
        return json.loads(self.spec) if self.kind == "choice" else []


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

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next, whatever the model says (fast-forward); [] when none or unknown."""
        return []


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
        raises `GrammarError`. Raises `GrammarError` at once for an unknown backend."""
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
