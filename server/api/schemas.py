"""Parsing OpenAI request bodies into a typed request, refusing what we cannot honour.

Field type errors are 422; values we understand but do not support (n > 1,
logprobs) are 400 with a message that says so. Unknown fields are ignored,
as OpenAI clients send extras.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from server.api.errors import APIError

MAX_MODEL_ID_CHARS = 256
MAX_STOP_CHARS = 1024          # per stop string
MAX_STOP_TOKEN_IDS = 64
MAX_MESSAGES = 4096
INT64 = (-(1 << 63), (1 << 63) - 1)


@dataclass(frozen=True)
class GenerationRequest:
    model: str
    prompt: str | list[int] | None      # completions
    messages: list[dict] | None         # chat
    max_tokens: int | None              # None: the endpoint's default
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    priority: int = 0                   # within the caller's tenant: lower values are served first


def _bad(field: str, why: str) -> APIError:
    return APIError(422, f"'{field}' {why}", "invalid_field")


def _unsupported(field: str, why: str) -> APIError:
    return APIError(400, f"'{field}' {why} is not supported", "unsupported")


def _int(body: dict, field: str, default: Any, lo: int | None = None, hi: int = INT64[1]) -> Any:
    v = body.get(field, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(field, "must be an integer")
    lo = INT64[0] if lo is None else lo
    if not lo <= v <= hi:
        raise APIError(400, f"'{field}' must be in [{lo}, {hi}], got {v}", "invalid_value")
    return v


def _number(body: dict, field: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(field, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _bad(field, "must be a number")
    if v > hi or v < lo or (lo_open and v == lo):
        raise APIError(400, f"'{field}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}",
                       "invalid_value")
    return float(v)


def _bool(body: dict, field: str, default: bool) -> bool:
    v = body.get(field, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(field, "must be true or false")
    return v


def _common(body: dict, *, chat: bool) -> dict:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", "is required and must be a string")
    if len(model) > MAX_MODEL_ID_CHARS:
        raise APIError(400, f"'model' is longer than {MAX_MODEL_ID_CHARS} characters", "invalid_value")
    if _int(body, "n", 1) != 1:
        raise _unsupported("n", "other than 1")
    if not chat and _int(body, "best_of", 1) != 1:
        raise _unsupported("best_of", "other than 1")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") not in (None, 0):
        raise _unsupported("logprobs", "")
    if body.get("echo") not in (None, False):
        raise _unsupported("echo", "")
    for field in ("presence_penalty", "frequency_penalty"):
        if _number(body, field, 0.0, -2.0, 2.0) != 0.0:
            raise _unsupported(field, "other than 0")
    if body.get("logit_bias") not in (None, {}):
        raise _unsupported("logit_bias", "")
    max_tokens = _int(body, "max_tokens", None, lo=1)
    if chat and body.get("max_completion_tokens") is not None:
        max_tokens = _int(body, "max_completion_tokens", None, lo=1)
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stop = tuple(stop)
    else:
        raise _bad("stop", "must be a string or a list of strings")
    if len(stop) > 4 or any(not s or len(s) > MAX_STOP_CHARS for s in stop):
        raise APIError(400, f"'stop' takes up to 4 non-empty strings of at most {MAX_STOP_CHARS} characters",
                       "invalid_value")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in stop_ids):
        raise _bad("stop_token_ids", "must be a list of integers")
    if len(stop_ids) > MAX_STOP_TOKEN_IDS or any(not 0 <= t <= INT64[1] for t in stop_ids):
        raise APIError(400, f"'stop_token_ids' takes up to {MAX_STOP_TOKEN_IDS} non-negative token ids",
                       "invalid_value")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise _bad("stream_options", "must be an object")
    stream = _bool(body, "stream", False)
    include_usage = _bool(opts or {}, "include_usage", False)
    if opts is not None and not stream:
        raise APIError(400, "'stream_options' is only allowed with stream: true", "invalid_value")
    return dict(model=model, max_tokens=max_tokens,
                temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
                top_k=max(0, _int(body, "top_k", 0, lo=-1)), seed=_int(body, "seed", None),
                stop=stop, stop_token_ids=tuple(stop_ids), ignore_eos=_bool(body, "ignore_eos", False),
                stream=stream, include_usage=include_usage,
                priority=_int(body, "priority", 0, lo=-(1 << 31), hi=(1 << 31) - 1))


def parse_completion(body: dict) -> GenerationRequest:
    common = _common(body, chat=False)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        pass
    elif isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompt = list(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise _unsupported("prompt", "as a batch of several prompts")
    else:
        raise _bad("prompt", "must be a string or a non-empty list of token ids")
    if body.get("suffix") not in (None, ""):
        raise _unsupported("suffix", "")
    return GenerationRequest(prompt=prompt, messages=None, **common)


def parse_chat(body: dict) -> GenerationRequest:
    common = _common(body, chat=True)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "must be a non-empty list")
    if len(messages) > MAX_MESSAGES:
        raise APIError(400, f"'messages' takes at most {MAX_MESSAGES} messages", "invalid_value")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}]", "must be an object with a 'role'")
        content = m.get("content")
        if isinstance(content, list):
            if any(not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str)
                   for p in content):
                raise _unsupported(f"messages[{i}].content", "with parts other than text")
        elif not isinstance(content, str):
            raise _bad(f"messages[{i}].content", "must be a string or a list of text parts")
        if not isinstance(m.get("name", ""), str) or len(m.get("name", "")) > MAX_MODEL_ID_CHARS:
            raise _bad(f"messages[{i}].name", f"must be a string of at most {MAX_MODEL_ID_CHARS} characters")
        if m["role"] not in ("system", "user", "assistant"):
            raise _unsupported(f"messages[{i}].role {m['role']!r}", "")
    if body.get("tools") or body.get("functions"):
        raise _unsupported("tools", "")
    return GenerationRequest(prompt=None, messages=messages, **common)
