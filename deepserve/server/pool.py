"""The app's thread pool: work that would hold the event loop (rendering a chat prompt, tokenizing, checking a
long prompt's ids) runs here, so streams, `/health` and `/metrics` are served while it runs.

The pool is made when the app starts and shut down when it cleans up (`pool_context`, a `cleanup_ctx`).
Tokenizers that release the GIL (deepseek-recipe's, `TextEncoder`'s) then run truly in parallel with the loop;
pure Python work still shares the GIL, but in slices the interpreter switches between, not one block.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from aiohttp import web

T = TypeVar("T")

POOL = web.AppKey("deepserve_pool", ThreadPoolExecutor)


async def pool_context(app: web.Application) -> AsyncIterator[None]:
    pool = ThreadPoolExecutor(thread_name_prefix="deepserve-prompt")
    app[POOL] = pool
    try:
        yield
    finally:
        # a job still running (its handler was cancelled) finishes on its thread; queued ones are dropped
        await asyncio.to_thread(pool.shutdown, wait=True, cancel_futures=True)


async def run_in_pool(app: web.Application, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on the app's pool. Cancelling the caller stops waiting; a job already running completes."""
    return await asyncio.get_running_loop().run_in_executor(app[POOL], fn, *args)
