"""OpenAI-compatible endpoints (/v1/models, /v1/models/{id}, /v1/completions, /v1/chat/completions)
and the generations they run.

A request's generations and their responses: each prompt's generation (its n choices) from quota
check to usage record, turned into an OpenAI response (the whole body, or SSE chunks) that ends
the generation when the client goes away. Shared by /v1/completions (one generation per prompt of
a batch) and /v1/chat/completions.

Order matters: every check that can refuse (model, length, per-request cap,
rate/token/concurrency quota) runs before anything is allocated; the
admission, the adapter reference and the engine request are then released
exactly once in close(), however the request ends (finish, error, disconnect).

Starlette only notices a disconnect when a send fails; the responses here watch for
`http.disconnect` while generating, so an abandoned request is aborted (and its
KV blocks freed) at once, and `on_close` always runs exactly once.

A completions request may carry a batch of prompts, each with n choices; its
choices are numbered prompt-major (OpenAI's order: prompt i's choice j is
i * n + j). Chat has one prompt. The generations run concurrently in the
engine; `merged` interleaves their deltas as they arrive.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import anyio
import msgspec
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from adapters.registry import AdapterRecord
from adapters.sharing import OPERATOR_OWNER
from server.api.adapter_references import resolve_adapter, resolve_lorax_adapter
from server.api.auth import (cancel_admission, charged_compile, check_completion_cap, check_request_cost, gated,
                             keep_admission, require_tenant, state_of)
from server.api.base_identity import unavailable_reason
from server.api.body import BASE_VALUES, INLINE_PARSE_BYTES, lenient_scope, read_model
from server.api.errors import APIError, to_api_error
from server.api.logprob_format import CompletionLogprobs, chat_content, merge_blocks, prompt_logprobs
from server.api.openai_requests import (ChatCompletionRequest, CompletionRequest, Constraint, constraint_of,
                                        max_tokens_for, sampling_params)
from server.api.prompts import ChoiceToolCalls, ToolPlan, chat_inputs, plan_tools, request_constraint
from server.api.raw_cost import cost_fields
from server.api.state import ServerState
from server.api.token_text import TokenText
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


class _ChoiceProgress:
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
        self.choices = [_ChoiceProgress() for _ in range(params.n)]
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


def sse_event(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode("utf-8")


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class SSEResponse:
    """text/event-stream of the byte chunks `events` yields; `on_close` settles the request."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]]) -> None:
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def pump() -> None:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                    (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]})
            async for chunk in self._events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            async with anyio.create_task_group() as tg:
                async def watch() -> None:
                    await _wait_disconnect(receive)
                    tg.cancel_scope.cancel()
                tg.start_soon(watch)
                try:
                    await pump()
                except OSError:
                    pass  # the client went away mid-send
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self._events.aclose()
                await self._on_close()


async def until_disconnect(request: Request, work: Callable[[], Awaitable[object]]) -> tuple[bool, object]:
    """Run work() unless the client disconnects first: (completed, result)."""
    result: list[object] = []
    errors: list[BaseException] = []
    async with anyio.create_task_group() as tg:
        async def watch() -> None:
            await _wait_disconnect(request.receive)
            tg.cancel_scope.cancel()

        async def run() -> None:
            try:
                result.append(await work())
            except Exception as e:  # noqa: BLE001 - re-raised below, outside the task group
                errors.append(e)
            tg.cancel_scope.cancel()
        tg.start_soon(watch)
        tg.start_soon(run)
    if errors:
        raise errors[0]
    return (bool(result), result[0] if result else None)


