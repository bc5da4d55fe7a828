"""OpenAI-compatible endpoints: /v1/models, /v1/models/{id}, /v1/completions, /v1/chat/completions."""
from __future__ import annotations

import json
import time

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from adapters.registry import AdapterRecord
from adapters.sharing import OPERATOR_OWNER
from server.api.adapter_references import resolve_lorax_adapter
from server.api.auth import check_completion_cap, check_request_cost, gated, require_tenant, state_of
from server.api.base_identity import unavailable_reason
from server.api.body import BASE_VALUES, lenient_scope, read_model
from server.api.openai_requests import (ChatCompletionRequest, CompletionRequest, constraint_of,
                                        max_tokens_for, sampling_params)
from server.api.errors import APIError
from server.api.generation import (ChatRenderer, CompletionRenderer, Generation, SSEResponse, resolve_model,
                                   until_disconnect)
from server.api.state import ServerState
from server.api.prompts import ToolPlan, chat_inputs, plan_tools, request_constraint
from tenants import Tenant


def _ref_card(state: ServerState, tenant: Tenant, name: str, created: float, owner: str) -> dict:
    base = state.model_id
    return {"id": name, "object": "model", "created": int(created), "owned_by": owner, "root": base,
            "parent": base, "max_model_len": state.engine.info.max_model_len}


def _listing(state: ServerState, tenant: Tenant) -> list[dict]:
    """The base model, the caller's adapters (fetched or not yet), then the operator's shared with it."""
    # Adapters of another base (server.api.base_identity) cannot be called: /v1/adapters lists them, with why.
    records = [r for r in state.registry.list(tenant.id) if unavailable_reason(r, state.base) is None]
    cards = [_model_card(state, tenant, None)] + [_model_card(state, tenant, r) for r in records]
    names = {r.name for r in records}
    for name, ref in sorted(state.references.list(tenant.id).items()):
        if name not in names:
            names.add(name)
            cards.append(_ref_card(state, tenant, name, ref.registered_at, tenant.name))
    for name in state.sharing.visible_names(tenant.id):
        record = state.registry.get(OPERATOR_OWNER, name)
        if name not in names and record is not None and unavailable_reason(record, state.base) is None:
            cards.append(_ref_card(state, tenant, name, record.created_at, "operator"))
    return cards


def _model_card(state: ServerState, tenant: Tenant, record: AdapterRecord | None) -> dict:
    base = state.model_id
    limit = state.engine.info.max_model_len
    if record is None:
        return {"id": base, "object": "model", "created": 0, "owned_by": "loraplex", "root": base,
                "parent": None, "max_model_len": limit}
    return {"id": record.name, "object": "model", "created": int(record.created_at), "owned_by": tenant.name,
            "root": base, "parent": base, "max_model_len": limit}


async def list_models(request: Request) -> Response:
    tenant = await require_tenant(request)
    state = state_of(request)
    return JSONResponse({"object": "list", "data": await run_in_threadpool(_listing, state, tenant)})


async def get_model(request: Request) -> Response:
    tenant = await require_tenant(request)
    state = state_of(request)
    model = request.path_params["model"]
    return JSONResponse(_model_card(state, tenant, await resolve_model(state, tenant, model)))


async def completions(request: Request) -> Response:
    return await _generate(request, chat=False)


async def chat_completions(request: Request) -> Response:
    return await _generate(request, chat=True)


async def _start_all(state: ServerState, tenant: Tenant, req, prompts: list[list[int]], max_tokens: list[int],
                     record: AdapterRecord | None, arrived: float, endpoint: str,
                     tools: ToolPlan | None = None) -> list[Generation]:
    """One generation per prompt; all or none (a refused one undoes those already started: a refused
    batch counts in no window and is not billed)."""
    gens: list[Generation] = []
    vocab = state.engine.info.vocab_size
    constraint = (request_constraint(req, tools, state.config.max_schema_bytes) if endpoint == "chat"
                  else constraint_of(req, state.config.max_schema_bytes))
    try:
        for ids, limit in zip(prompts, max_tokens):
            params = sampling_params(req, limit, vocab, None if constraint is None else constraint.spec)
            gens.append(await Generation.start(state, tenant, endpoint, params, ids, record, req.priority,
                                               arrived, req.cache_salt, constraint))
    except BaseException:
        for gen in gens:
            await gen.refuse()
        raise
    for gen in gens:
        gen.follow()
    return gens


