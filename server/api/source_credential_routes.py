"""A tenant's own credentials for its adapter sources (today: S3), so it registers adapters from its
own bucket with its own keys rather than the server's:

- `PUT /v1/adapter_source_credentials/s3` `{"access_key_id", "secret_access_key", "session_token"?}`
- `GET /v1/adapter_source_credentials`: which kinds are set (the key id's last 4 characters, when)
- `DELETE /v1/adapter_source_credentials/s3`

Kept encrypted (tenants.source_credentials), never echoed, never logged; used for that tenant's
s3:// references from then on (lazy fetches included). Setting them is refused unless the operator
allows s3 sources at all, so a server without them keeps no secrets it cannot use.
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from server.api.auth import require_tenant, state_of
from server.api.body import parse_model, read_json_object
from server.api.errors import APIError
from tenants.errors import CredentialError
from tenants.source_credentials import MAX_SECRET_CHARS, MAX_SESSION_TOKEN_CHARS, KINDS, S3Credentials


class S3CredentialsIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    access_key_id: Annotated[str, StringConstraints(min_length=3, max_length=128)]
    secret_access_key: Annotated[str, StringConstraints(min_length=1, max_length=MAX_SECRET_CHARS)]
    session_token: Annotated[str, StringConstraints(min_length=1, max_length=MAX_SESSION_TOKEN_CHARS)] | None = None


class SourceCredentialOut(BaseModel):
    kind: Literal["s3"]
    access_key_id: str = Field(description="the last 4 characters only")
    updated_at: int


class SourceCredentialList(BaseModel):
    object: Literal["list"] = "list"
    data: list[SourceCredentialOut]


class SourceCredentialDeleted(BaseModel):
    kind: Literal["s3"]
    deleted: bool


def _kind(request: Request) -> str:
    kind = request.path_params["kind"]
    if kind not in KINDS:
        raise APIError(404, f"no credentials kind {kind[:32]!r}: use one of {', '.join(sorted(KINDS))}", "not_found")
    return kind


async def put_credentials(request: Request) -> Response:
    tenant = await require_tenant(request)
    state = state_of(request)
    kind = _kind(request)
    if not state.sources.allows(kind):
        raise APIError(403, f"{kind} adapter sources are not allowed on this server (--adapter-sources)",
                       "source_not_allowed")
    body = parse_model(S3CredentialsIn, await read_json_object(request))
    try:
        credentials = S3Credentials(body.access_key_id, body.secret_access_key, body.session_token)
    except CredentialError as e:
        raise APIError(400, str(e), "invalid_field", param=e.field) from None
    meta = await run_in_threadpool(state.source_credentials.put, tenant.id, kind, credentials)
    return JSONResponse(SourceCredentialOut(**meta).model_dump())


async def list_credentials(request: Request) -> Response:
    tenant = await require_tenant(request)
    metas = await run_in_threadpool(state_of(request).source_credentials.describe, tenant.id)
    return JSONResponse(SourceCredentialList(data=[SourceCredentialOut(**m) for m in metas]).model_dump())


async def delete_credentials(request: Request) -> Response:
    tenant = await require_tenant(request)
    kind = _kind(request)
    if not await run_in_threadpool(state_of(request).source_credentials.delete, tenant.id, kind):
        raise APIError(404, f"no {kind} credentials are set", "not_found")
    return JSONResponse(SourceCredentialDeleted(kind=kind, deleted=True).model_dump())


ROUTES = [
    Route("/v1/adapter_source_credentials", list_credentials, methods=["GET"]),
    Route("/v1/adapter_source_credentials/{kind}", put_credentials, methods=["PUT"]),
    Route("/v1/adapter_source_credentials/{kind}", delete_credentials, methods=["DELETE"]),
]
