"""What an operator reads (admin token only): a tenant's usage, refusals and keys, every tenant's adapters with
where each is resident now, and the engine's live state with its recent history."""
from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from server.api.auth import require_admin, state_of
from server.api.errors import APIError, not_found
from server.api.metrics import hit_rate
from server.api.state import ServerState
from server.api.usage_report import int_param, usage_report
from server.engine.protocol import EngineCoreReport, KvBlockStats, SpecDecodeStats, UnifiedPool
from tenants import Tenant

MAX_PAGE = 500


async def require_admin_tenant(request: Request) -> tuple[ServerState, Tenant]:
    """The admin check, then the tenant the path names (404 if there is none)."""
    require_admin(request)
    state = state_of(request)
    name = request.path_params["name"]
    tenant = await run_in_threadpool(state.tenants.get, name)
    if tenant is None:
        raise not_found(f"tenant {name!r}")
    return state, tenant


async def tenant_usage(request: Request) -> Response:
    state, tenant = await require_admin_tenant(request)
    return JSONResponse(await usage_report(state, tenant, request))


async def tenant_refusals(request: Request) -> Response:
    state, tenant = await require_admin_tenant(request)
    days = int_param(request, "days", 1, 1, state.refusals.retention_days)
    log = await run_in_threadpool(state.refusals.get, tenant, days)
    return JSONResponse({"object": "refusals", "tenant": tenant.name, **log})


async def tenant_keys(request: Request) -> Response:
    state, tenant = await require_admin_tenant(request)
    keys = await run_in_threadpool(state.tenants.list_keys, tenant.name)
    return JSONResponse({"object": "list", "data": keys})


def _all_adapters(state: ServerState, tenant_filter: str | None) -> list[tuple[Tenant, object]]:
    tenants = state.tenants.list()
    if tenant_filter:
        tenants = [t for t in tenants if tenant_filter in t.name]
    return [(t, r) for t in tenants for r in state.registry.list(t.id)]


async def adapters(request: Request) -> Response:
    require_admin(request)
    state = state_of(request)
    limit = int_param(request, "limit", 100, 1, MAX_PAGE)
    offset = int_param(request, "offset", 0, 0, 10**9)
    tenant_filter = request.query_params.get("tenant") or None
    if tenant_filter is not None and len(tenant_filter) > 64:
        raise APIError(400, "'tenant' filter is longer than 64 characters", "invalid_value", param="tenant")
    rows = await run_in_threadpool(_all_adapters, state, tenant_filter)
    residency = await state.engine.adapter_residency()
    page = rows[offset:offset + limit]
    data = [{**r.public(), "object": "adapter", "tenant": t.name, "tenant_id": t.id,
             "residency": residency.get(r.version, "redis")} for t, r in page]
    return JSONResponse({"object": "list", "data": data, "total": len(rows), "offset": offset, "limit": limit})


def _memory_pool(pool: UnifiedPool | None, kv: KvBlockStats, cached_free: int) -> dict | None:
    """--unified-memory's pool split in units (one KV block's bytes each: kv_blocks counts the same units);
    None without it."""
    if pool is None:
        return None
    return {"units": pool.units, "unit_bytes": pool.unit_bytes, "units_per_page": pool.units_per_page,
            "kv_share": pool.kv_share, "adapter_share": pool.adapter_share, "kv_units": kv.used,
            "adapter_units": kv.lent, "cached_free_units": cached_free,
            "free_units": kv.total - kv.used - kv.lent - cached_free}


