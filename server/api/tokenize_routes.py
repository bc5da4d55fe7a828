"""/tokenize and /detokenize (vLLM's shapes): per tenant (its key), adapter-agnostic (adapters share the
base model's tokenizer, but `model` must still name the base model or one of the caller's adapters).

Both are requests like any other for the tenant's quotas: admitted (requests per minute, concurrency)
before their body is read, and bounded in size: /tokenize's text by what can fit in the context
(see prompts.py), /detokenize's ids by max_model_len (no sequence the model reads or writes is longer).
The tokenizer runs on worker threads.
"""
from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from server.api.auth import gated, require_tenant, state_of
from server.api.body import BASE_VALUES, lenient_scope, parse_model, read_json_object, read_model
from server.api.errors import APIError
from server.api.openai_routes import resolve_model
from server.api.openai_requests import DetokenizeRequest, TokenizeRequest


async def tokenize(request: Request) -> Response:
    tenant = await require_tenant(request)
    state = state_of(request)
    async with gated(state, tenant):
        req = parse_model(TokenizeRequest, await read_json_object(request), lenient_scope(request))
        await resolve_model(state, tenant, req.model)
        prompts = state.prompts
        if req.messages is not None:
            if not req.add_generation_prompt:
                raise APIError(400, "'add_generation_prompt' false is not supported", "unsupported",
                               param="add_generation_prompt")
            ids = await prompts.encode_chat([m.for_template() for m in req.messages])
        else:
            ids = await prompts.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    return JSONResponse({"count": len(ids), "max_model_len": prompts.max_model_len, "tokens": ids})


async def detokenize(request: Request) -> Response:
    tenant = await require_tenant(request)
    state = state_of(request)
    limit = state.prompts.max_model_len
    async with gated(state, tenant):
        req = await read_model(request, DetokenizeRequest, limit + BASE_VALUES, lenient_scope(request))
        if len(req.tokens) > limit:
            raise APIError(400, f"'tokens' has {len(req.tokens)} ids; at most {limit} (the maximum context "
                                f"length)", "context_length_exceeded", param="tokens")
        await resolve_model(state, tenant, req.model)
        vocab = state.engine.info.vocab_size
        if any(t >= vocab for t in req.tokens):
            raise APIError(400, f"'tokens' must be ids below the vocabulary size {vocab}", "invalid_value",
                           param="tokens")
        text = await state.prompts.detokenize(req.tokens)
    return JSONResponse({"prompt": text})


ROUTES = [
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
]
