"""/admin/shared-adapters: the operator's adapters (--lora-modules) and which tenants may use them.
Tenants are named here and kept by id, so a renamed or recreated tenant never inherits a share."""
from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from adapters.sharing import ALL, OPERATOR_OWNER
from server.api.adapter_requests import SharedAdapterSharing
from server.api.auth import require_admin, state_of
from server.api.body import parse_model, read_json_object
from server.api.errors import APIError, not_found
from server.api.state import ServerState


def _describe(state: ServerState, name: str, sharing, names_by_id: dict[str, str]) -> dict:
    record = state.registry.get(OPERATOR_OWNER, name)
    ref = state.references.get(OPERATOR_OWNER, name)
    tenants = sharing if sharing == ALL else [names_by_id[i] for i in sharing if i in names_by_id]
    return {"name": name, "version": None if record is None else record.version,
            "source": None if ref is None else ref.source, "tenants": tenants}


def _all(state: ServerState) -> list[dict]:
    names_by_id = {t.id: t.name for t in state.tenants.list()}
    return [_describe(state, n, s, names_by_id) for n, s in sorted(state.sharing.all().items())]


async def list_shared(request: Request) -> Response:
    require_admin(request)
    return JSONResponse({"object": "list", "data": await run_in_threadpool(_all, state_of(request))})


def _set(state: ServerState, name: str, tenants) -> dict:
    if state.sharing.get(name) is None:
        raise not_found(f"shared adapter '{name}'")
    if tenants == ALL:
        state.sharing.set(name, ALL)
    else:
        ids = []
        for tenant_name in tenants:
            tenant = state.tenants.get(tenant_name)
            if tenant is None:
                raise APIError(404, f"tenant '{tenant_name}' does not exist", "not_found")
            ids.append(tenant.id)
        state.sharing.set(name, sorted(set(ids)))
    return _describe(state, name, state.sharing.get(name), {t.id: t.name for t in state.tenants.list()})


async def set_sharing(request: Request) -> Response:
    require_admin(request)
    body = parse_model(SharedAdapterSharing, await read_json_object(request))
    return JSONResponse(await run_in_threadpool(_set, state_of(request), request.path_params["name"], body.tenants))


ROUTES = [
    Route("/admin/shared-adapters", list_shared, methods=["GET"]),
    Route("/admin/shared-adapters/{name}", set_sharing, methods=["PUT"]),
]
