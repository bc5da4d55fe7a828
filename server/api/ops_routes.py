"""/health, /metrics and /v1/usage."""
from __future__ import annotations

import redis
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from server.api.auth import require_metrics_reader, require_tenant, state_of
from server.api.errors import APIError


async def health(request: Request) -> Response:
    state = state_of(request)
    try:
        redis_ok = bool(await run_in_threadpool(state.redis.ping))
    except redis.RedisError:
        redis_ok = False
    engine_ok = state.engine.is_healthy
    ok = redis_ok and engine_ok
    body = {"status": "ok" if ok else "unavailable", "engine": engine_ok, "redis": redis_ok,
            "model": state.model_id}
    if not engine_ok:
        body["engine_error"] = state.engine.error or "the engine is not running"
    return JSONResponse(body, status_code=200 if ok else 503)


async def metrics(request: Request) -> Response:
    require_metrics_reader(request)
    state = state_of(request)
    state.metrics.observe_engine(state.engine.stats())
    state.metrics.observe_load_times(state.engine.engine.host.load_seconds)
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def usage(request: Request) -> Response:
    tenant = await require_tenant(request)
    state = state_of(request)
    raw_days = request.query_params.get("days", "1")
    # Length first: int() of thousands of digits is refused by Python (and slow before that).
    if not (raw_days.isascii() and raw_days.isdigit() and len(raw_days) <= 3) \
            or not 1 <= int(raw_days) <= state.usage.retention_days:
        raise APIError(400, f"'days' must be an integer in 1..{state.usage.retention_days}",
                       "invalid_value")
    log = await run_in_threadpool(state.usage.get, tenant, int(raw_days))
    window = await run_in_threadpool(state.limiter.current, tenant)
    adapters = await run_in_threadpool(state.registry.count, tenant.id)
    return JSONResponse({"object": "usage", "tenant": tenant.name, "limits": tenant.quota.to_dict(),
                         "current": {**window, "adapters": adapters}, **log})


ROUTES = [
    Route("/health", health, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
    Route("/v1/usage", usage, methods=["GET"]),
]
