"""OpenAI-compatible endpoints: /v1/models, /v1/completions, /v1/chat/completions."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from server.api.auth import require_tenant, state_of
from server.api.errors import to_api_error
from server.api.generation import Generation, resolve_model
from server.api.body import read_json_object
from server.api.schemas import GenerationRequest, parse_chat, parse_completion
from server.api.sse import SSEResponse, sse_event, until_disconnect


async def list_models(request: Request) -> Response:
    tenant = await require_tenant(request)
    state = state_of(request)
    records = await run_in_threadpool(state.registry.list, tenant.id)
    base = {"id": state.model_id, "object": "model", "created": 0, "owned_by": "loraplex",
            "root": state.model_id, "parent": None}
    data = [base] + [{"id": r.name, "object": "model", "created": int(r.created_at),
                      "owned_by": tenant.name, "root": state.model_id, "parent": state.model_id}
                     for r in records]
    return JSONResponse({"object": "list", "data": data})


async def completions(request: Request) -> Response:
    return await _generate(request, chat=False)


async def chat_completions(request: Request) -> Response:
    return await _generate(request, chat=True)


async def _generate(request: Request, chat: bool) -> Response:
    arrived = time.monotonic()
    tenant = await require_tenant(request)
    state = state_of(request)
    body = await read_json_object(request)
    req = parse_chat(body) if chat else parse_completion(body)
    record = await resolve_model(state, tenant, req.model)
    if chat:
        prompt_ids = await state.prompts.encode_chat(req.messages)
    else:
        prompt_ids = await state.prompts.encode(req.prompt)
    gen = await Generation.start(state, tenant, "chat" if chat else "completions", req, prompt_ids,
                                 record, arrived)
    if req.stream:
        return SSEResponse(_stream_events(gen, req, chat), gen.close)
    try:
        completed, text = await until_disconnect(request, lambda: _collect(gen))
    finally:
        await gen.close()
    if not completed:
        return Response(status_code=499)  # nobody is listening; the engine request was aborted
    return JSONResponse(_final_body(gen, req, chat, text))


async def _collect(gen: Generation) -> str:
    return "".join([d.text async for d in gen.deltas()])


def _final_body(gen: Generation, req: GenerationRequest, chat: bool, text: str) -> dict:
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": None, "finish_reason": gen.finish_reason}
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": gen.finish_reason}
        kind = "text_completion"
    return {"id": gen.request_id, "object": kind, "created": gen.created, "model": req.model,
            "choices": [choice], "usage": gen.usage}


async def _stream_events(gen: Generation, req: GenerationRequest, chat: bool) -> AsyncIterator[bytes]:
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choices: list, usage: dict | None = None) -> bytes:
        payload = {"id": gen.request_id, "object": kind, "created": gen.created, "model": req.model,
                   "choices": choices}
        if req.include_usage:
            payload["usage"] = usage  # null on every chunk but the last (OpenAI's shape)
        return sse_event(payload)

    def choice(text: str | None, finish: str | None, role: bool = False) -> dict:
        if not chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

    try:
        if chat:
            yield chunk([choice(None, None, role=True)])
        async for d in gen.deltas():
            if d.finish_reason is not None:
                if d.text:
                    yield chunk([choice(d.text, None)])
                yield chunk([choice(None if chat else "", d.finish_reason)])
            else:
                yield chunk([choice(d.text, None)])
        if req.include_usage:
            yield chunk([], gen.usage)
    except Exception as e:  # noqa: BLE001 - headers are sent: the error goes in the stream
        yield sse_event(to_api_error(e).body())
    yield sse_event("[DONE]")


ROUTES = [
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
]