async def engine(request: Request) -> Response:
    require_admin(request)
    state = state_of(request)
    store = await run_in_threadpool(state.store_tallies.get)
    snapshot = state.engine.snapshot()
    s = snapshot.stats
    info = state.engine.info  # fixed at start
    pool = info.kv_pool
    prefix, graphs, overlap, grammar = s.prefix_cache, s.decode_graphs, s.async_scheduling, s.grammar
    return JSONResponse({
        "healthy": state.engine.is_healthy, "error": state.engine.error,
        "running": s.scheduler.running, "waiting": s.scheduler.waiting, "preemptions": s.scheduler.preemptions,
        "kv_blocks": {"used": s.kv_blocks.used, "total": s.kv_blocks.total},
        "memory_pool": _memory_pool(pool.unified, s.kv_blocks, prefix.cached_free_blocks),
        "kv_cache": {"dtype": pool.dtype, "requested_dtype": info.requested_kv_cache_dtype, "blocks": pool.blocks,
                     "block_size": pool.block_size, "tokens": pool.tokens, "bytes": pool.bytes},
        "base_weights": info.base_weights,
        # The adapter tiers, fastest first; a miss is a load into the tier (host: from Redis).
        "slots": {"used": s.slots.resident, "total": info.max_loras,
                  "max_lora_rank": info.max_lora_rank, "pages_used": s.slots.pages_used,
                  "pages_total": s.slots.pages_total, "pinned": s.slots.pinned, "hits": s.slots.hits,
                  "misses": s.slots.loads, "evictions": s.slots.evictions,
                  "hit_rate": hit_rate(s.slots.hits, s.slots.loads), "draft_bytes": s.slots.draft_bytes},
        "host": {"adapters": s.host.adapters, "bytes": s.host.bytes_used, "budget_bytes": s.host.budget_bytes,
                 "loads_in_flight": s.host.loading, "parked": s.host.parked, "parked_bytes": s.host.parked_bytes,
                 "hits": s.host.hits, "misses": s.host.misses, "evictions": s.host.evictions,
                 "load_failures": s.host.load_failures, "hit_rate": hit_rate(s.host.hits, s.host.misses)},
        # Redis: every replica's, counted at most once a minute.
        "store": None if store is None else {"adapters": store.adapters, "bytes": store.bytes,
                                             "counted_at": store.counted_at},
        "prefix_cache": {"enabled": prefix.enabled, "queried_tokens": prefix.queried_tokens,
                         "hit_tokens": prefix.hit_tokens,
                         "hit_rate": prefix.hit_tokens / prefix.queried_tokens if prefix.queried_tokens else None,
                         "cached_blocks": prefix.cached_blocks, "cached_free_blocks": prefix.cached_free_blocks},
        "cuda_graphs": {"enabled": bool(graphs.graphs), "graphs": graphs.graphs, "replays": graphs.replays,
                        "capture_seconds": graphs.capture_seconds, "capture_bytes": graphs.capture_bytes},
        "async_scheduling": {"enabled": info.async_scheduling, "steps": overlap.launched,
                             "steps_ahead": overlap.ahead, "rows_discarded": overlap.discarded},
        "structured_output": {"constrained_requests": s.constrained_requests, "compiles": grammar.compiles,
                              "cache_hits": grammar.cache_hits, "compile_seconds": grammar.compile_seconds,
                              "failures": grammar.failures, "cached_grammars": grammar.cached,
                              "compile_timeouts": state.grammar_compiler.timeouts,
                              "compiles_running": state.grammar_compiler.running,
                              "compile_cold_starts": state.grammar_compiler.cold_starts},
        # DoRA scales: computed against the base, or read from Redis (server.engine.lora.dora_scale_cache).
        "dora_scales": snapshot.dora_scales,
        "speculative_decoding": speculative_view(s.speculative),
        # --data-parallel-size: each engine core's own (the sections above are their sums); [] for one engine.
        "engines": [engine_core_view(core) for core in state.engine.engine_cores()],
        "history": list(state.history.points)})


def engine_core_view(core: EngineCoreReport) -> dict:
    s = core.snapshot.stats
    return {"engine": core.index, "healthy": core.healthy, "error": core.error, "restarts": core.restarts,
            "routed": core.routed, "running": s.scheduler.running, "waiting": s.scheduler.waiting,
            "kv_blocks": {"used": s.kv_blocks.used, "total": s.kv_blocks.total},
            "slots": {"used": s.slots.resident, "total": core.max_loras, "hits": s.slots.hits,
                      "misses": s.slots.loads, "hit_rate": hit_rate(s.slots.hits, s.slots.loads)},
            "host": {"adapters": s.host.adapters, "hits": s.host.hits, "misses": s.host.misses}}


def speculative_view(spec: SpecDecodeStats) -> dict:
    """Speculative decoding's counters since start (vLLM's spec_decode_*), with their two ratios."""
    return {"method": spec.method, "num_drafts": spec.num_drafts, "num_draft_tokens": spec.num_draft_tokens,
            "num_accepted_tokens": spec.num_accepted_tokens,
            "accepted_per_position": list(spec.accepted_per_position),
            "acceptance_rate": spec.acceptance_rate if spec.num_draft_tokens else None,
            "mean_accepted_length": spec.mean_accepted_length if spec.num_drafts else None,
            "skipped_steps": spec.skipped_steps}


ROUTES = [
    Route("/admin/tenants/{name}/usage", tenant_usage, methods=["GET"]),
    Route("/admin/tenants/{name}/refusals", tenant_refusals, methods=["GET"]),
    Route("/admin/tenants/{name}/keys", tenant_keys, methods=["GET"]),
    Route("/admin/adapters", adapters, methods=["GET"]),
    Route("/admin/engine", engine, methods=["GET"]),
]
