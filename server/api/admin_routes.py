"""/admin: tenants, their quotas and API keys (admin token only)."""
from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from server.api.admin_models import QuotaFields, TenantCreate, TenantPatch
from server.api.admin_views import require_admin_tenant
from server.api.auth import require_admin, state_of
from server.api.body import parse_model, read_json_object
from server.api.errors import APIError, not_found
from server.api.housekeeping import purge_tenant
from tenants import Quota, validate_tenant_name


async def create_tenant(request: Request) -> Response:
    require_admin(request)
    req = parse_model(TenantCreate, await read_json_object(request))
    quota = Quota.from_dict(req.quota.model_dump(exclude_unset=True) if req.quota else None)
    tenant = await run_in_threadpool(state_of(request).tenants.create, validate_tenant_name(req.name), quota)
    return JSONResponse(tenant.to_dict(), status_code=201)


async def list_tenants(request: Request) -> Response:
    require_admin(request)
    tenants = await run_in_threadpool(state_of(request).tenants.list)
    return JSONResponse({"object": "list", "data": [t.to_dict() for t in tenants]})


async def get_tenant(request: Request) -> Response:
    state, tenant = await require_admin_tenant(request)
    keys = await run_in_threadpool(state.tenants.list_keys, tenant.name)
    adapters = await run_in_threadpool(state.registry.count, tenant.id)
    return JSONResponse({**tenant.to_dict(), "keys": keys, "adapters": adapters})


async def patch_tenant(request: Request) -> Response:
    require_admin(request)
    body = await read_json_object(request)
    if not body:
        # The schema requires `quota`; an empty body changes nothing and is most likely a mistake.
        raise APIError(400, "'quota': required; send {\"quota\": {...}} with the fields to change",
                       "invalid_value", param="quota")
    # {"quota": {...}} or the quota fields themselves
    fields = parse_model(TenantPatch, body).quota if "quota" in body else parse_model(QuotaFields, body)
    tenant = await run_in_threadpool(state_of(request).tenants.update_quota,
                                     request.path_params["name"], fields.model_dump(exclude_unset=True))
    return JSONResponse(tenant.to_dict())


async def delete_tenant(request: Request) -> Response:
    require_admin(request)
    state = state_of(request)
    name = request.path_params["name"]
    tenant = await run_in_threadpool(state.tenants.delete, name)
    if tenant is None:
        raise not_found(f"tenant {name!r}")
    # Keys, usage and limits went with the tenant; its adapters are retired now (and by the
    # periodic upkeep should this fail midway), so a new tenant of the same name starts empty.
    adapters = await run_in_threadpool(purge_tenant, state, tenant.id)
    return JSONResponse({"name": name, "id": tenant.id, "deleted": True, "adapters_retired": adapters})


async def create_key(request: Request) -> Response:
    require_admin(request)
    key_id, key = await run_in_threadpool(state_of(request).tenants.create_key,
                                          request.path_params["name"])
    return JSONResponse({"id": key_id, "key": key, "tenant": request.path_params["name"]},
                        status_code=201)


async def revoke_key(request: Request) -> Response:
    require_admin(request)
    name, key_id = request.path_params["name"], request.path_params["key_id"]
    if not await run_in_threadpool(state_of(request).tenants.revoke_key, name, key_id):
        raise not_found(f"key {key_id!r} of tenant {name!r}")
    return JSONResponse({"id": key_id, "deleted": True})


ROUTES = [
    Route("/admin/tenants", create_tenant, methods=["POST"]),
    Route("/admin/tenants", list_tenants, methods=["GET"]),
    Route("/admin/tenants/{name}", get_tenant, methods=["GET"]),
    Route("/admin/tenants/{name}", patch_tenant, methods=["PATCH"]),
    Route("/admin/tenants/{name}", delete_tenant, methods=["DELETE"]),
    Route("/admin/tenants/{name}/keys", create_key, methods=["POST"]),
    Route("/admin/tenants/{name}/keys/{key_id}", revoke_key, methods=["DELETE"]),
]
