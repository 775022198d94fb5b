"""Grammar compiles that can be stopped: for backends whose compile cannot be interrupted (a thread cannot be
killed), `CompileProcesses` runs each compile in a child process that builds the backend once and is ended when
a compile overruns its timeout, which gives its CPU and memory back at once.

A backend opts in with `GrammarBackend.isolated_compiles = True`; its compiled value must pickle. Each child
serves one compile at a time; when every child is busy a new one starts (up to `max_processes`), so a
pathological grammar holds one child for at most the timeout and never queues the others' compiles behind it.
Children start with the "spawn" method (no copy of the parent's threads); a killed child is replaced on demand.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
from collections.abc import Callable
from typing import Any

from deepserve.core.structured import GrammarBackend, GrammarError, GrammarSpec, GrammarTimeout, TokenizerInfo

logger = logging.getLogger(__name__)


def _serve(conn, factory: Callable[[TokenizerInfo], GrammarBackend], tokenizer: TokenizerInfo) -> None:
    """A child's loop: build the backend once, then compile each spec it receives until the pipe closes."""
    try:
        backend = factory(tokenizer)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which names it
        conn.send(("error", f"the grammar backend failed to start in its compile process: {exc}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            spec = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", backend.compile(spec)))
        except GrammarError as exc:
            conn.send(("error", str(exc)))
        except BaseException as exc:  # noqa: BLE001 - a grammar engine's own error: the user's spec
            conn.send(("error", f"{backend.name} could not compile the {spec.description}: {exc}"))


class _Child:
    def __init__(self, factory, tokenizer: TokenizerInfo, start_timeout: float) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child_conn, factory, tokenizer), daemon=True,
                                   name="deepserve-grammar-compile")
        self.process.start()
        child_conn.close()
        if not self.conn.poll(start_timeout):
            self.stop()
            raise GrammarError(f"the grammar compile process did not start within {start_timeout:g} s")
        status, message = self.conn.recv()
        if status != "ready":
            self.stop()
            raise GrammarError(message)

    def stop(self) -> None:
        self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


class CompileProcesses:
    """Child processes compiling for one backend. `compile` is called from the compiler's threads."""

    def __init__(self, factory: Callable[[TokenizerInfo], GrammarBackend], tokenizer: TokenizerInfo,
                 max_processes: int = 4, start_timeout: float = 60.0) -> None:
        self.factory, self.tokenizer = factory, tokenizer
        self.max_processes, self.start_timeout = max_processes, start_timeout
        self._idle: list[_Child] = []
        self._num_children = 0
        self._lock = threading.Condition()
        self.num_killed = 0  # children ended because a compile overran its timeout
        self._starting = 0  # children being started in the background: a compile waits for one of those

    def prestart(self) -> None:
        """Start one child in the background now (a child's start, mostly imports, takes seconds), so the first
        compile does not wait for it."""
        with self._lock:
            if self._idle or self._num_children:
                return
            self._num_children += 1
            self._starting += 1

        def start() -> None:
            child = None
            try:
                child = _Child(self.factory, self.tokenizer, self.start_timeout)
            except BaseException as exc:  # noqa: BLE001 - the first compile starts one again and says why
                logger.warning("a grammar compile process did not start: %s", exc)
            with self._lock:
                self._starting -= 1
                if child is None:
                    self._num_children -= 1
                else:
                    self._idle.append(child)
                self._lock.notify_all()

        threading.Thread(target=start, name="deepserve-grammar-prestart", daemon=True).start()

    def compile(self, spec: GrammarSpec, timeout: float) -> Any:
        """The compiled value of `spec`; GrammarError naming the problem, or the timeout (its child is ended)."""
        child = self._take()
        try:
            child.conn.send(spec)
            if not child.conn.poll(timeout):
                raise TimeoutError
            status, value = child.conn.recv()
        except TimeoutError:
            self._discard(child, killed=True)
            raise GrammarTimeout(f"compiling the {spec.description} took longer than the {timeout:g} s grammar "
                               "compile timeout; it was stopped: simplify it or raise grammar_compile_timeout") from None
        except (EOFError, OSError) as exc:  # the child died (out of memory, a crash in the grammar engine)
            self._discard(child)
            raise GrammarError(f"the grammar compile process ended while compiling the {spec.description} "
                               f"({type(exc).__name__})") from None
        self._give_back(child)
        if status != "ok":
            raise GrammarError(value)
        return value

    def _take(self) -> _Child:
        with self._lock:
            while not self._idle and (self._starting or self._num_children >= self.max_processes):
                self._lock.wait()
            if self._idle:
                return self._idle.pop()
            self._num_children += 1
        try:
            return _Child(self.factory, self.tokenizer, self.start_timeout)
        except BaseException:
            with self._lock:
                self._num_children -= 1
                self._lock.notify_all()
            raise

    def _give_back(self, child: _Child) -> None:
        with self._lock:
            self._idle.append(child)
            self._lock.notify_all()

    def _discard(self, child: _Child, killed: bool = False) -> None:
        child.stop()
        with self._lock:
            self._num_children -= 1
            self.num_killed += killed
            self._lock.notify_all()
        if killed:
            logger.warning("a grammar compile overran its timeout: its compile process was ended")

    def shutdown(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for child in idle:
            child.stop()
