"""The built-in endpoints. `ROUTES` is the one table both the router and `/openapi.json` are built from."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from aiohttp import web

from deepserve.server.completions import handle_completions
from deepserve.server.errors import ApiError
from deepserve.server.fanout import serve_choices
from deepserve.server.generation import serve_prepared
from deepserve.server.http import json_type, read_json_object
from deepserve.server.metrics import CONTENT_TYPE
from deepserve.server.openapi import build_openapi
from deepserve.server.pool import run_in_pool
from deepserve.server.recipe import CHAT, MESSAGES, RESPONSES, Protocol
from deepserve.server.tokenize import detokenize, tokenize
from deepserve.server.state import ADMISSION, CONFIG, ENGINE, METRICS, MODEL, PLUGIN_ROUTES, RECIPE, ModelInfo
from deepserve.server.validation import validate
from deepserve.server.watchdog import WATCHDOG


def require_model(body: dict[str, Any], name: str) -> None:
    """400 when `model` is missing or not a string, 404 when it is not the model this server serves."""
    model = body.get("model")
    if model is None:
        raise ApiError(400, "'model' is required", param="model")
    if not isinstance(model, str):
        raise ApiError(400, f"'model' must be a string, got {json_type(model)}", param="model")
    if model != name:
        raise ApiError(404, f"the model '{model}' does not exist: this server serves '{name}'", param="model",
                       code="model_not_found")


async def _recipe_endpoint(request: web.Request, protocol: Protocol) -> web.StreamResponse:
    with request.app[ADMISSION].admit() as ticket:
        raw, body = await read_json_object(request)
        model = request.app[MODEL]
        require_model(body, model.name)
        validate(protocol.name, body)
        prepared = await run_in_pool(request.app, request.app[RECIPE].prepare, protocol, raw, body, model)
        return await (serve_choices if prepared.n > 1 else serve_prepared)(request, prepared, ticket)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _recipe_endpoint(request, CHAT)


async def responses(request: web.Request) -> web.StreamResponse:
    return await _recipe_endpoint(request, RESPONSES)


async def messages(request: web.Request) -> web.StreamResponse:
    return await _recipe_endpoint(request, MESSAGES)


async def completions(request: web.Request) -> web.StreamResponse:
    with request.app[ADMISSION].admit() as ticket:
        _, body = await read_json_object(request)
        require_model(body, request.app[MODEL].name)
        validate("completions", body)
        return await handle_completions(request, body, ticket)


def model_card(model: ModelInfo) -> dict[str, Any]:
    """One model, readable by OpenAI's client (`id`, `object`, `created`, `owned_by`) and Anthropic's (`type`,
    `display_name`, `created_at`)."""
    created_at = datetime.fromtimestamp(model.created, timezone.utc).isoformat().replace("+00:00", "Z")
    return {"id": model.name, "object": "model", "created": model.created, "owned_by": "deepserve",
            "max_model_len": model.max_model_len, "type": "model", "display_name": model.name,
            "created_at": created_at}


async def list_models(request: web.Request) -> web.Response:
    name = request.app[MODEL].name
    return web.json_response({"object": "list", "data": [model_card(request.app[MODEL])], "has_more": False,
                              "first_id": name, "last_id": name})


async def get_model(request: web.Request) -> web.Response:
    model = request.app[MODEL]
    if request.match_info["model_id"] != model.name:
        raise ApiError(404, f"the model '{request.match_info['model_id']}' does not exist: this server serves "
                       f"'{model.name}'", param="model_id", code="model_not_found")
    return web.json_response(model_card(model))


async def health(request: web.Request) -> web.Response:
    """200 while serving; 503 once draining for shutdown, when the engine thread has died, or while the watchdog
    sees an engine with work that completes no step."""
    if request.app[ADMISSION].draining:
        return web.json_response({"status": "draining"}, status=503)
    if request.app[ENGINE].is_dead:
        return web.json_response({"status": "engine stopped"}, status=503)
    watchdog = request.app[WATCHDOG]
    if watchdog.stalled:
        return web.json_response({"status": "engine stalled", "seconds_without_a_step":
                                  round(watchdog.seconds_without_progress(), 1)}, status=503)
    return web.json_response({"status": "ok", "model": request.app[MODEL].name,
                              "num_open_requests": request.app[ADMISSION].num_open})


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[METRICS].render(), headers={"Content-Type": CONTENT_TYPE})


async def openapi(request: web.Request) -> web.Response:
    app = request.app
    return web.json_response(build_openapi(app, app[CONFIG], ROUTES, app[PLUGIN_ROUTES]))


@dataclass(frozen=True, slots=True)
class Route:
    method: str
    path: str
    handler: Any
    operation: str  # the key of its description in `deepserve.server.openapi.OPERATIONS`


ROUTES = (
    Route("POST", "/v1/chat/completions", chat_completions, "chat"),
    Route("POST", "/v1/completions", completions, "completions"),
    Route("POST", "/v1/responses", responses, "responses"),
    Route("POST", "/v1/messages", messages, "messages"),
    Route("GET", "/v1/models", list_models, "models"),
    Route("GET", "/v1/models/{model_id}", get_model, "model"),
    Route("GET", "/health", health, "health"),
    Route("HEAD", "/health", health, "health_head"),  # probes and load balancers that only HEAD
    Route("GET", "/metrics", metrics, "metrics"),
    Route("HEAD", "/metrics", metrics, "metrics_head"),
    Route("GET", "/openapi.json", openapi, "openapi"),
    Route("POST", "/tokenize", tokenize, "tokenize"),  # vLLM's, outside /v1/ as vLLM serves them
    Route("POST", "/detokenize", detokenize, "detokenize"),
)


def add_routes(app: web.Application) -> None:
    for route in ROUTES:
        app.router.add_route(route.method, route.path, route.handler)
