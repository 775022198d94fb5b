"""The engine's failures as the client's errors, one mapping for every generation route (`generation.py`,
`fanout.py`, `completions.py`): a dead engine thread is a 503, a request the engine refuses (its `ValueError`) a
400, and a request that ends in an `ApiError` counts in `deepserve_requests_finished_total` as `abort` when the
shutdown ended it, else as `error`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from deepserve.core.async_engine import EngineDeadError
from deepserve.server.admission import SHUTDOWN_CODE
from deepserve.server.errors import ApiError


@contextlib.contextmanager
def engine_errors() -> Iterator[None]:
    """Around the reading of engine outputs: `EngineDeadError` -> 503, `ValueError` -> 400 (its message)."""
    try:
        yield
    except EngineDeadError:
        raise ApiError(503, "the engine has stopped; the server needs a restart") from None
    except ValueError as exc:  # the engine refused the request
        raise ApiError(400, str(exc)) from None


def failure_reason(error: ApiError) -> str:
    """The finish reason a request that ended in `error` is counted under."""
    return "abort" if error.code == SHUTDOWN_CODE else "error"
