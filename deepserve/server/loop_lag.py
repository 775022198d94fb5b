"""Event-loop lag: how late the loop runs a timer that was due. Every stream, `/health` and `/metrics` waits
for the loop, so lag is what every client feels when something holds it (a slow handler, a long pure-Python
job, a C call that keeps the GIL).

`LoopLagMonitor.run` sleeps `interval` seconds at a time and records how much later than asked it woke:
the histogram `deepserve_event_loop_lag_seconds` on the app's `/metrics`, and a WARNING once a wake-up is
more than `warn_after` seconds late. `lag_monitor_context` runs it for the app's lifetime.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from aiohttp import web
from prometheus_client import CollectorRegistry, Histogram

from deepserve.server.background import running
from deepserve.server.state import METRICS

logger = logging.getLogger(__name__)

#: a wake-up later than this is logged as a WARNING
LAG_WARNING_SECONDS = 0.5
_INTERVAL_SECONDS = 0.1
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class LoopLagMonitor:
    """Measures the running loop's lag into `histogram` (registered in `registry`) while `run()` runs."""

    def __init__(self, registry: CollectorRegistry, interval: float = _INTERVAL_SECONDS,
                 warn_after: float = LAG_WARNING_SECONDS) -> None:
        self.interval, self.warn_after = interval, warn_after
        self.histogram = Histogram("deepserve_event_loop_lag_seconds", "How much later than due the event loop "
                                   "ran a periodic timer (what every request waited for meanwhile)",
                                   buckets=_BUCKETS, registry=registry)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.interval
            await asyncio.sleep(self.interval)
            lag = max(0.0, loop.time() - due)
            self.histogram.observe(lag)
            if lag > self.warn_after:
                logger.warning("deepserve: the event loop was held for %.2f s: streams, /health and /metrics "
                               "waited that long (a blocking call on the loop?)", lag)


async def lag_monitor_context(app: web.Application) -> AsyncIterator[None]:
    async with running(LoopLagMonitor(app[METRICS].registry).run(), "deepserve-loop-lag"):
        yield
