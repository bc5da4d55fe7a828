"""A tenant's usage report (per UTC day and per adapter, its limits and current window), as both the
tenant (/v1/usage) and the operator (/admin/tenants/{name}/usage) read it, and query integers."""
from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from server.api.errors import APIError
from server.api.state import ServerState
from tenants import Tenant


def int_param(request: Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    # Length first: int() of thousands of digits is refused by Python (and slow before that).
    if not (raw.isascii() and raw.isdigit() and len(raw) <= len(str(hi))) or not lo <= int(raw) <= hi:
        raise APIError(400, f"'{name}' must be an integer in {lo}..{hi}", "invalid_value", param=name)
    return int(raw)


async def usage_report(state: ServerState, tenant: Tenant, request: Request) -> dict:
    days = int_param(request, "days", 1, 1, state.usage.retention_days)
    log = await run_in_threadpool(state.usage.get, tenant, days, base_model=state.model_id)
    window = await run_in_threadpool(state.limiter.current, tenant)
    adapters = await run_in_threadpool(state.registry.count, tenant.id)
    return {"object": "usage", "tenant": tenant.name, "limits": tenant.quota.to_dict(),
            "current": {**window, "adapters": adapters}, **log}
