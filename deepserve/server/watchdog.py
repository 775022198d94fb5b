"""The engine watchdog: an engine that has work but does not get through it turns `/health` to 503.

The engine thread publishes a new `AsyncEngine.snapshot()` after every pass of its loop (a step, or the commands
it drained), so a snapshot that stays the same object while there is work means the thread is stuck, most
likely inside a step. There is work when the latest snapshot has requests running or waiting, or when the
server has started a request since that snapshot appeared (the thread may have taken it and hung in its first
step, before publishing anything). An idle engine, or one whose last request is finished while a slow client
is still reading it, has no work, so it is never taken for a stuck one.

Past `timeout` seconds without a new snapshot while there is work, `stalled` is True (`/health` answers 503)
and an ERROR is logged; when the engine moves again, `stalled` clears and a WARNING says for how long it hung.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from aiohttp import web

from deepserve.core.async_engine import AsyncEngine
from deepserve.server.admission import Admission
from deepserve.server.background import running
from deepserve.server.state import ADMISSION, CONFIG, ENGINE

logger = logging.getLogger(__name__)


class EngineWatchdog:
    """Call `check()` now and then (`run()` does, every quarter of `timeout`, at most every second)."""

    def __init__(self, engine: AsyncEngine, admission: Admission, timeout: float) -> None:
        self.engine, self.admission, self.timeout = engine, admission, timeout
        self.stalled = False
        self._snapshot = engine.snapshot()
        self._num_started = admission.num_started
        self._since = time.monotonic()  # when `_snapshot` was first seen

    def seconds_without_progress(self) -> float:
        return time.monotonic() - self._since

    def check(self) -> None:
        snapshot, now = self.engine.snapshot(), time.monotonic()
        busy = snapshot.num_requests_running + snapshot.num_requests_waiting > 0 or \
            self.admission.num_started != self._num_started
        if snapshot is not self._snapshot or not busy:
            if self.stalled:
                logger.warning("deepserve: the engine moved again after %.1f s without a step; /health answers 200",
                               now - self._since)
            self._snapshot, self._num_started, self._since, self.stalled = \
                snapshot, self.admission.num_started, now, False
            return
        if not self.stalled and now - self._since > self.timeout:
            self.stalled = True
            logger.error("deepserve: no engine step has completed for %.1f s (--engine-step-timeout %g s) with "
                         "%d streams open; /health answers 503", now - self._since, self.timeout,
                         self.engine.num_open_streams)

    async def run(self) -> None:
        interval = min(self.timeout / 4, 1.0)
        while True:
            await asyncio.sleep(interval)
            self.check()


WATCHDOG = web.AppKey("deepserve_watchdog", EngineWatchdog)


async def watchdog_context(app: web.Application) -> AsyncIterator[None]:
    watchdog = app[WATCHDOG] = EngineWatchdog(app[ENGINE], app[ADMISSION], app[CONFIG].engine_step_timeout)
    async with running(watchdog.run(), "deepserve-watchdog"):
        yield
