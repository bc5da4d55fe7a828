"""One generation request from quota check to usage record, shared by
/v1/completions and /v1/chat/completions.

Order matters: every check that can refuse (model, length, per-request cap,
rate/token/concurrency quota) runs before anything is allocated; the
admission, the adapter reference and the engine request are then released
exactly once in close(), however the request ends (finish, error, disconnect).
"""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio
from starlette.concurrency import run_in_threadpool

from adapters.registry import AdapterRecord, validate_name
from server.api.errors import APIError
from server.api.schemas import GenerationRequest
from server.api.state import ServerState
from server.engine import SamplingParams
from server.engine.async_engine import RequestStream
from tenants import Admission, Tenant, check_request_tokens

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(frozen=True)
class Delta:
    text: str                  # new text since the previous delta
    finish_reason: str | None  # set on the last one


async def resolve_model(state: ServerState, tenant: Tenant, model: str) -> AdapterRecord | None:
    """None for the base model, else the caller's own adapter of that name; 404 otherwise
    (the same answer whether or not another tenant has one)."""
    if model == state.model_id:
        return None
    try:
        validate_name(model)
    except ValueError:
        record = None
    else:
        record = await run_in_threadpool(state.registry.get, tenant.id, model)
    if record is None:
        raise APIError(404, f"the model '{model}' does not exist", "model_not_found")
    return record


def _max_tokens(state: ServerState, tenant: Tenant, req: GenerationRequest, prompt_len: int,
                chat: bool) -> int:
    if req.max_tokens is not None:
        return req.max_tokens
    if not chat:
        return COMPLETION_DEFAULT_MAX_TOKENS
    # Chat defaults to the rest of the context, within the tenant's own caps.
    room = state.engine.engine.max_model_len - prompt_len
    q = tenant.quota
    for cap in (q.max_tokens_per_request, None if q.tokens_per_minute is None else q.tokens_per_minute - prompt_len):
        if cap is not None:
            room = min(room, cap)
    return max(1, room)


class Generation:
    def __init__(self, state: ServerState, tenant: Tenant, endpoint: str, prompt_ids: list[int],
                 admission: Admission, stream: RequestStream, arrived: float) -> None:
        self.state = state
        self.tenant = tenant
        self.endpoint = endpoint
        self.request_id = stream.request_id
        self.prompt_tokens = len(prompt_ids)
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.created = int(time.time())
        self._admission = admission
        self._stream = stream
        self._arrived = arrived
        self._closed = False

    @classmethod
    async def start(cls, state: ServerState, tenant: Tenant, endpoint: str, req: GenerationRequest,
                    prompt_ids: list[int], record: AdapterRecord | None, arrived: float) -> "Generation":
        max_tokens = _max_tokens(state, tenant, req, len(prompt_ids), chat=req.messages is not None)
        limit = state.engine.engine.max_model_len
        if len(prompt_ids) + max_tokens > limit:
            raise APIError(400, f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds "
                                f"the maximum context length of {limit} tokens", "context_length_exceeded")
        check_request_tokens(tenant, max_tokens)
        try:
            params = SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                                    top_k=req.top_k, seed=req.seed, stop=req.stop,
                                    stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos)
        except ValueError as e:
            raise APIError(400, str(e), "invalid_value") from None
        prefix = "chatcmpl-" if endpoint == "chat" else "cmpl-"
        request_id = prefix + uuid.uuid4().hex
        admission = await run_in_threadpool(state.limiter.admit, tenant, request_id,
                                            len(prompt_ids) + max_tokens)
        version = None if record is None else record.version
        try:
            # The engine pages the adapter in from Redis if it is not resident; this request
            # waits for it without holding up anyone else's.
            stream = await state.engine.submit(request_id, prompt_ids, params, version, tenant.id,
                                               req.priority, tenant.quota.weight)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await run_in_threadpool(state.settlements.settle, tenant, admission, 0, 0)
            raise
        return cls(state, tenant, endpoint, prompt_ids, admission, stream, arrived)

    async def deltas(self) -> AsyncIterator[Delta]:
        metrics = self.state.metrics
        text = ""
        last = None
        async for out in self._stream:
            now = time.monotonic()
            new_tokens = len(out.token_ids) - self.completion_tokens
            if new_tokens > 0:
                if last is None:
                    metrics.ttft.observe(now - self._arrived)
                else:
                    metrics.itl.observe((now - last) / new_tokens)
                last = now
            self.completion_tokens = len(out.token_ids)
            piece = out.text[len(text):] if out.text.startswith(text) else ""
            text = out.text if out.text.startswith(text) else text
            if out.finished:
                if out.finish_reason == "error":
                    raise APIError(503, out.error or "generation failed", "adapter_unavailable")
                self.finish_reason = out.finish_reason
            if piece or out.finished:
                yield Delta(piece, self.finish_reason if out.finished else None)

    @property
    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    async def close(self) -> None:
        """Idempotent; aborts the engine request if it is still running."""
        if self._closed:
            return
        self._closed = True
        self._stream.abort()
        outcome = "ok" if self.finish_reason in ("stop", "length") else "aborted"
        m = self.state.metrics
        m.requests.labels(self.tenant.name, self.endpoint, outcome).inc()
        m.tokens.labels(self.tenant.name, "prompt").inc(self.prompt_tokens)
        m.tokens.labels(self.tenant.name, "completion").inc(self.completion_tokens)
        # Shielded: a disconnect cancels the request's scope, and the quota lease and
        # usage must still be settled (retried in the background if Redis is away).
        with anyio.CancelScope(shield=True):
            await run_in_threadpool(self.state.settlements.settle, self.tenant, self._admission,
                                    self.prompt_tokens, self.completion_tokens)
