"""The OpenAPI 3.1 document at /openapi.json, generated from the pydantic models (server.api.pages
serves the /docs page that renders it).

Every operation lists the errors it can answer (OpenAI's error shape), so a
schema-driven client or fuzzer can hold the server to it.
"""
from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from server.api import adapter_requests as ar
from server.api import admin_models as am
from server.api import openai_requests as rq
from server.api import openai_responses as rs
from server.api import source_credential_routes as sc
from server.version import loraplex_version

_ERRORS = {400: "invalid input, or an unknown or unsupported field (`param` names it)", 401: "missing or invalid credentials",
           403: "not allowed for this credential", 404: "no such model, adapter or tenant",
           409: "already exists", 413: "body or adapter too large",
           429: "a rate or concurrency limit (see Retry-After)", 502: "an adapter source failed or is unreachable",
           503: "the engine or Redis is unavailable", 504: "an adapter source timed out"}


@dataclass(frozen=True)
class Op:
    method: str
    path: str
    summary: str
    auth: str | None                       # "tenant", "admin", "metrics" or None
    response: type[BaseModel] | None       # None: plain text or no body model
    request: type[BaseModel] | None = None
    multipart: bool = False
    status: int = 200
    streams: bool = False                  # may answer text/event-stream (stream: true)
    text: str | None = None                # the media type of a non-JSON response
    query: tuple[tuple[str, dict], ...] = ()


OPERATIONS = (
    Op("get", "/v1/models", "The base model and the caller's adapters", "tenant", rs.ModelList),
    Op("get", "/v1/models/{model}", "One model: the base model or one of the caller's adapters", "tenant",
       rs.ModelCard),
    Op("post", "/v1/completions", "Text completion (a prompt, token ids, or a batch of either)", "tenant",
       rs.Completion, rq.CompletionRequest, streams=True),
    Op("post", "/v1/chat/completions", "Chat completion", "tenant", rs.ChatCompletion,
       rq.ChatCompletionRequest, streams=True),
    Op("post", "/tokenize", "Token ids of a prompt or chat messages (vLLM's shape)", "tenant",
       rs.TokenizeResponse, rq.TokenizeRequest),
    Op("post", "/detokenize", "Text of token ids (vLLM's shape)", "tenant", rs.DetokenizeResponse,
       rq.DetokenizeRequest),
    Op("post", "/v1/adapters", "Upload a PEFT LoRA adapter", "tenant", am.AdapterOut, am.AdapterUpload,
       multipart=True, status=201),
    Op("get", "/v1/adapters", "The caller's adapters", "tenant", am.AdapterList),
    Op("get", "/v1/adapters/{name}", "One of the caller's adapters", "tenant", am.AdapterOut),
    Op("delete", "/v1/adapters/{name}", "Delete an adapter (running requests finish on it)", "tenant",
       am.AdapterDeleted),
    Op("post", "/v1/load_lora_adapter", "vLLM's: load an adapter from a source the operator allows", "tenant",
       None, ar.LoadLoraAdapter, text="text/plain"),
    Op("post", "/v1/unload_lora_adapter", "vLLM's: free one of the caller's adapters from memory (an upload "
       "stays stored)", "tenant", None, ar.UnloadLoraAdapter, text="text/plain"),
    Op("get", "/v1/adapter_source_credentials", "Which of the caller's own source credentials are set "
       "(never the secrets)", "tenant", sc.SourceCredentialList),
    Op("put", "/v1/adapter_source_credentials/{kind}", "Set the caller's own credentials for s3:// sources "
       "(kept encrypted, never shown again)", "tenant", sc.SourceCredentialOut, sc.S3CredentialsIn),
    Op("delete", "/v1/adapter_source_credentials/{kind}", "Forget the caller's credentials for a source kind",
       "tenant", sc.SourceCredentialDeleted),
    Op("get", "/v1/usage", "The caller's usage per UTC day, and its limits", "tenant", am.UsageOut,
       query=(("days", {"type": "integer", "minimum": 1, "maximum": 90, "default": 1}),)),
    Op("post", "/admin/tenants", "Create a tenant", "admin", am.TenantOut, am.TenantCreate, status=201),
    Op("get", "/admin/tenants", "All tenants", "admin", am.TenantList),
    Op("get", "/admin/tenants/{name}", "A tenant, its keys and adapter count", "admin", am.TenantDetail),
    Op("patch", "/admin/tenants/{name}", "Change a tenant's quota", "admin", am.TenantOut, am.TenantPatchBody),
    Op("delete", "/admin/tenants/{name}", "Delete a tenant and everything it owns", "admin", am.TenantDeleted),
    Op("post", "/admin/tenants/{name}/keys", "Issue an API key (shown once)", "admin", am.KeyCreated,
       status=201),
    Op("delete", "/admin/tenants/{name}/keys/{key_id}", "Revoke an API key", "admin", am.KeyDeleted),
    Op("get", "/admin/tenants/{name}/usage", "A tenant's usage per UTC day and per adapter", "admin",
       am.UsageOut, query=(("days", {"type": "integer", "minimum": 1, "maximum": 90, "default": 1}),)),
    Op("get", "/admin/tenants/{name}/refusals", "A tenant's refused requests (429s, errors) per UTC day, by reason",
       "admin", am.RefusalsOut, query=(("days", {"type": "integer", "minimum": 1, "maximum": 90, "default": 1}),)),
    Op("post", "/admin/tenants/{name}/adapters", "Upload (or replace) an adapter for a tenant, under its quota",
       "admin", am.AdapterOut, am.AdapterUpload, multipart=True, status=201),
    Op("delete", "/admin/tenants/{name}/adapters/{adapter}", "Delete a tenant's adapter", "admin",
       am.AdapterDeleted),
    Op("put", "/admin/tenants/{name}/adapters/{adapter}/pin",
       "Pin a tenant's adapter on the device (never evicted once loaded); 409 past "
       "--max-pinned-adapters-per-tenant", "admin", am.AdapterPin),
    Op("delete", "/admin/tenants/{name}/adapters/{adapter}/pin", "Unpin a tenant's adapter", "admin",
       am.AdapterPin),
    Op("get", "/admin/tenants/{name}/keys", "A tenant's API keys (ids, created, last used; never the secret)",
       "admin", am.KeyList),
    Op("get", "/admin/adapters", "Every tenant's adapters and where each is resident", "admin",
       am.AdminAdapterList, query=(("tenant", {"type": "string", "maxLength": 64}),
                                   ("limit", {"type": "integer", "minimum": 1, "maximum": 500, "default": 100}),
                                   ("offset", {"type": "integer", "minimum": 0, "maximum": 10**9, "default": 0}))),
    Op("get", "/admin/shared-adapters", "The operator's adapters (--lora-modules) and who may use them", "admin",
       None),
    Op("put", "/admin/shared-adapters/{name}", "Share an operator adapter with all tenants or a list", "admin",
       None, ar.SharedAdapterSharing),
    Op("get", "/admin/engine", "The engine's live state and its last minutes", "admin", am.EngineView),
    Op("get", "/health", "Liveness of the engine and Redis", None, am.Health),
    Op("get", "/version", "What this replica runs: versions, device, dtype, model and replica name", None,
       am.VersionInfo),
    Op("get", "/metrics", "Prometheus metrics", "metrics", None, text="text/plain"),
)


