"""/v1/adapters: a tenant's own PEFT adapters (upload, list, get, delete).

Names resolve inside the caller's tenant only: another tenant's adapter is a
plain 404, indistinguishable from one that never existed.
"""
from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from adapters.format import MAX_CONFIG_BYTES, inspect_adapter_bytes, load_adapter_bytes
from adapters.registry import validate_name
from server.api.auth import require_tenant, state_of
from server.api.errors import APIError
from server.api.upload import FORM_OVERHEAD_BYTES, read_adapter_upload


def _path_name(request: Request) -> str | None:
    name = request.path_params["name"]
    try:
        return validate_name(name)
    except ValueError:
        return None  # cannot exist: answered as 404 by the caller


async def upload_adapter(request: Request) -> Response:
    tenant = await require_tenant(request)
    state = state_of(request)
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
        raise APIError(422, str(e), "invalid_field") from None
    if upload.name == state.model_id:
        raise APIError(400, f"an adapter cannot be named like the base model {state.model_id!r}",
                       "invalid_field")
    shape = state.engine.engine.adapter_shape
    rank_cap = state.config.max_lora_rank
    summary = await run_in_threadpool(inspect_adapter_bytes, upload.config_json, upload.weights,
                                      shape, rank_cap)
    if quota.max_lora_rank is not None and summary.rank > quota.max_lora_rank:
        raise APIError(400, f"adapter rank {summary.rank} exceeds this tenant's max_lora_rank of "
                            f"{quota.max_lora_rank}", "max_lora_rank")
    if quota.max_adapter_bytes is not None and summary.size_bytes > quota.max_adapter_bytes:
        raise APIError(413, f"adapter size {summary.size_bytes} bytes (as float32) exceeds this "
                            f"tenant's max_adapter_bytes of {quota.max_adapter_bytes}",
                       "max_adapter_bytes")
    host_budget = state.config.max_cpu_lora_bytes
    # The host tier keeps adapters in the serving dtype; the summary counts them as float32.
    host_bytes = summary.size_bytes * state.engine.engine.dtype.itemsize // 4
    if host_bytes > host_budget:
        # It could never be paged in: every request for it would fail.
        raise APIError(413, f"adapter size {host_bytes} bytes (in the serving dtype) exceeds the server's "
                            f"host adapter budget of {host_budget} bytes (--max-cpu-lora-bytes)",
                       "adapter_too_large")
    # The engine loader's full rules (tensor values included), the same code that serves it.
    await run_in_threadpool(load_adapter_bytes, summary.canonical_config_json, upload.weights,
                            shape, rank_cap)
    old = await run_in_threadpool(state.registry.get, tenant.id, upload.name)
    # The canonical config is stored: the user's patterns were resolved once, above, and a
    # later load never runs them again.
    record = await run_in_threadpool(
        lambda: state.registry.put(tenant.id, upload.name, summary.canonical_config_json, upload.weights,
                                   summary=summary, replace=upload.replace,
                                   max_adapters=quota.max_adapters))
    if old is not None and old.version != record.version:
        await state.engine.remove_adapter(old.version)  # other processes hear it via the registry's events
    return JSONResponse(_public(record), status_code=201)


def _public(record) -> dict:
    return {"object": "adapter", **record.public()}


async def list_adapters(request: Request) -> Response:
    tenant = await require_tenant(request)
    records = await run_in_threadpool(state_of(request).registry.list, tenant.id)
    return JSONResponse({"object": "list", "data": [_public(r) for r in records]})


async def get_adapter(request: Request) -> Response:
    tenant = await require_tenant(request)
    name = _path_name(request)
    record = None if name is None else await run_in_threadpool(
        state_of(request).registry.get, tenant.id, name)
    if record is None:
        raise APIError(404, f"adapter '{request.path_params['name']}' does not exist", "not_found")
    return JSONResponse(_public(record))


async def delete_adapter(request: Request) -> Response:
    tenant = await require_tenant(request)
    state = state_of(request)
    name = _path_name(request)
    record = None if name is None else await run_in_threadpool(state.registry.delete, tenant.id, name)
    if record is None:
        raise APIError(404, f"adapter '{request.path_params['name']}' does not exist", "not_found")
    await state.engine.remove_adapter(record.version)
    return JSONResponse({"id": record.version, "name": record.name, "object": "adapter",
                         "deleted": True})


ROUTES = [
    Route("/v1/adapters", upload_adapter, methods=["POST"]),
    Route("/v1/adapters", list_adapters, methods=["GET"]),
    Route("/v1/adapters/{name}", get_adapter, methods=["GET"]),
    Route("/v1/adapters/{name}", delete_adapter, methods=["DELETE"]),
]