async def merged(gens: list[Generation]) -> AsyncIterator[tuple[int, Delta]]:
    """(generation index, delta) from all generations, in arrival order; errors propagate."""
    if len(gens) == 1:
        async for d in gens[0].deltas():
            yield 0, d
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen: Generation) -> None:
        try:
            async for d in gen.deltas():
                queue.put_nowait((i, d, None))
        except Exception as e:  # noqa: BLE001 - re-raised by the consumer
            queue.put_nowait((i, None, e))
            return
        queue.put_nowait((i, None, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(gens)
        while remaining:
            i, d, error = await queue.get()
            if error is not None:
                raise error
            if d is None:
                remaining -= 1
                continue
            yield i, d
    finally:
        for t in tasks:
            t.cancel()


class _RenderedChoice:
    __slots__ = ("text", "logprobs", "finish_reason", "started", "lp")

    def __init__(self, lp: CompletionLogprobs | None) -> None:
        self.text = ""
        self.logprobs: dict | list | None = None
        self.finish_reason: str | None = None
        self.started = False
        self.lp = lp


class Renderer:
    """Shared by both endpoints: choice bookkeeping, the body, the stream."""

    kind: str
    chunk_kind: str

    def __init__(self, req, gens: list[Generation], texts: TokenText, model: str) -> None:
        self.req = req
        self.gens = gens
        self.texts = texts
        self.model = model
        self.n = req.n
        self.choices: dict[int, _RenderedChoice] = {}
        self._collected: list[tuple[int, Delta]] = []

    def _choice(self, gen_index: int, d: Delta) -> tuple[int, _RenderedChoice]:
        index = gen_index * self.n + d.index
        if index not in self.choices:
            self.choices[index] = _RenderedChoice(self._new_logprobs())
        return index, self.choices[index]

    def _new_logprobs(self) -> CompletionLogprobs | None:
        return None

    async def collect(self) -> None:
        """Gather every delta; the text and logprobs are built by body(), off the event loop."""
        async for gen_index, d in merged(self.gens):
            self._collected.append((gen_index, d))

    def body(self) -> dict:
        """The whole response (CPU-heavy for large logprobs: the caller runs it on a worker thread)."""
        for gen_index, d in self._collected:
            _, choice = self._choice(gen_index, d)
            self._absorb(gen_index, choice, d)
        self._collected = []
        first = self.gens[0]
        return {"id": first.request_id, "object": self.kind, "created": first.created, "model": self.model,
                "choices": [self._final_choice(i, c) for i, c in sorted(self.choices.items())],
                "usage": usage(self.gens), **self._extra_body()}

    def _extra_body(self) -> dict:
        return {}

    async def stream(self) -> AsyncIterator[bytes]:
        first = self.gens[0]
        include_usage = self.req.include_usage

        def chunk(choices: list, usage_body: dict | None = None) -> bytes:
            payload = {"id": first.request_id, "object": self.chunk_kind, "created": first.created,
                       "model": self.model, "choices": choices}
            if include_usage:
                payload["usage"] = usage_body  # null on every chunk but the last (OpenAI's shape)
            return sse_event(payload)

        try:
            for choice in self._opening():
                yield chunk([choice])
            async for gen_index, d in merged(self.gens):
                index, choice = self._choice(gen_index, d)
                for part in self._chunk_choices(gen_index, index, choice, d):
                    yield chunk([part])
            if include_usage:
                yield chunk([], usage(self.gens))
        except Exception as e:  # noqa: BLE001 - headers are sent: the error goes in the stream
            yield sse_event(to_api_error(e).body())
        yield sse_event("[DONE]")


class CompletionRenderer(Renderer):
    kind = chunk_kind = "text_completion"

    def __init__(self, req: CompletionRequest, gens, texts, model, echo_texts: list[str]) -> None:
        super().__init__(req, gens, texts, model)
        self.echo_texts = echo_texts

    def _new_logprobs(self) -> CompletionLogprobs | None:
        return CompletionLogprobs(self.texts) if self.req.logprobs is not None else None

    def _opening_text(self, gen_index: int, choice: _RenderedChoice) -> tuple[str, dict | None]:
        """What comes before the first generated token of a choice: the echoed prompt."""
        choice.started = True
        if not self.req.echo:
            return "", None
        gen = self.gens[gen_index]
        block = None
        if choice.lp is not None and gen.prompt_logprobs is not None:
            block = choice.lp.block(gen.prompt_logprobs, gen.prompt_ids)
        return self.echo_texts[gen_index], block

    def _absorb(self, gen_index: int, choice: _RenderedChoice, d: Delta) -> None:
        if not choice.started:
            text, block = self._opening_text(gen_index, choice)
            choice.text += text
            if block is not None:
                choice.logprobs = merge_blocks(choice.logprobs, block)
        choice.text += d.text
        if choice.lp is not None and d.token_ids:
            choice.logprobs = merge_blocks(choice.logprobs, choice.lp.block(d.logprobs, d.token_ids))
        choice.finish_reason = d.finish_reason

    def _final_choice(self, index: int, c: _RenderedChoice) -> dict:
        out = {"index": index, "text": c.text, "logprobs": c.logprobs, "finish_reason": c.finish_reason}
        if self.req.prompt_logprobs is not None:
            gen = self.gens[index // self.n]
            out["prompt_logprobs"] = prompt_logprobs(self.texts, gen.prompt_logprobs or [])
        return out

    def _opening(self) -> list[dict]:
        return []

    def _chunk_choices(self, gen_index: int, index: int, choice: _RenderedChoice, d: Delta) -> list[dict]:
        text, logprobs = "", None
        if not choice.started:
            text, logprobs = self._opening_text(gen_index, choice)
        text += d.text
        if choice.lp is not None and d.token_ids:
            logprobs = merge_blocks(logprobs, choice.lp.block(d.logprobs, d.token_ids))
        parts = []
        if text or logprobs is not None:
            parts.append({"index": index, "text": text, "logprobs": logprobs, "finish_reason": None})
        if d.finish_reason is not None:
            parts.append({"index": index, "text": "", "logprobs": None, "finish_reason": d.finish_reason})
        return parts


class ChatRenderer(Renderer):
    kind = "chat.completion"
    chunk_kind = "chat.completion.chunk"

    def __init__(self, req: ChatCompletionRequest, gens, texts, model, tools: ToolPlan | None = None) -> None:
        super().__init__(req, gens, texts, model)
        self.tools = tools
        self._tool_calls: dict[int, ChoiceToolCalls] = {}

    def _content(self, index: int, d: Delta) -> tuple[str, list[dict]]:
        """The delta's content and tool-call items (server.api.prompts reads calls out of the text)."""
        if self.tools is None or self.tools.mode == "none":
            return d.text, []
        calls = self._tool_calls.get(index)
        if calls is None:
            calls = self._tool_calls[index] = ChoiceToolCalls(self.tools.new_parser())
        return calls.absorb(d.text, d.finish_reason is not None)

    def _absorb(self, gen_index: int, choice: _RenderedChoice, d: Delta) -> None:
        choice.text += self._content(gen_index * self.n + d.index, d)[0]
        if self.req.logprobs:
            choice.logprobs = (choice.logprobs or []) + chat_content(self.texts, d.logprobs)
        choice.finish_reason = d.finish_reason

    def _final_choice(self, index: int, c: _RenderedChoice) -> dict:
        logprobs = {"content": c.logprobs or []} if self.req.logprobs else None
        calls = self._tool_calls.get(index)
        if calls is None:
            return {"index": index, "message": {"role": "assistant", "content": c.text}, "logprobs": logprobs,
                    "finish_reason": c.finish_reason}
        return {"index": index, "message": calls.message(c.text), "logprobs": logprobs,
                "finish_reason": calls.finish_reason(c.finish_reason)}

    def _extra_body(self) -> dict:
        if self.req.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": prompt_logprobs(self.texts, self.gens[0].prompt_logprobs or [])}

    def _opening(self) -> list[dict]:
        # OpenAI opens each choice with the assistant role and empty content.
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for i in range(self.n)]

    def _chunk_choices(self, gen_index: int, index: int, choice: _RenderedChoice, d: Delta) -> list[dict]:
        parts = []
        content, calls = self._content(index, d)
        if content or (self.req.logprobs and d.token_ids):
            logprobs = {"content": chat_content(self.texts, d.logprobs)} if self.req.logprobs else None
            parts.append({"index": index, "delta": {"content": content}, "logprobs": logprobs,
                          "finish_reason": None})
        if calls:
            parts.append({"index": index, "delta": {"tool_calls": calls}, "logprobs": None, "finish_reason": None})
        if d.finish_reason is not None:
            reason = d.finish_reason if index not in self._tool_calls else \
                self._tool_calls[index].finish_reason(d.finish_reason)
            parts.append({"index": index, "delta": {}, "logprobs": None, "finish_reason": reason})
        return parts


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


def _check_batch_size(state: ServerState, tenant: Tenant, req: CompletionRequest, prompts: int) -> None:
    cap = state.config.max_batch_prompts
    if prompts > cap:
        raise APIError(400, f"'prompt' is a batch of {prompts} prompts; at most {cap} "
                            f"(--max-batch-prompts)", "invalid_value", param="prompt")
    check_completion_cap(req, tenant, prompts)


def _checked_max_tokens(state: ServerState, tenant: Tenant, req, prompt_lens: list[int]) -> list[int]:
    """Each prompt's completion limit, once the request's cost is within the tenant's and server's bounds."""
    limit = state.engine.info.max_model_len
    max_tokens = [max_tokens_for(req, tenant, n, limit) for n in prompt_lens]
    check_request_cost(req, tenant, prompt_lens, max_tokens, state.config.max_logprob_entries)
    return max_tokens


def _refuse_costly_raw(state: ServerState, tenant: Tenant, raw: bytearray) -> None:
    """The route's cost refusals on a large completions body's raw counts, where they are exact
    (server.api.raw_cost), in the route's order and with its messages; nothing where they are not."""
    found = cost_fields(raw) if len(raw) > INLINE_PARSE_BYTES else None
    if found is None:
        return
    fields, lengths = found
    req = CompletionRequest.model_construct(echo=fields.echo, logprobs=fields.logprobs,
                                            prompt_logprobs=fields.prompt_logprobs, n=fields.n,
                                            max_tokens=fields.max_tokens)
    _check_batch_size(state, tenant, req, len(lengths))
    for n in lengths:
        state.prompts.check_token_count(n, "prompt")
    _checked_max_tokens(state, tenant, req, lengths)


def _render(body: dict) -> bytes:
    """The response body as compact UTF-8 JSON, on a worker thread. msgspec, not json.dumps: either is one C
    call that holds the GIL throughout, and the event loop relaying every other stream waits for it; an
    echo with top-20 logprobs over a 2,046-token prompt (1.2 MB) takes json.dumps ~23 ms, msgspec ~2 ms.
    The same JSON values, each float exactly (spelled its own way: -3.75e-05 is -0.0000375), except that a
    non-finite float, which no response holds (a request whose values go non-finite fails with an error), would
    be written null where json.dumps failed."""
    return msgspec.json.encode(body)


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
                               max_body_values(state), lenient_scope(request),
                               None if chat else lambda raw: _refuse_costly_raw(state, tenant, raw))
        record = await _request_adapter(state, tenant, req)
        tools = plan_tools(req, state.config.tool_call_parser if state.config.enable_auto_tool_choice else None,
                           state.config.max_schema_bytes) if chat else None
        if chat:
            prompts = [await state.prompts.encode_chat(*chat_inputs(req, tools, state.prompts.chat_template))]
        else:
            batch = req.prompts()
            _check_batch_size(state, tenant, req, len(batch))
            prompts = await state.prompts.encode_batch(batch)
        max_tokens = _checked_max_tokens(state, tenant, req, [len(ids) for ids in prompts])
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
