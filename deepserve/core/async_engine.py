"""The asyncio seam: `AsyncEngine` runs the synchronous `EngineCore` on its own thread and streams each
request's outputs to the coroutine that asked for them.

- Commands (add, abort) cross to the engine thread through a thread-safe queue, drained between steps.
- The engine thread posts each step's outputs to the event loop (the steps it made while the loop was busy, in
  one callback), which hands each to its request's stream. Snapshots are cumulative, so a stream whose consumer
  has not read the previous one yet keeps only the newer (vLLM's output collector does the same): a consumer
  that falls behind the engine reads fewer, larger snapshots instead of a backlog of one per step, with the
  same text and tokens in the end. The final output always comes on its own. With a `stream_interval` of N
  (SGLang's `--stream-interval`) the consumer wakes for the first output, then once N tokens have come since
  what it read, and for the final output: one wake-up, one chunk per N tokens.
- Cancelling a consumer (a client that disconnects) aborts its request: the abort is drained before the next
  step, so its pages are free within one step.
This is the only module in `deepserve.core` that knows about asyncio.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from deepserve.core.engine import EngineCore, EngineSnapshot
from deepserve.core.outputs import RequestOutput
from deepserve.core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_STOP = object()


@dataclass(frozen=True, slots=True)
class RequestStats:
    """A finished request's numbers, as the `deepserve_request_finished` hook receives them."""

    request_id: str
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    time_to_first_token: float | None  # seconds from arrival to the first output token
    e2e_latency: float  # seconds from arrival to the last output (or the abort)


class EngineDeadError(RuntimeError):
    """The engine thread failed; every open stream receives this, with the original error as its cause."""


class _Stream:
    """One request's outputs not yet read by its consumer (an event-loop object). An unfinished output put while
    the previous unfinished one is unread replaces it: each is the request's whole state so far. The final output
    and errors queue behind: a consumer that handles the last snapshot and the end apart (the server writes the
    tokens, then an abort's error event) sees both as before; with an `interval` above 1 the final output replaces
    an unread unfinished one instead (it holds every token, and one chunk fewer is the point). An unfinished
    output is ready for the consumer when it is the first, or `interval` tokens past the last one read."""

    __slots__ = ("items", "waiter", "interval", "num_read")

    def __init__(self, interval: int = 1) -> None:
        self.items: collections.deque = collections.deque()
        self.waiter: asyncio.Future | None = None
        self.interval = interval
        self.num_read: int | None = None  # output tokens of the last output read (None: none read yet)

    def put(self, item: RequestOutput | BaseException) -> None:
        items = self.items
        if items and isinstance(item, RequestOutput) and (not item.finished or self.interval > 1) \
                and isinstance(items[-1], RequestOutput):
            items[-1] = item  # (the unread one is unfinished: nothing follows a final output)
        else:
            items.append(item)
        if self.waiter is not None and not self.waiter.done() and self._ready():
            self.waiter.set_result(None)

    def _ready(self) -> bool:
        items = self.items
        if not items:
            return False
        item = items[0]
        if len(items) > 1 or self.interval == 1 or self.num_read is None or not isinstance(item, RequestOutput) \
                or item.finished:
            return True
        return len(item.outputs[0].token_ids) - self.num_read >= self.interval

    async def get(self) -> RequestOutput | BaseException:
        while not self._ready():
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        item = self.items.popleft()
        if isinstance(item, RequestOutput):
            self.num_read = len(item.outputs[0].token_ids)
        return item


