"""vLLM's runtime adapter endpoints, scoped to the calling tenant:
`POST /v1/load_lora_adapter {"lora_name", "lora_path"}` and `POST /v1/unload_lora_adapter {"lora_name"}`.
Unload frees memory and keeps what is stored, as vLLM's does: an uploaded adapter stays (listed, loaded
again on its next use); a name registered by reference is dropped, its source untouched.
`lora_path` is any source the operator allows (adapters.sources); success answers are vLLM's text."""
from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from server.api.adapter_references import register_reference, unregister
from server.api.adapter_requests import LoadLoraAdapter, UnloadLoraAdapter
from server.api.auth import require_tenant, state_of
from server.api.body import parse_model, read_json_object
from server.api.errors import APIError


async def _refuse_shared(state, tenant, name: str) -> None:
    """Shared operator adapters are read-only to tenants (only those they can see are named)."""
    if await run_in_threadpool(state.sharing.visible, name, tenant.id):
        raise APIError(403, f"the LoRA adapter '{name}' is shared by the operator and read-only", "read_only")


async def load_lora_adapter(request: Request) -> Response:
    tenant = await require_tenant(request)
    state = state_of(request)
    body = parse_model(LoadLoraAdapter, await read_json_object(request))
    if body.lora_name == state.model_id:
        raise APIError(400, f"an adapter cannot be named like the base model {state.model_id!r}", "invalid_field",
                       param="lora_name")
    await _refuse_shared(state, tenant, body.lora_name)
    exists = await run_in_threadpool(state.registry.get, tenant.id, body.lora_name) is not None or \
        await run_in_threadpool(state.references.get, tenant.id, body.lora_name) is not None
    if exists and not body.load_inplace:
        # vLLM's answer (400) for a name already loaded.
        raise APIError(400, f"The lora adapter '{body.lora_name}' has already been loaded. If you want to load "
                            f"the adapter in place, set 'load_inplace' to True.", "adapter_exists",
                       param="lora_name")
    await register_reference(state, tenant.id, tenant.quota, body.lora_name, body.lora_path,
                             prefetch=body.prefetch, replace=body.load_inplace, param="lora_path")
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_lora_adapter(request: Request) -> Response:
    tenant = await require_tenant(request)
    state = state_of(request)
    body = parse_model(UnloadLoraAdapter, await read_json_object(request))
    if body.lora_int_id is not None:
        raise APIError(400, "'lora_int_id' is not supported: name the adapter with 'lora_name'", "unsupported",
                       param="lora_int_id")
    await _refuse_shared(state, tenant, body.lora_name)
    if await run_in_threadpool(state.references.get, tenant.id, body.lora_name) is not None:
        # Registered by reference (vLLM's load): its name goes, as in vLLM, and the source keeps the files.
        await unregister(state, tenant.id, body.lora_name)
    else:
        record = await run_in_threadpool(state.registry.get, tenant.id, body.lora_name)
        if record is None:
            raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", "not_found")
        # An upload is the only copy: it stays stored and listed, and the next request loads it again.
        await state.engine.release_adapter_memory(record.version)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


ROUTES = [
    Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]),
    Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"]),
]
