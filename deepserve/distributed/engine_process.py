"""One engine in a process of its own, behind the data-parallel front (vLLM's multiprocessing engine core, the
layout its `AsyncLLM` runs): `engine_process` / `--engine-process`.

In one process the server's per-token Python (SSE writes, JSON, the hop to each stream) and the engine's thread
share one GIL. Here the engine (scheduler, KV pages, runner, detokenizer) steps in a child process, and the
caller's process keeps the front: `DataParallelEngine` with a world of one rank, which speaks `EngineCore`'s calls,
so `LLM`, `AsyncEngine` and the server drive it unchanged. Nothing is new on the wire: the child runs the rank
body (`rank.serve`, the rank loop without a process group) and the messages are the ranks' (`messages.py`),
over an `ipc://` socket in the temporary directory (its file removed once the child is connected).

`make_engine` builds the engine in the child: a picklable callable (a module-level function, or a
`functools.partial` of one) returning a `rank.RankEngine`. `deepserve.build` passes one that builds from the
engine config; a benchmark may pass its own. Faults are the front's: a child that fails or ends makes the next
`step()` raise `RankError` naming it, after it has been stopped; a child whose parent is gone stops by itself.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import tempfile
import uuid
import weakref
from collections.abc import Callable, Sequence

from deepserve.core.grammar_compiler import GrammarCompiler

from .front import DataParallelEngine, bind_router
from .launch import RankContext
from .rank import RankEngine, serve
from .router import RankLoad, Router

PROCESS_NAME = "deepserve-engine"


class SoleRank(Router):
    """Every request goes to the one rank."""

    def choose(self, request_id: str, prompt_token_ids: Sequence[int], loads: Sequence[RankLoad]) -> int:
        return 0


def start_engine_process(make_engine: Callable[[], RankEngine], *, vocab_size: int,
                         grammars: GrammarCompiler | None = None, timeout: float = 120.0,
                         start_timeout: float = 600.0) -> DataParallelEngine:
    """Spawn the engine's process and return the front that drives it, once the engine is built and ready.

    `vocab_size`: the model's (prompt checks); `grammars`: the front's own compiler, which validates
    constrained requests before the engine compiles them (see `front.py`), None to refuse them; `timeout`:
    seconds the child waits for a front that does not read its outputs before it takes it for gone;
    `start_timeout`: seconds the build may take. A child that fails to build raises `RankError` here, and no
    process is left."""
    path = f"{tempfile.gettempdir()}/deepserve-engine-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    endpoint = f"ipc://{path}"
    socket = bind_router(endpoint)
    # no process group: a lone rank has nobody to agree with (dist_init_method and dist_backend are unused)
    context = RankContext(0, 1, endpoint, "", "none", timeout)
    proc = multiprocessing.get_context("spawn").Process(target=run_engine_process, args=(make_engine, context),
                                                        name=PROCESS_NAME, daemon=True)
    proc.start()
    try:
        front = DataParallelEngine(socket, 1, SoleRank(), [proc], vocab_size=vocab_size,
                                   start_timeout=start_timeout, grammars=grammars)
    except BaseException:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        socket.close(linger=0)
        raise
    finally:  # the child is connected (or gone): the socket's file is not needed any more, nor left behind
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    # a front dropped (or left at interpreter exit) without shutdown(): its child would ignore the SIGTERM that
    # multiprocessing sends daemons at exit and keep the exit waiting; kill it instead
    weakref.finalize(front, _kill_if_alive, proc)
    return front


def run_engine_process(make_engine: Callable[[], RankEngine], context: RankContext) -> None:
    """The child's body: build the engine and serve the front until it says stop."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(message)s")
    # Ctrl-C or a supervisor's SIGTERM reaches the whole process group: the server drains its streams and then
    # stops this process through the front, so it must not die under them (as a rank, deepserve.build.serve_rank)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    serve(context, make_engine)


def _kill_if_alive(proc) -> None:
    if proc.is_alive():
        proc.kill()
        proc.join(5)