class AsyncEngine:
    """`async for out in engine.generate(ids, params): ...`; call `start()` first and `shutdown()` last."""

    def __init__(self, engine: EngineCore, plugin_manager=None) -> None:
        """`engine`: a built engine (`deepserve.build.build_engine`; `deepserve.AsyncEngine.from_pretrained`
        builds one); this object's thread drives it from `start()` on. `plugin_manager`: its
        `deepserve_request_finished` observers see every finished request."""
        self.engine = engine
        self.plugin_manager = plugin_manager
        self._snapshot: EngineSnapshot = engine.snapshot()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._posts: list = []  # posted by the engine thread, not yet delivered on the event loop
        self._posts_lock = threading.Lock()
        self._dead: BaseException | None = None
        # the data-parallel front (`deepserve.distributed.front`) keeps no SWA host slots and takes no session
        parameters = inspect.signature(engine.add_request).parameters.values()
        self._takes_session = any(p.name == "session_id" or p.kind is p.VAR_KEYWORD for p in parameters)

    async def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("AsyncEngine already started")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="deepserve-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Abort what is running, stop the engine thread and the fan-out task."""
        if self._thread is None:
            return
        self._commands.put(("abort", list(self._streams)))
        self._commands.put((_STOP, None))
        await asyncio.to_thread(self._thread.join)  # resumes after the thread's last posts were delivered (FIFO)
        self._thread = None
        self.engine.shutdown()

    def snapshot(self) -> EngineSnapshot:
        """The engine's counters after its latest step (a value the engine thread published; safe from any
        thread)."""
        return self._snapshot

    @property
    def num_open_streams(self) -> int:
        return len(self._streams)

    @property
    def is_dead(self) -> bool:
        """True once the engine thread has failed; `dead_error` is why."""
        return self._dead is not None

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    async def generate(
        self, prompt_token_ids: Sequence[int], params: SamplingParams, request_id: str | None = None,
        prompt: str | None = None, cache_salt: str | None = None, views: bool = False,
        session_id: str | None = None, stream_interval: int = 1,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs (cumulative snapshots) until it finishes. Closing or cancelling the
        iterator aborts the request. `views`: the snapshots' token ids and logprobs are read-only views
        (`outputs.Prefix`: index, slice, len) instead of copies of the whole output; `session_id`: the
        conversation whose SWA host slot the request continues and then replaces (both `EngineCore.add_request`).
        `stream_interval`: after the first output, yield one only once that many tokens have come since the last
        one yielded (the final output always comes)."""
        if type(stream_interval) is not int or stream_interval < 1:
            raise ValueError(f"stream_interval must be an integer >= 1, got {stream_interval!r}")
        if self._thread is None:
            raise RuntimeError("AsyncEngine.start() has not been called")
        if self._dead is not None:
            raise EngineDeadError("the engine thread has stopped") from self._dead
        if session_id is not None and not self._takes_session:
            raise ValueError(f"session_id is not supported by this engine ({type(self.engine).__name__})")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already streaming")
        stream = self._streams[request_id] = _Stream(stream_interval)
        self._commands.put(("add", (request_id, list(prompt_token_ids), params, prompt, cache_salt, views,
                                    session_id)))
        arrived, first_token, last = time.perf_counter(), None, None
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                last, finished = item, item.finished
                if first_token is None and item.outputs[0].token_ids:
                    first_token = time.perf_counter()
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._commands.put(("abort", [request_id]))
            if last is not None:
                self._report_finished(last, finished, arrived, first_token)

    def _report_finished(self, out: RequestOutput, finished: bool, arrived: float, first_token: float | None) -> None:
        if self.plugin_manager is None:
            return
        stats = RequestStats(
            request_id=out.request_id, finish_reason=out.outputs[0].finish_reason if finished else "abort",
            num_prompt_tokens=len(out.prompt_token_ids or ()), num_cached_tokens=out.num_cached_tokens,
            num_output_tokens=len(out.outputs[0].token_ids),
            time_to_first_token=None if first_token is None else first_token - arrived,
            e2e_latency=time.perf_counter() - arrived,
        )
        try:
            self.plugin_manager.hook.deepserve_request_finished(request=out, stats=stats)
        except Exception:  # an observer's bug must not break the stream it observes
            logger.exception("a deepserve_request_finished hook failed for %s", out.request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", [request_id]))

    # -- engine thread -----------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                block = not self.engine.has_unfinished_requests()
                if not self._drain(block):
                    return
                outputs = self.engine.step() if self.engine.has_unfinished_requests() else None
                # published before the outputs, so that whoever sees an output sees the counters that include it
                self._snapshot = self.engine.snapshot()  # one reference assignment: readers see whole values
                if outputs:
                    self._post(outputs)
        except BaseException as exc:  # noqa: BLE001 - reported to every stream, then the thread ends
            logger.exception("deepserve engine thread failed")
            self._dead = exc
            self._post(exc)

    def _drain(self, block: bool) -> bool:
        """Apply pending commands; wait for one when idle. False once asked to stop."""
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return True
        while True:
            kind, payload = command
            if kind is _STOP:
                while self.engine.has_unfinished_requests():
                    self.engine.step()
                return False
            if kind == "add":
                request_id, ids, params, prompt, salt, views, session_id = payload
                try:
                    session = {"session_id": session_id} if session_id is not None else {}
                    self.engine.add_request(request_id, ids, params, prompt=prompt, cache_salt=salt, views=views,
                                            **session)
                except ValueError as exc:
                    self._post([(request_id, exc)])
            elif kind == "abort":
                aborted = self.engine.abort(payload)
                if aborted:
                    self._post(aborted)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _post(self, items) -> None:
        """Hand `items` (a step's outputs, refusals, or the thread's failure) to the event loop. While an earlier
        post is not delivered yet, `items` joins it: one wake-up of the loop delivers every step since."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with self._posts_lock:
            self._posts.append(items)
            if len(self._posts) > 1:
                return  # a delivery is scheduled and has not run yet: it takes these too
        loop.call_soon_threadsafe(self._deliver)

    # -- event loop ------------------------------------------------------------------------------------------
    def _deliver(self) -> None:
        with self._posts_lock:
            posts, self._posts = self._posts, []
        for items in posts:
            self._fan_out(items)

    def _fan_out(self, items) -> None:
        streams = self._streams
        if isinstance(items, BaseException):
            error = EngineDeadError("the engine thread failed")
            error.__cause__ = items
            for stream in streams.values():
                stream.put(error)
            return
        for item in items:
            if isinstance(item, tuple):  # (request_id, error) for a request the engine refused
                request_id, payload = item
            else:
                request_id, payload = item.request_id, item
            stream = streams.get(request_id)
            if stream is not None:
                stream.put(payload)
