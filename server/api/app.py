"""create_app(config): the Starlette app; its lifespan owns the engine, Redis and registries."""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware

from server.api import (adapter_pins, adapter_routes, admin_adapter_routes, admin_routes, admin_views, lora_routes,
                        openai_routes, openapi, ops_routes, pages, shared_adapter_routes, source_credential_routes,
                        tokenize_routes)
from server.api.adapter_pins import pin_startup_adapters
from server.api.auth import SETTLE_AT_EXIT_SECONDS, AdminAuthThrottle
from server.api.body import IgnoredFieldsHeader
from server.api.bootstrap import StartupInfo, bootstrap
from server.api.engine_watch import exit_when_engine_dies
from server.api.errors import EXCEPTION_HANDLERS
from server.api.housekeeping import run_upkeep
from server.api.response_headers import ReplicaHeader, SecurityHeaders
from server.api.state import ServerState
from server.api.unread_body import CloseUnreadBody
from server.config import ServerConfig
from server.engine_mode import CoreStarter

log = logging.getLogger(__name__)


def _base_url(config: ServerConfig) -> str:
    host = "127.0.0.1" if config.host in ("0.0.0.0", "::", "") else config.host
    return f"http://{host}:{config.port}"


def create_app(config: ServerConfig, on_ready: Callable[[StartupInfo], None] | None = None,
               on_engine_death: Callable[[], None] | None = None,
               starter: CoreStarter | None = None) -> Starlette:
    """`on_ready` gets the start-up info (tokens, demo key; None in a front end other than the first of
    several) once the server can serve; `on_engine_death`
    (--engine-process separate) stops the server once the engine core died (server.api.engine_watch);
    `starter` starts engine cores (its owner closes it: `serve`'s, with the core it reserved); None: the
    app makes one of its own, closed when it stops."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as owned:
            cores = starter
            if cores is None:
                cores = CoreStarter()
                owned.push_async_callback(run_in_threadpool, cores.close)
            async with _served(app, cores):
                yield

    @contextlib.asynccontextmanager
    async def _served(app: Starlette, cores: CoreStarter) -> AsyncIterator[None]:
        state = await run_in_threadpool(ServerState.build, config, cores)
        try:
            state.engine.start()
            state.settlements.start()
            # Per process: its own requests' usage settlement and the console's history of the engine.
            background = [asyncio.create_task(state.settlements.run()),
                          asyncio.create_task(state.history.run(state.engine.stats))]
            info = None
            if config.runs_singletons:  # once per server: front end 0 of several (server.front_ends)
                state.retirements.start()
                info = await run_in_threadpool(bootstrap, state, _base_url(config))
                await pin_startup_adapters(state)
                background.append(asyncio.create_task(run_upkeep(state)))
            if on_engine_death is not None and config.engine_process == "separate":
                background.append(asyncio.create_task(exit_when_engine_dies(state.engine, on_engine_death)))
            app.state.lp = state
            app.state.startup = info
            if on_ready is not None:
                on_ready(info)
            # After the ready line, so it costs the start-up nothing: the first constrained request
            # then finds a warm compile process instead of waiting ~13 s for xgrammar's imports.
            state.grammar_compiler.prestart()
            yield
            for task in background:
                task.cancel()
        finally:
            await run_in_threadpool(state.settlements.stop, SETTLE_AT_EXIT_SECONDS)
            await run_in_threadpool(state.close)

    routes = [*openai_routes.ROUTES, *tokenize_routes.ROUTES, *adapter_routes.ROUTES, *lora_routes.ROUTES,
              *ops_routes.ROUTES, *admin_routes.ROUTES, *admin_adapter_routes.ROUTES, *adapter_pins.ROUTES,
              *admin_views.ROUTES, *shared_adapter_routes.ROUTES,
              *source_credential_routes.ROUTES, *openapi.ROUTES, *pages.ROUTES]
    # CloseUnreadBody outermost: every refusal, the admin throttle's included, closes on an unread body.
    middleware = [Middleware(CloseUnreadBody),
                  Middleware(ReplicaHeader, replica=config.replica, front_end=config.front_end_index
                             if config.api_server_count > 1 else None), Middleware(SecurityHeaders),
                  Middleware(AdminAuthThrottle), Middleware(IgnoredFieldsHeader)]
    return Starlette(routes=routes, middleware=middleware, exception_handlers=EXCEPTION_HANDLERS,
                     lifespan=lifespan)
