"""Adapters pinned on the device: never evicted once loaded (server.engine.lora.slots), by the operator at
start (--pin-adapter) or through PUT/DELETE /admin/tenants/{name}/adapters/{adapter}/pin, at most
--max-pinned-adapters-per-tenant per tenant. A pin holds the adapter's current version: replacing or
deleting the adapter drops it (pin the new version again)."""
from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from adapters.registry import name_or_none
from server.api.admin_models import AdapterPin
from server.api.admin_views import require_admin_tenant
from server.api.bootstrap import adapter_owner
from server.api.errors import APIError, not_found
from server.api.state import ServerState
from server.config import ConfigError


async def _record(state: ServerState, tenant_id: str, name: str):
    """The tenant's adapter named `name`, or None (a name no adapter can have included)."""
    if name_or_none(name) is None:
        return None
    return await run_in_threadpool(state.registry.get, tenant_id, name)


async def pin_named(state: ServerState, tenant_id: str, name: str) -> str:
    """Pin `name`'s current version for tenant `tenant_id`; its version. 404 for an unknown adapter, 409
    naming max_pinned_adapters_per_tenant when the tenant is at its bound."""
    record = await _record(state, tenant_id, name)
    if record is None:
        raise not_found(f"adapter {name!r}")
    if not await state.engine.pin_adapter(record.version, tenant_id):
        limit = state.config.engine.lora.max_pinned_adapters_per_tenant
        raise APIError(409, f"the tenant already pins {limit} adapters, the limit "
                            f"max_pinned_adapters_per_tenant ({limit}): unpin one first", "pin_limit",
                       param="max_pinned_adapters_per_tenant")
    return record.version


async def pin_startup_adapters(state: ServerState) -> None:
    """--pin-adapter's adapters, once bootstrap has stored the preloaded ones; ConfigError for one that
    is not there."""
    cfg = state.config
    for tenant, name in cfg.pin_adapters:
        owner = await run_in_threadpool(state.tenants.get, adapter_owner(tenant, cfg.demo_tenant))
        try:
            if owner is None:
                raise not_found(f"tenant {tenant!r}")
            await pin_named(state, owner.id, name)
        except APIError as e:
            raise ConfigError(f"--pin-adapter {name}: {e.message}") from None


async def pin_tenant_adapter(request: Request) -> Response:
    state, tenant = await require_admin_tenant(request)
    name = request.path_params["adapter"]
    version = await pin_named(state, tenant.id, name)
    return JSONResponse(AdapterPin(adapter=name, version=version, pinned=True).model_dump(exclude_none=True))


async def unpin_tenant_adapter(request: Request) -> Response:
    state, tenant = await require_admin_tenant(request)
    name = request.path_params["adapter"]
    record = await _record(state, tenant.id, name)
    if record is None:
        raise not_found(f"adapter {name!r}")
    was = await state.engine.unpin_adapter(record.version)
    return JSONResponse(AdapterPin(adapter=name, version=record.version, pinned=False, was_pinned=was).model_dump())


ROUTES = [
    Route("/admin/tenants/{name}/adapters/{adapter}/pin", pin_tenant_adapter, methods=["PUT"]),
    Route("/admin/tenants/{name}/adapters/{adapter}/pin", unpin_tenant_adapter, methods=["DELETE"]),
]
