"""Cumulative RequestOutputs as deltas on the wire, and back.

The engine's outputs are cumulative (every token so far; no text, which the front end makes:
server.engine.output_text); the core's output thread sends each choice only what it gained
(DeltaEncoder) and the front end's receiver rebuilds the cumulative output the in-process mode would
have given (OutputAssembler), so a step costs the wire O(new tokens), not O(tokens so far).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from server.engine.core.arrays import float_bytes, floats, int_bytes, ints
from server.engine.core.messages import Logprobs, OutputDelta
from server.engine.sequence import RequestOutput, TokenLogprobs


def pack_logprobs(entries: Sequence[TokenLogprobs]) -> Logprobs:
    return Logprobs(int_bytes(e.token_id for e in entries), float_bytes(e.logprob for e in entries),
                    int_bytes(len(e.top) for e in entries), int_bytes(t for e in entries for t, _ in e.top),
                    float_bytes(v for e in entries for _, v in e.top))


def unpack_logprobs(packed: Logprobs) -> list[TokenLogprobs]:
    top_ids, top_values = ints(packed.top_ids), floats(packed.top_values)
    out, at = [], 0
    for token, value, count in zip(ints(packed.token_ids), floats(packed.values), ints(packed.top_counts)):
        out.append(TokenLogprobs(token, value, tuple(zip(top_ids[at:at + count], top_values[at:at + count]))))
        at += count
    return out


@dataclass
class _Sent:
    """What the front end has of one choice."""

    tokens: int = 0
    logprobs: int = 0


@dataclass
class _Outgoing:
    owner: bytes  # the front end that submitted it
    unfinished: int
    choices: dict[int, _Sent] = field(default_factory=dict)
    prompt_logprobs_sent: bool = False


class DeltaEncoder:
    """The core's side (its output thread): each tracked request's owner and what it has been sent."""

    def __init__(self) -> None:
        self._requests: dict[str, _Outgoing] = {}

    def track(self, request_id: str, owner: bytes, n: int) -> None:
        self._requests[request_id] = _Outgoing(owner, n)

    def drop_owner(self, owner: bytes) -> None:
        for rid in [r for r, o in self._requests.items() if o.owner == owner]:
            del self._requests[rid]

    def encode(self, out: RequestOutput) -> tuple[bytes, OutputDelta] | None:
        """(its owner, the delta); None for a request no front end tracks (finished or never tracked)."""
        req = self._requests.get(out.request_id)
        if req is None:
            return None
        sent = req.choices.setdefault(out.index, _Sent())
        logprobs = None
        if out.logprobs is not None:
            logprobs = pack_logprobs(out.logprobs[sent.logprobs:])
            sent.logprobs = len(out.logprobs)
        prompt_logprobs = None
        if out.prompt_logprobs is not None and not req.prompt_logprobs_sent:
            prompt_logprobs = pack_logprobs(out.prompt_logprobs[1:])
            req.prompt_logprobs_sent = True
        delta = OutputDelta(out.request_id, out.index, int_bytes(out.token_ids[sent.tokens:]),
                            out.finished, out.finish_reason, out.error, out.error_is_client, out.num_cached_tokens,
                            logprobs, prompt_logprobs)
        sent.tokens = len(out.token_ids)
        if out.finished:
            req.unfinished -= 1
            if req.unfinished == 0:
                del self._requests[out.request_id]
        return req.owner, delta


@dataclass
class _Choice:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class _Incoming:
    prompt_ids: list[int]
    choices: dict[int, _Choice] = field(default_factory=dict)
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class OutputAssembler:
    """The front end's side (its receiver thread): deltas back into cumulative RequestOutputs."""

    def __init__(self) -> None:
        self._requests: dict[str, _Incoming] = {}

    def track(self, request_id: str, prompt_ids: list[int]) -> None:
        self._requests[request_id] = _Incoming(prompt_ids)

    def drop(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def apply(self, delta: OutputDelta) -> RequestOutput | None:
        req = self._requests.get(delta.request_id)
        if req is None:
            return None
        choice = req.choices.setdefault(delta.index, _Choice())
        choice.tokens += ints(delta.token_ids)
        if delta.logprobs is not None:
            if choice.logprobs is None:
                choice.logprobs = []
            choice.logprobs += unpack_logprobs(delta.logprobs)
        if delta.prompt_logprobs is not None:
            req.prompt_logprobs = [None, *unpack_logprobs(delta.prompt_logprobs)]
        return RequestOutput(
            request_id=delta.request_id, prompt_token_ids=req.prompt_ids, token_ids=choice.tokens[:],
            text="", finished=delta.finished, finish_reason=delta.finish_reason, error=delta.error,
            error_is_client=delta.error_is_client,
            index=delta.index, logprobs=None if choice.logprobs is None else choice.logprobs[:],
            prompt_logprobs=req.prompt_logprobs, num_cached_tokens=delta.num_cached_tokens)
