"""`GrammarCompiler`: compiles `GrammarSpec`s off the step loop.

Specs compile on a small thread pool while their requests prefill; an LRU cache keyed by backend, kind,
canonical spec and options makes repeats free; each grammar backend (a plugin factory) is built once, on first
use; a spec with `after_token` shares the compile of the same spec without it and gets gated matchers. Plain
Python.

A compile cannot outlive its timeout by much: a backend that declares `isolated_compiles` compiles in child
processes (`grammar_isolation.py`) that are ended at the timeout; for the others, the waiter gives up at the
timeout and the late result is not cached. One client (an API key, else an address) may have at most
`max_workers` compiles in flight, half the pool's threads, so its pathological grammars cannot starve others.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, replace
from typing import Any

from deepserve.core.grammar_gate import GatedBackend
from deepserve.core.grammar_isolation import CompileProcesses
from deepserve.core.structured import (GrammarBackend, GrammarError, GrammarMatcher, GrammarSpec, GrammarTimeout,
                                       TokenizerInfo)


class GrammarBusy(GrammarError):
    """This client already has its share of compiles in flight; retry once one finishes (HTTP 429)."""


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
        self.max_per_client = max_workers
        # twice the threads one client may hold: another client always finds one free
        self._num_threads = 2 * max_workers
        self._pool = ThreadPoolExecutor(max_workers=self._num_threads, thread_name_prefix="deepserve-grammar")
        self._processes: dict[str, CompileProcesses] = {}
        self._in_flight: dict[str, int] = {}  # client -> compiles of theirs not finished
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
        """The backend registered as `name`, built on first use (its factory may take a second or two); for a
        backend that compiles in child processes, the first child starts meanwhile."""
        with self._backend_locks[name]:
            if name not in self._backends:
                backend = self.factories[name](self.tokenizer)
                if isinstance(backend, GrammarBackend) and backend.isolated_compiles:
                    self._isolated(name).prestart()
                if not isinstance(backend, GrammarBackend):
                    raise GrammarError(f"the factory registered as {name!r} returned a {type(backend).__name__}, "
                                       "not a deepserve.core.structured.GrammarBackend")
                self._backends[name] = backend
            return self._backends[name]

    def warm_up(self) -> Future:
        """Build the default backend on a worker thread now, so the first request does not wait for it."""
        return self._pool.submit(self.backend, self.default_backend)

    def submit(self, spec: GrammarSpec, client: str | None = None) -> Future:
        """Start compiling `spec` (or share the compile already cached). The future gives a `CompiledGrammar` or
        raises `GrammarError`. Raises `GrammarError` at once for an unknown backend, and `GrammarBusy` when
        `client` already has `max_per_client` compiles of uncached specs in flight. A spec with `after_token`
        shares the compile of the same spec without it; its matchers are `GatedMatcher`s."""
        if spec.after_token is not None:
            return self._gated(self.submit(replace(spec, after_token=None), client), spec.after_token)
        name = self.backend_name(spec)
        key = self._key(name, spec)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            if client is not None:
                if self._in_flight.get(client, 0) >= self.max_per_client:
                    raise GrammarBusy(f"this client already has {self.max_per_client} grammar compiles in flight; "
                                      "retry when one finishes")
                self._in_flight[client] = self._in_flight.get(client, 0) + 1
            future = self._cache[key] = self._pool.submit(self._compile, name, spec)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        future.add_done_callback(lambda f: self._settled(key, f, client))
        return future

    @staticmethod
    def _key(name: str, spec: GrammarSpec) -> tuple:
        return (name, spec.kind, spec.spec, spec.compact_json, spec.ascii_classes)

    def _settled(self, key: tuple, future: Future, client: str | None) -> None:
        """A compile finished: its client's count goes down; a timed-out compile is not kept (the machine may
        just have been busy: a retry compiles again)."""
        with self._lock:
            if client is not None:
                left = self._in_flight.get(client, 1) - 1
                if left > 0:
                    self._in_flight[client] = left
                else:
                    self._in_flight.pop(client, None)
            error = None if future.cancelled() else future.exception()
            if isinstance(error, GrammarTimeout) and self._cache.get(key) is future:
                del self._cache[key]

    def forget(self, spec: GrammarSpec) -> None:
        """Drop `spec`'s cache entry (its waiter gave up at the timeout): a result that arrives later for a request
        that has already failed is not kept."""
        if spec.after_token is not None:
            spec = replace(spec, after_token=None)
        with self._lock:
            self._cache.pop(self._key(self.backend_name(spec), spec), None)

    def compile(self, spec: GrammarSpec, timeout: float | None = None) -> CompiledGrammar:
        """Compile and wait (at most `timeout`, default the compiler's); raises `GrammarError` naming the problem."""
        future = self.submit(spec)
        timeout = self.timeout if timeout is None else timeout
        try:
            return future.result(timeout=timeout)
        except FutureTimeout:
            self.forget(spec)
            raise GrammarTimeout(timeout_message(spec, timeout)) from None

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
        with self._lock:
            processes, self._processes = list(self._processes.values()), {}
        for group in processes:
            group.shutdown()

    def _isolated(self, name: str) -> CompileProcesses:
        with self._lock:
            if name not in self._processes:
                self._processes[name] = CompileProcesses(self.factories[name], self.tokenizer,
                                                         max_processes=self._num_threads)
            return self._processes[name]

    def _compile(self, name: str, spec: GrammarSpec) -> CompiledGrammar:
        began = time.perf_counter()
        try:
            backend = self.backend(name)
            if backend.isolated_compiles:  # in a child process, ended if it overruns the timeout
                compiled = self._isolated(name).compile(spec, self.timeout)
            else:
                compiled = backend.compile(spec)
        except GrammarError:
            raise
        except Exception as exc:  # a grammar engine's own error type: still the user's spec, named as such
            raise GrammarError(f"{name} could not compile the {spec.description}: {exc}") from exc
        return CompiledGrammar(backend, compiled, time.perf_counter() - began)


def timeout_message(spec: GrammarSpec, timeout: float) -> str:
    return (f"compiling the {spec.description} took longer than the {timeout:g} s grammar compile timeout; "
            "simplify it or raise grammar_compile_timeout")
