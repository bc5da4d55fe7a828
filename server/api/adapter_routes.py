"""/v1/adapters: a tenant's own PEFT adapters (upload, list, get, delete).

Names resolve inside the caller's tenant only: another tenant's adapter is a
plain 404, indistinguishable from one that never existed.
"""
from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from adapters.format import MAX_CONFIG_BYTES
from adapters.registry import name_or_none, validate_name
from server.api.adapter_intake import store_adapter
from server.api.adapter_references import register_reference, unregister
from server.api.adapter_requests import AdapterByReference
from server.api.auth import require_tenant, state_of
from server.api.base_identity import declared_base_problem, listed
from server.api.body import parse_model, read_json_object
from server.api.errors import APIError
from server.api.state import ServerState
from server.api.upload import FORM_OVERHEAD_BYTES, read_adapter_upload
from tenants import Tenant


def _path_name(request: Request) -> str | None:
    return name_or_none(request.path_params["name"])


async def upload_adapter(request: Request) -> Response:
    tenant = await require_tenant(request)
    state = state_of(request)
    if request.headers.get("content-type", "").split(";", 1)[0].strip() == "application/json":
        return await _register_by_reference(request, tenant, state)
    return await store_upload(request, state, tenant)


async def store_upload(request: Request, state: ServerState, tenant: Tenant) -> Response:
    """Store the multipart upload in the request as `tenant`'s adapter, under its quota."""
    quota = tenant.quota
    cap = state.config.max_upload_bytes
    if quota.max_adapter_bytes is not None:
        # Files may be half precision (smaller than the float32 size the quota counts);
        # the exact check on the parsed size follows.
        cap = min(cap, quota.max_adapter_bytes + MAX_CONFIG_BYTES + FORM_OVERHEAD_BYTES)
    upload = await read_adapter_upload(request, cap)
    try:
        validate_name(upload.name)
    except ValueError as e:
        raise APIError(400, str(e), "invalid_field", param="name") from None
    warning = declared_base_problem(upload.config_json, state.model_id, state.config.model)
    if warning is not None and state.config.strict_adapter_base:
        raise APIError(400, f"{warning} (refused: the server runs with --strict-adapter-base)",
                       "adapter_base_mismatch", param="base_model_name_or_path")
    record = await store_adapter(state, tenant.id, quota, upload.name, upload.config_json, upload.weights,
                                 upload.replace, medusa=upload.medusa, draft=upload.draft)
    return JSONResponse({**_public(record), **({"warnings": [warning]} if warning else {})}, status_code=201)


async def _register_by_reference(request: Request, tenant, state) -> Response:
    body = parse_model(AdapterByReference, await read_json_object(request))
    if body.name == state.model_id:
        raise APIError(400, f"an adapter cannot be named like the base model {state.model_id!r}", "invalid_field",
                       param="name")
    ref, record = await register_reference(state, tenant.id, tenant.quota, body.name, body.source,
                                           prefetch=body.prefetch, replace=body.replace)
    out = {"object": "adapter", "name": body.name, **ref.public()}
    if record is not None:
        out.update(_public(record))
    return JSONResponse(out, status_code=201)


def _public(record) -> dict:
    return {"object": "adapter", **record.public()}


async def list_adapters(request: Request) -> Response:
    tenant = await require_tenant(request)
    state = state_of(request)
    records = await run_in_threadpool(state.registry.list, tenant.id)
    return JSONResponse({"object": "list", "data": [listed(r, state.base) for r in records]})


async def get_adapter(request: Request) -> Response:
    tenant = await require_tenant(request)
    name = _path_name(request)
    record = None if name is None else await run_in_threadpool(
        state_of(request).registry.get, tenant.id, name)
    if record is None:
        raise APIError(404, f"adapter '{request.path_params['name']}' does not exist", "not_found")
    return JSONResponse(listed(record, state_of(request).base))


async def delete_adapter(request: Request) -> Response:
    tenant = await require_tenant(request)
    return await delete_named(state_of(request), tenant, request.path_params["name"])


async def delete_named(state: ServerState, tenant: Tenant, raw_name: str) -> Response:
    """Delete `tenant`'s adapter named `raw_name` (as the path gave it; 404 if it has none of that name)."""
    name = name_or_none(raw_name)
    removed = False if name is None else await unregister(state, tenant.id, name)
    if removed is False:
        raise APIError(404, f"adapter '{raw_name}' does not exist", "not_found")
    return JSONResponse({"id": removed.version if removed is not True else None, "name": name,
                         "object": "adapter", "deleted": True})


ROUTES = [
    Route("/v1/adapters", upload_adapter, methods=["POST"]),
    Route("/v1/adapters", list_adapters, methods=["GET"]),
    Route("/v1/adapters/{name}", get_adapter, methods=["GET"]),
    Route("/v1/adapters/{name}", delete_adapter, methods=["DELETE"]),
]
