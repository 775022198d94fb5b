"""A task that runs beside the app for its whole life (the loop-lag monitor, the engine watchdog)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine


@contextlib.asynccontextmanager
async def running(coro: Coroutine, name: str) -> AsyncIterator[asyncio.Task]:
    """Run `coro` as a task named `name` while the block runs; cancel it and wait for it on the way out."""
    task = asyncio.create_task(coro, name=name)
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
