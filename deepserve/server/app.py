"""The app factory: routes, middlewares, plugin routes, and the engine's life in one `cleanup_ctx`.

`create_app(config)` builds the app without touching the model; the engine is loaded, started and stopped
by `_engine_context` when the app starts and cleans up, and the prompt pool, the loop-lag monitor and the engine
watchdog live as long. Shutdown first drains: new requests get 503 while the in-flight ones run to completion
(up to `drain_timeout`); then the rest are aborted in the engine and end with the protocol's error event, and
the engine stops.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import pluggy
from aiohttp import web

from deepserve.async_api import AsyncEngine
from deepserve.core.plugins import collect_registrations, make_plugin_manager
from deepserve.server.config import ServerConfig
from deepserve.server.errors import auth_middleware, error_middleware, quiet_client_errors
from deepserve.server.loop_lag import lag_monitor_context
from deepserve.server.metrics import ServerMetrics
from deepserve.server.pool import pool_context
from deepserve.server.recipe import RecipeCodec
from deepserve.server.routes import add_routes
from deepserve.server.watchdog import watchdog_context
from deepserve.server.state import (ADMISSION, CONFIG, ENGINE, METRICS, MODEL, PLUGIN_ROUTES, RECIPE, Admission,
                                    ModelInfo)

logger = logging.getLogger(__name__)

EngineFactory = Callable[[], AsyncEngine]
#: how long aborted requests get to send their error event (one engine step, unless the engine hangs)
_ABORT_GRACE_SECONDS = 5.0


def create_app(config: ServerConfig, *, plugin_manager: pluggy.PluginManager | None = None,
               engine_factory: EngineFactory | None = None) -> web.Application:
    """The deepserve app for `config`. Routes from `deepserve_register_routes` plugins are added now (each
    factory is called with this app); `engine_factory` (default: `AsyncEngine.from_pretrained(config.model,
    **config.engine_options)`) runs in a thread when the app starts."""
    quiet_client_errors()
    middlewares = [error_middleware] + ([auth_middleware(config.api_key)] if config.api_key else [])
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=middlewares)
    app[CONFIG] = config
    app[METRICS] = ServerMetrics(config.model_name)
    app[PLUGIN_ROUTES] = []
    add_routes(app)
    _add_plugin_routes(app, plugin_manager if plugin_manager is not None else make_plugin_manager())
    factory = engine_factory or (lambda: AsyncEngine.from_pretrained(config.model, **config.engine_options))
    app.cleanup_ctx.extend([_engine_context(factory), pool_context, lag_monitor_context, watchdog_context])
    app.on_shutdown.append(_drain)
    return app


def _route_keys(app: web.Application) -> set[tuple[str, str]]:
    return {(route.method, route.resource.canonical) for route in app.router.routes() if route.resource}


def _add_plugin_routes(app: web.Application, pm: pluggy.PluginManager) -> None:
    for name, factory in collect_registrations(pm, "deepserve_register_routes").items():
        before = _route_keys(app)
        factory(app)
        app[PLUGIN_ROUTES].extend((name, method, path) for method, path in sorted(_route_keys(app) - before))


def _engine_context(factory: EngineFactory) -> Callable[[web.Application], AsyncIterator[None]]:
    async def engine_context(app: web.Application) -> AsyncIterator[None]:
        config = app[CONFIG]
        engine = await asyncio.to_thread(factory)
        await engine.start()
        try:
            app[ENGINE] = engine
            app[MODEL] = await asyncio.to_thread(ModelInfo.from_engine, engine, config)
            app[RECIPE] = RecipeCodec(config.model, config.model_name, config.default_thinking_mode,
                                       config.default_max_tokens)
            if app[RECIPE].unavailable:
                logger.warning("deepserve: chat endpoints disabled: %s", app[RECIPE].unavailable)
            capacity = engine.engine.scheduler.max_num_seqs + config.max_waiting_requests
            app[ADMISSION] = Admission(capacity, config.retry_after_seconds)
            app[METRICS].engine, app[METRICS].admission = engine, app[ADMISSION]
            logger.info("deepserve: serving %s as '%s' (context %d tokens, at most %d open requests)",
                        config.model, config.model_name, app[MODEL].max_model_len, capacity)
            yield
        finally:
            await engine.shutdown()

    return engine_context


async def _drain(app: web.Application) -> None:
    """Shutdown, first part: refuse new requests, let the open ones run for `drain_timeout`, then abort the rest
    in the engine (each handler ends its response with the protocol's error event, or a 503) and wait for them
    to end. aiohttp then closes the connections and the cleanup stops the engine."""
    admission, timeout = app.get(ADMISSION), app[CONFIG].drain_timeout
    if admission is None or await admission.drain(timeout):
        return
    num_open = admission.num_open
    num_aborted = admission.abort_open(app[ENGINE].abort)
    logger.warning("deepserve: %d requests still open after the %g s drain: aborting the %d the engine has",
                   num_open, timeout, num_aborted)
    if not await admission.drain(_ABORT_GRACE_SECONDS):
        logger.warning("deepserve: %d requests did not end within %g s of their abort; their connections close "
                       "without an error event", admission.num_open, _ABORT_GRACE_SECONDS)


def run_server(config: ServerConfig, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve until SIGINT/SIGTERM on uvloop; handlers are cancelled when their client disconnects."""
    import uvloop

    # shutdown_timeout: `_drain` has already waited for the generation requests; what is left is cancelled soon
    web.run_app(create_app(config), host=host, port=port, loop=uvloop.new_event_loop(), handler_cancellation=True,
                shutdown_timeout=1.0)
