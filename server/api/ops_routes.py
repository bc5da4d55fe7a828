"""/health, /version, /metrics and /v1/usage."""
from __future__ import annotations

import asyncio

import torch
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from server.api.auth import require_metrics_reader, require_tenant, state_of
from server.api.usage_report import usage_report
from server.api.state import ServerState
from server.api.vllm_metrics import adapter_label
from server.engine.protocol import AdapterTiers, EngineDeadError
from server.version import loraplex_version, package_version

# A scrape waits this long for the engine to say where adapters are (it answers between steps);
# past it (a long step, a paused or dead engine) the residency series stay as last read.
TIERS_WAIT_S = 1.0


async def health(request: Request) -> Response:
    state = state_of(request)
    redis_problem = await state.redis_probe.problem()
    redis_ok = redis_problem is None
    engine_ok = state.engine.is_healthy
    ok = redis_ok and engine_ok
    body = {"status": "ok" if ok else "unavailable", "engine": engine_ok, "redis": redis_ok,
            "model": state.model_id, "replica": state.config.replica, "version": package_version("loraplex")}
    if not redis_ok:
        body["redis_error"] = redis_problem
    if not engine_ok:
        body["engine_error"] = state.engine.error or "the engine is not running"
        body["engine_restarting"] = state.engine.is_restarting  # back soon (--engine-restart), or gone for good
    return JSONResponse(body, status_code=200 if ok else 503)


async def version(request: Request) -> Response:
    """What this replica runs, for bug reports and for checking that a rollout reached every replica.
    Public like /health: versions and the model id, no tenant data."""
    state = state_of(request)
    info = state.engine.info
    return JSONResponse({"version": package_version("loraplex"), "torch": torch.__version__,
                         "triton": package_version("triton"),
                         "transformers": package_version("transformers"),
                         "device": info.device, "dtype": info.dtype,
                         "model": state.model_id, "replica": state.config.replica})


async def metrics(request: Request) -> Response:
    require_metrics_reader(request)
    state = state_of(request)
    state.metrics.observe_identity(state.config.replica, state.model_id,
                                   loraplex_version())
    stats = state.engine.stats()
    state.metrics.observe_engine(stats)
    state.metrics.cores.observe(state.engine.engine_cores(), state.model_id)
    tiers = await _adapter_tiers(state)
    await run_in_threadpool(state.metrics.vllm.observe, stats, tiers, state.engine.info, state.model_id,
                            lambda v: adapter_label(state.registry.get_version(v)))
    state.metrics.observe_load_times(state.engine.take_load_times())
    state.metrics.observe_store(await run_in_threadpool(state.store_tallies.get))
    state.metrics.running_leases.set(state.settlements.running)
    state.metrics.leases_lost.set(state.settlements.leases_lost)
    state.metrics.longest_beat_gap.set(state.settlements.longest_beat_gap)
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def _adapter_tiers(state: ServerState) -> AdapterTiers | None:
    # Shielded: a step loop's call is not to be cancelled once sent, only no longer waited for.
    try:
        return await asyncio.wait_for(asyncio.shield(state.engine.adapter_tiers()), TIERS_WAIT_S)
    except (asyncio.TimeoutError, EngineDeadError):
        return None


async def usage(request: Request) -> Response:
    tenant = await require_tenant(request)
    return JSONResponse(await usage_report(state_of(request), tenant, request))


ROUTES = [
    Route("/health", health, methods=["GET"]),
    Route("/version", version, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
    Route("/v1/usage", usage, methods=["GET"]),
]