def _schemas() -> tuple[dict, dict]:
    models = {m for op in OPERATIONS for m in (op.request, op.response) if m is not None}
    models |= {rs.ErrorResponse, rs.ChatCompletionChunk}
    pairs = [(m, "validation" if m in (op.request for op in OPERATIONS) else "serialization")
             for m in sorted(models, key=lambda m: m.__name__)]
    refs, defs = models_json_schema(pairs, ref_template="#/components/schemas/{model}")
    return {m: refs[(m, mode)] for m, mode in pairs}, defs.get("$defs", {})


def _operation(op: Op, refs: dict) -> dict:
    out: dict = {"summary": op.summary, "operationId": f"{op.method}_{op.path}".replace("/", "_").strip("_")}
    params = [{"name": p, "in": "path", "required": True, "schema": {"type": "string"}}
              for p in [seg[1:-1] for seg in op.path.split("/") if seg.startswith("{")]]
    params += [{"name": name, "in": "query", "required": False, "schema": schema} for name, schema in op.query]
    if params:
        out["parameters"] = params
    if op.request is not None:
        media = "multipart/form-data" if op.multipart else "application/json"
        out["requestBody"] = {"required": True, "content": {media: {"schema": refs[op.request]}}}
    if op.auth is not None:
        out["security"] = [{"bearer": []}]
    ok: dict = {"description": "OK"}
    if op.response is not None:
        ok["content"] = {"application/json": {"schema": refs[op.response]}}
        if op.streams:
            ok["content"]["text/event-stream"] = {
                "schema": {"type": "string", "description": "`data: {chunk}` events, then `data: [DONE]`"}}
    elif op.text is not None:
        ok["content"] = {op.text: {"schema": {"type": "string"}}}
    error = {"application/json": {"schema": refs[rs.ErrorResponse]}}
    out["responses"] = {str(op.status): ok, **{str(s): {"description": d, "content": error}
                                               for s, d in _ERRORS.items()}}
    return out


def _bound_token_ids(schema: object, vocab_size: int) -> None:
    """Every token id in the document (marked x-token-id) is below the served model's vocabulary size."""
    if isinstance(schema, dict):
        if schema.pop("x-token-id", False):
            schema["maximum"] = vocab_size - 1
        for value in schema.values():
            _bound_token_ids(value, vocab_size)
    elif isinstance(schema, list):
        for value in schema:
            _bound_token_ids(value, vocab_size)


def build_openapi(version: str, vocab_size: int = 1 << 31) -> dict:
    """The document for a server whose model has `vocab_size` tokens."""
    refs, defs = _schemas()
    _bound_token_ids(defs, vocab_size)
    paths: dict = {}
    for op in OPERATIONS:
        paths.setdefault(op.path, {})[op.method] = _operation(op, refs)
    return {"openapi": "3.1.0",
            "info": {"title": "loraplex", "version": version,
                     "description": "Multi-tenant LoRA serving: OpenAI-compatible endpoints (tenant API keys), "
                                    "adapter uploads, and tenant administration (the admin token)."},
            "paths": paths,
            "components": {"schemas": defs,
                           "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}}}


async def openapi_json(request: Request) -> Response:
    doc = getattr(request.app.state, "openapi", None)
    if doc is None:
        vocab = request.app.state.lp.engine.info.vocab_size
        doc = request.app.state.openapi = build_openapi(loraplex_version(), vocab)
    return JSONResponse(doc)


ROUTES = [
    Route("/openapi.json", openapi_json, methods=["GET"]),
]
