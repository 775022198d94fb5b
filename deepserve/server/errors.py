"""Errors as each protocol spells them, and the middlewares that turn every failure into one.

A handler raises `ApiError(status, message, param=...)`; `error_middleware` renders it as OpenAI's error JSON
(`{"error": {"message", "type", "param", "code"}}`) or, under `/v1/messages`, as Anthropic's
(`{"type": "error", "error": {"type", "message"}}`). aiohttp's own HTTP errors (unknown route, wrong method,
body too large) get the same treatment, and an unexpected exception becomes a logged 500 without details.
Client errors are logged quietly: an `ApiError` not at all (the access log has its status), a request aiohttp
cannot even parse (a NUL byte in a header, a bad Content-Length) as one INFO line instead of aiohttp's ERROR
with a traceback (`quiet_client_errors`).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
from collections.abc import Awaitable, Callable, Mapping

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

logger = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

#: error `type` per status; the names are Anthropic's, which OpenAI's clients accept as well
ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    405: "invalid_request_error", 413: "request_too_large", 422: "invalid_request_error", 429: "rate_limit_error",
    503: "overloaded_error",
}


class ApiError(Exception):
    """A request that cannot be served: `status`, a message for the client, optionally the offending field."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = dict(headers or {})


def sampling_error(exc: Exception) -> ApiError:
    """A 400 from a `SamplingParams` validation error, whose message starts with the field's name."""
    match = re.match(r"[a-z_]+", str(exc))
    return ApiError(400, str(exc), param=match.group(0) if match else None)


def is_anthropic_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_body(path: str, status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """The error JSON of the protocol served at `path`."""
    if is_anthropic_path(path):
        return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}
    kind = ERROR_TYPES.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(path: str, error: ApiError) -> web.Response:
    body = error_body(path, error.status, error.message, error.param, error.code)
    return web.json_response(body, status=error.status, headers=error.headers)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as error:
        return error_response(request.path, error)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers = {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "retry-after")}
        message = _http_message(request, exc)
        return error_response(request.path, ApiError(exc.status, message, headers=headers))
    except ConnectionError:
        raise  # the client is gone: there is nobody to answer
    except Exception:
        logger.exception("deepserve: unhandled error in %s %s", request.method, request.path)
        return error_response(request.path, ApiError(500, "internal server error (logged on the server)"))


def _http_message(request: web.Request, exc: web.HTTPException) -> str:
    if exc.status == 404:
        return f"no route for {request.method} {request.path} (GET /openapi.json lists the routes)"
    if exc.status == 405:
        return f"method {request.method} is not allowed for {request.path}"
    if exc.status == 413:
        return f"request body too large: {exc.text}"
    return exc.text or exc.reason


def _digest(key: str) -> bytes:
    # Hashing first makes the comparison's time independent of the key's length as well as its content.
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def presented_api_keys(request: web.Request) -> list[str]:
    """The keys a client sent: `Authorization: Bearer KEY` (OpenAI) and `x-api-key: KEY` (Anthropic)."""
    keys = []
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        keys.append(token.strip())
    if request.headers.get("x-api-key"):
        keys.append(request.headers["x-api-key"].strip())
    return keys


def auth_middleware(api_key: str) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """Require `api_key` on every `/v1/` route, compared in constant time; other routes stay open."""
    expected = _digest(api_key)

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith("/v1/"):
            keys = presented_api_keys(request)
            if not keys:
                raise ApiError(401, "missing API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                               code="missing_api_key", headers={"WWW-Authenticate": "Bearer"})
            matches = [hmac.compare_digest(_digest(key), expected) for key in keys]  # compare all, no short-cut
            if not any(matches):
                raise ApiError(401, "invalid API key", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return auth


class _ClientErrorFilter(logging.Filter):
    """On aiohttp's server logger: a 4xx parse error (the client's mistake; it got its 400) becomes one INFO line
    without a traceback, dropped where INFO is not logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError) or not 400 <= (exc.code or 0) < 500:
            return True
        detail = exc.message.strip().split("\n", 1)[0].rstrip(":") if exc.message else type(exc).__name__
        record.msg, record.args = "deepserve: answered %d to a malformed HTTP request (%s; %s)", \
            (exc.code, detail, record.getMessage())
        record.levelno, record.levelname = logging.INFO, "INFO"
        record.exc_info = record.exc_text = None
        return logging.getLogger(record.name).isEnabledFor(logging.INFO)


_CLIENT_ERROR_FILTER = _ClientErrorFilter()


def quiet_client_errors() -> None:
    """Install the filter on aiohttp's server logger (once per process, whatever the number of apps)."""
    server_logger = logging.getLogger("aiohttp.server")
    if _CLIENT_ERROR_FILTER not in server_logger.filters:
        server_logger.addFilter(_CLIENT_ERROR_FILTER)
