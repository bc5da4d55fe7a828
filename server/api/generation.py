"""One prompt's generation (its n choices) from quota check to usage record, shared by
/v1/completions (one per prompt of a batch) and /v1/chat/completions.

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

from adapters.registry import AdapterRecord
from server.api.adapter_references import resolve_adapter
from server.api.errors import APIError
from server.api.openai_requests import Constraint
from server.api.quota import cancel_admission, charged_compile, keep_admission
from server.api.state import ServerState
from server.engine import SamplingParams
from server.engine.protocol import EngineRequest, OutputStream, RequestOutput, TokenLogprobs
from tenants import Admission, Tenant


@dataclass(frozen=True)
class Delta:
    index: int                          # the choice, within this prompt's n
    text: str                           # new text since the previous delta of this choice
    token_ids: list[int]                # new tokens since the previous delta
    logprobs: list[TokenLogprobs]       # theirs, when asked for
    finish_reason: str | None           # set on the choice's last delta


async def resolve_model(state: ServerState, tenant: Tenant, model: str) -> AdapterRecord | None:
    """None for the base model, else an adapter the caller may use (server.api.adapter_references);
    404 otherwise (the same answer whether or not another tenant has one)."""
    if model == state.model_id:
        return None
    return await resolve_adapter(state, tenant, model)


class _Choice:
    """How far one choice's outputs have been handed out."""

    __slots__ = ("text", "tokens", "finish_reason")

    def __init__(self) -> None:
        self.text = ""
        self.tokens = 0
        self.finish_reason: str | None = None


