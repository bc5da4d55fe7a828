"""Turning generations' deltas into OpenAI responses: the whole body, or SSE chunks.

A completions request may carry a batch of prompts, each with n choices; its
choices are numbered prompt-major (OpenAI's order: prompt i's choice j is
i * n + j). Chat has one prompt. The generations run concurrently in the
engine; `merged` interleaves their deltas as they arrive.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from server.api.errors import to_api_error
from server.api.generation import Delta, Generation, usage
from server.api.logprob_format import CompletionLogprobs, chat_content, merge_blocks, prompt_logprobs
from server.api.openai_requests import ChatCompletionRequest, CompletionRequest
from server.api.sse import sse_event
from server.api.tool_calls import ChoiceToolCalls, ToolPlan
from server.api.token_text import TokenText


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


class _Choice:
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
        self.choices: dict[int, _Choice] = {}
        self._collected: list[tuple[int, Delta]] = []

    def _choice(self, gen_index: int, d: Delta) -> tuple[int, _Choice]:
        index = gen_index * self.n + d.index
        if index not in self.choices:
            self.choices[index] = _Choice(self._new_logprobs())
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

    def _opening_text(self, gen_index: int, choice: _Choice) -> tuple[str, dict | None]:
        """What comes before the first generated token of a choice: the echoed prompt."""
        choice.started = True
        if not self.req.echo:
            return "", None
        gen = self.gens[gen_index]
        block = None
        if choice.lp is not None and gen.prompt_logprobs is not None:
            block = choice.lp.block(gen.prompt_logprobs, gen.prompt_ids)
        return self.echo_texts[gen_index], block

    def _absorb(self, gen_index: int, choice: _Choice, d: Delta) -> None:
        if not choice.started:
            text, block = self._opening_text(gen_index, choice)
            choice.text += text
            if block is not None:
                choice.logprobs = merge_blocks(choice.logprobs, block)
        choice.text += d.text
        if choice.lp is not None and d.token_ids:
            choice.logprobs = merge_blocks(choice.logprobs, choice.lp.block(d.logprobs, d.token_ids))
        choice.finish_reason = d.finish_reason

    def _final_choice(self, index: int, c: _Choice) -> dict:
        out = {"index": index, "text": c.text, "logprobs": c.logprobs, "finish_reason": c.finish_reason}
        if self.req.prompt_logprobs is not None:
            gen = self.gens[index // self.n]
            out["prompt_logprobs"] = prompt_logprobs(self.texts, gen.prompt_logprobs or [])
        return out

    def _opening(self) -> list[dict]:
        return []

    def _chunk_choices(self, gen_index: int, index: int, choice: _Choice, d: Delta) -> list[dict]:
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
        """The delta's content and tool-call items (server.api.tool_calls reads calls out of the text)."""
        if self.tools is None or self.tools.mode == "none":
            return d.text, []
        calls = self._tool_calls.get(index)
        if calls is None:
            calls = self._tool_calls[index] = ChoiceToolCalls(self.tools.new_parser())
        return calls.absorb(d.text, d.finish_reason is not None)

    def _absorb(self, gen_index: int, choice: _Choice, d: Delta) -> None:
        choice.text += self._content(gen_index * self.n + d.index, d)[0]
        if self.req.logprobs:
            choice.logprobs = (choice.logprobs or []) + chat_content(self.texts, d.logprobs)
        choice.finish_reason = d.finish_reason

    def _final_choice(self, index: int, c: _Choice) -> dict:
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

    def _chunk_choices(self, gen_index: int, index: int, choice: _Choice, d: Delta) -> list[dict]:
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