def max_body_values(state: ServerState) -> int:
    """The most values a generation body can need: a full batch of token-id prompts plus the rest."""
    return state.config.max_batch_prompts * state.engine.info.max_model_len + BASE_VALUES


def _render(body: dict) -> bytes:
    # JSONResponse's encoding, on a worker thread: a large logprobs body is megabytes of JSON.
    return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")


async def _request_adapter(state: ServerState, tenant: Tenant, req) -> AdapterRecord | None:
    """`model`, or LoRAX's `adapter_id` (+ `adapter_source`), where `model` is then the base model."""
    if req.adapter_id is None:
        if req.adapter_source is not None:
            raise APIError(400, "'adapter_source' needs 'adapter_id'", "invalid_value", param="adapter_source")
        return await resolve_model(state, tenant, req.model)
    if req.model not in (state.model_id, req.adapter_id):
        raise APIError(400, f"'adapter_id' {req.adapter_id[:200]!r} and 'model' {req.model[:200]!r} disagree: "
                            f"with adapter_id, send the base model {state.model_id!r} as model", "invalid_value",
                       param="adapter_id")
    if req.adapter_source is None and req.adapter_id == state.model_id:
        return None
    return await resolve_lorax_adapter(state, tenant, req.adapter_id, req.adapter_source)


async def _generate(request: Request, chat: bool) -> Response:
    arrived = time.monotonic()
    tenant = await require_tenant(request)
    state = state_of(request)
    # Admitted (rate, concurrency) before the body is read: an over-quota tenant's body is never parsed.
    async with gated(state, tenant) as gate:
        req = await read_model(request, ChatCompletionRequest if chat else CompletionRequest,
                               max_body_values(state), lenient_scope(request))
        record = await _request_adapter(state, tenant, req)
        tools = plan_tools(req, state.config.tool_call_parser if state.config.enable_auto_tool_choice else None,
                           state.config.max_schema_bytes) if chat else None
        if chat:
            prompts = [await state.prompts.encode_chat(*chat_inputs(req, tools, state.prompts.chat_template))]
        else:
            batch = req.prompts()
            cap = state.config.max_batch_prompts
            if len(batch) > cap:
                raise APIError(400, f"'prompt' is a batch of {len(batch)} prompts; at most {cap} "
                                    f"(--max-batch-prompts)", "invalid_value", param="prompt")
            check_completion_cap(req, tenant, len(batch))
            prompts = await state.prompts.encode_batch(batch)
        limit = state.engine.info.max_model_len
        max_tokens = [max_tokens_for(req, tenant, len(ids), limit) for ids in prompts]
        check_request_cost(req, tenant, [len(ids) for ids in prompts], max_tokens,
                           state.config.max_logprob_entries)
        await gate.hand_over()
        gens = await _start_all(state, tenant, req, prompts, max_tokens, record, arrived,
                                "chat" if chat else "completions", tools)
        if tools is not None:
            state.metrics.tool_requests.labels(tools.mode).inc()
    texts = state.prompts.token_texts
    if chat:
        renderer = ChatRenderer(req, gens, texts, req.model, tools)
    else:
        echo = [(p if isinstance(p, str) else state.prompts.decode(p)) if req.echo else "" for p in batch]
        renderer = CompletionRenderer(req, gens, texts, req.model, echo)

    async def close() -> None:
        for gen in gens:
            await gen.close()

    if req.stream:
        return SSEResponse(renderer.stream(), close)
    try:
        completed, _ = await until_disconnect(request, renderer.collect)
    finally:
        await close()
    if not completed:
        return Response(status_code=499)  # nobody is listening; the engine requests were aborted
    return Response(await run_in_threadpool(lambda: _render(renderer.body())), media_type="application/json")


ROUTES = [
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model:path}", get_model, methods=["GET"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
]