class Generation:
    def __init__(self, state: ServerState, tenant: Tenant, endpoint: str, prompt_ids: list[int],
                 params: SamplingParams, admission: Admission, stream: OutputStream, arrived: float,
                 adapter: str | None) -> None:
        self.state = state
        self.tenant = tenant
        self.endpoint = endpoint
        self.request_id = stream.request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.adapter = adapter  # its name, for the usage log; None: the base model
        self.prompt_tokens = len(prompt_ids)
        self.cached_tokens = 0
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None
        self.created = int(time.time())
        self.choices = [_Choice() for _ in range(params.n)]
        self._admission = admission
        self._stream = stream
        self._arrived = arrived
        self._last_token_at: float | None = None
        self._closed = False

    @classmethod
    async def start(cls, state: ServerState, tenant: Tenant, endpoint: str, params: SamplingParams,
                    prompt_ids: list[int], record: AdapterRecord | None, priority: int,
                    arrived: float, cache_salt: str | None = None,
                    constraint: Constraint | None = None) -> "Generation":
        limit = state.engine.info.max_model_len
        if len(prompt_ids) + params.max_tokens > limit:
            raise APIError(400, f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                                f"the maximum context length of {limit} tokens", "context_length_exceeded",
                           # the prompt fits: what asks for too much is max_tokens
                           param="max_tokens" if len(prompt_ids) < limit else "messages" if endpoint == "chat"
                           else "prompt")
        request_id = ("chatcmpl-" if endpoint == "chat" else "cmpl-") + uuid.uuid4().hex
        admission = await run_in_threadpool(state.limiter.admit, tenant, request_id,
                                            len(prompt_ids) + params.max_tokens * params.n)
        adapter = None if record is None else record.name
        state.settlements.open(tenant, admission, len(prompt_ids), adapter)  # its lease's heartbeat
        version = None if record is None else record.version
        try:
            # Compiled while the request holds its admission (the tenant's concurrency), and before
            # the engine sees it: the step loop never waits on a compile.
            grammar = None if constraint is None else await charged_compile(state, tenant, constraint)
        except APIError as e:
            if e.status == 400:  # the compile failed or hit its deadline: its CPU was spent, so it counts
                await keep_admission(state, admission)
            else:
                await cancel_admission(state, admission)
            raise
        except BaseException:
            await cancel_admission(state, admission)
            raise
        try:
            # The engine pages the adapter in from Redis if it is not resident; this request
            # waits for it without holding up anyone else's.
            stream = await state.engine.submit(EngineRequest(
                request_id, prompt_ids, params, version, tenant.id, priority, tenant.quota.weight,
                cache_salt=cache_salt, grammar=grammar))
        except BaseException:
            await cancel_admission(state, admission)  # refused by the engine: neither counted nor billed
            raise
        return cls(state, tenant, endpoint, prompt_ids, params, admission, stream, arrived, adapter)

    def follow(self) -> None:
        """Record this generation's usage while it runs. Only once its whole batch has started: a batch
        refused part way is billed nothing, so none of it may be recorded before then."""
        self.state.settlements.follow(self._admission, lambda: self.completion_tokens)

    @property
    def completion_tokens(self) -> int:
        return sum(c.tokens for c in self.choices)

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    def _observe_latency(self, new_tokens: int) -> None:
        now = time.monotonic()
        metrics = self.state.metrics
        self.state.history.note_tokens(new_tokens)
        if self._last_token_at is None:
            metrics.ttft.observe(now - self._arrived)
            self.state.history.note_ttft(now - self._arrived)
        else:
            metrics.itl.observe((now - self._last_token_at) / new_tokens)
        self._last_token_at = now

    def _delta(self, out: RequestOutput) -> Delta | None:
        choice = self.choices[out.index]
        new_tokens = out.token_ids[choice.tokens:]
        new_logprobs = list(out.logprobs[choice.tokens:]) if out.logprobs is not None else []
        if new_tokens:
            self._observe_latency(len(new_tokens))
        choice.tokens = len(out.token_ids)
        # Text may be held back (a possible stop string) and later shortened (a stop string found).
        piece = out.text[len(choice.text):] if out.text.startswith(choice.text) else ""
        if out.text.startswith(choice.text):
            choice.text = out.text
        if out.finished:
            if out.finish_reason == "error":
                if out.error_is_client:  # its constraint ran past its mask budget
                    raise APIError(400, out.error, "constraint_too_costly")
                raise APIError(503, out.error or "generation failed", "generation_failed")
            choice.finish_reason = out.finish_reason
        if not (piece or new_tokens or out.finished):
            return None
        return Delta(out.index, piece, list(new_tokens), new_logprobs, choice.finish_reason)

    async def deltas(self) -> AsyncIterator[Delta]:
        async for out in self._stream:
            if self.prompt_logprobs is None and out.prompt_logprobs is not None:
                self.prompt_logprobs = list(out.prompt_logprobs)
            self.cached_tokens = max(self.cached_tokens, getattr(out, "num_cached_tokens", 0) or 0)
            delta = self._delta(out)
            if delta is not None:
                yield delta

    async def refuse(self) -> None:
        """Undo a generation whose request was refused as a whole (another prompt of its batch was):
        aborted, its admission cancelled, nothing billed. Idempotent, and a no-op after close()."""
        if self._closed:
            return
        self._closed = True
        self._stream.abort()
        await cancel_admission(self.state, self._admission)

    async def close(self) -> None:
        """Idempotent; aborts the engine request if it is still running."""
        if self._closed:
            return
        self._closed = True
        self._stream.abort()
        done = self.finished and all(c.finish_reason in ("stop", "length") for c in self.choices)
        m = self.state.metrics
        m.requests.labels(self.tenant.name, self.endpoint, "ok" if done else "aborted").inc()
        m.tokens.labels(self.tenant.name, "prompt").inc(self.prompt_tokens)
        m.tokens.labels(self.tenant.name, "completion").inc(self.completion_tokens)
        # Shielded: a disconnect cancels the request's scope, and the quota lease and
        # usage must still be settled (retried in the background if Redis is away).
        with anyio.CancelScope(shield=True):
            await run_in_threadpool(self.state.settlements.settle, self.tenant, self._admission,
                                    self.prompt_tokens, self.completion_tokens, self.adapter)


def usage(gens: list[Generation]) -> dict:
    prompt = sum(g.prompt_tokens for g in gens)
    completion = sum(g.completion_tokens for g in gens)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(g.cached_tokens for g in gens)}}
