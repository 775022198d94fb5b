"""The admission gate: how many generation requests are open, and the drain that ends them at shutdown.

Each admitted request holds a `Ticket` and calls `ticket.start(request_id)` just before the engine sees it.
At shutdown (`deepserve.server.app`'s `on_shutdown`): `drain` refuses new requests (503) and waits up to
`--drain-timeout` for the open ones; then `abort_open` stops any request from starting and aborts the started
ones in the engine. A handler whose request is aborted ends it with `shutdown_error()`: the protocol's error
event in a stream that has started, else a 503 JSON error.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator

from deepserve.server.errors import ApiError

#: the `code` of every error the shutdown gives (OpenAI's error JSON; Anthropic's has no code)
SHUTDOWN_CODE = "server_shutting_down"


def shutdown_error(retry_after: str | None = None) -> ApiError:
    """A request the shutdown refused or aborted."""
    return ApiError(503, "the server is shutting down: this request was not finished; retry on another replica",
                    code=SHUTDOWN_CODE, headers={"Retry-After": retry_after} if retry_after else None)


class Ticket:
    """One admitted request. `request_ids` gains each engine request `start` hands to the engine (a completions
    request with several prompts makes one per prompt, `n` > 1 one per choice). `weight`: how many engine
    requests it counts for against the capacity (1 when admitted; `claim` raises it once the body is read)."""

    __slots__ = ("admission", "request_ids", "weight")

    def __init__(self, admission: Admission) -> None:
        self.admission, self.request_ids, self.weight = admission, [], 1

    def claim(self, num_requests: int, what: str = "choices", param: str | None = None) -> None:
        """Count this ticket as `num_requests` engine requests (its prompts times `n`): a 429 like `admit`'s when
        they do not fit beside the open ones, a 400 when they could never fit."""
        admission = self.admission
        if num_requests > admission.capacity:
            raise ApiError(400, f"this request makes {num_requests} {what} (engine requests), more than the "
                           f"server holds at once ({admission.capacity}); split it", param=param)
        others = admission.num_open - self.weight
        if num_requests > self.weight and others + num_requests > admission.capacity:
            admission.num_rejected += 1
            raise admission.too_many(others, num_requests)
        admission.num_open += num_requests - self.weight
        self.weight = num_requests

    def start(self, request_id: str) -> None:
        """Call right before the engine sees the request (no await in between, so an abort cannot miss it);
        503 once the shutdown has aborted what was open."""
        if self.admission.aborting:
            raise shutdown_error(self.admission.retry_after)
        self.request_ids.append(request_id)
        self.admission.num_started += 1


class Admission:
    """Counts open generation requests in engine requests (`num_open`: a request with several prompts or `n` > 1
    counts each, `Ticket.claim`). Past `capacity` (the engine's `max_num_seqs` plus the waiting-queue bound) a
    new one gets 429 with `Retry-After`; once draining for shutdown, 503. `num_started` counts the requests that
    reached the engine (the watchdog reads it)."""

    def __init__(self, capacity: int, retry_after_seconds: int) -> None:
        self.capacity, self.retry_after = capacity, str(retry_after_seconds)
        self.num_rejected = 0
        self.num_started = 0
        self.num_open = 0
        self.draining = False
        self.aborting = False
        self._open: set[Ticket] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    def too_many(self, num_open: int, num_asked: int = 1) -> ApiError:
        asked = f"; this one asks for {num_asked}" if num_asked > 1 else ""
        return ApiError(429, f"too many requests: {num_open} are open, the limit is {self.capacity} (running plus "
                        f"waiting){asked}; retry later", code="rate_limit_exceeded",
                        headers={"Retry-After": self.retry_after})

    @contextlib.contextmanager
    def admit(self) -> Iterator[Ticket]:
        if self.draining:
            raise shutdown_error(self.retry_after)
        if self.num_open >= self.capacity:
            self.num_rejected += 1
            raise self.too_many(self.num_open)
        ticket = Ticket(self)
        self._open.add(ticket)
        self.num_open += ticket.weight
        self._idle.clear()
        try:
            yield ticket
        finally:
            self._open.discard(ticket)
            self.num_open -= ticket.weight
            if not self._open:
                self._idle.set()

    async def drain(self, timeout: float) -> bool:
        """Refuse new requests and wait up to `timeout` seconds for the open ones; True when none is left."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def abort_open(self, abort: Callable[[str], None]) -> int:
        """From now on no request starts; `abort(request_id)` for each open one that has. How many."""
        self.draining = self.aborting = True
        started = [request_id for ticket in self._open for request_id in ticket.request_ids]
        for request_id in started:
            abort(request_id)
        return len(started)
