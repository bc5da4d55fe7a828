"""/admin/tenants/{name}/adapters: the operator uploads, replaces and deletes a tenant's adapters (the
console's adapter buttons), exactly as the tenant would with its own key at /v1/adapters: the same
multipart form, the tenant's quota, and the same answers."""
from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from server.api.adapter_routes import delete_named, store_upload
from server.api.admin_views import require_admin_tenant


async def upload_tenant_adapter(request: Request) -> Response:
    state, tenant = await require_admin_tenant(request)
    return await store_upload(request, state, tenant)


async def delete_tenant_adapter(request: Request) -> Response:
    state, tenant = await require_admin_tenant(request)
    return await delete_named(state, tenant, request.path_params["adapter"])


ROUTES = [
    Route("/admin/tenants/{name}/adapters", upload_tenant_adapter, methods=["POST"]),
    Route("/admin/tenants/{name}/adapters/{adapter}", delete_tenant_adapter, methods=["DELETE"]),
]
