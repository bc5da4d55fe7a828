"""A large completions body's cost refusals decided from the raw document, before it is parsed into
values or validated (issue 35): 64 echoed token-id prompts with logprobs 20 ask for millions of
logprob entries, and parsing, checking and validating their 131,000 ids (~4.5 ms holding the GIL)
only to refuse them by counting was most of what such a request cost the front end.

msgspec reads the few fields the cost depends on and skips the prompt unbuilt (msgspec.Raw, still
checked as JSON); where the prompt is plain token ids (only digits, commas and brackets), each
prompt's length is its commas plus one, so the counts are exact. The route's own checks then run
on those lengths in the route's order (batch size, completion cap, context length, token quotas,
the logprob budget), with the same messages. Where any field is not plain (a text prompt, a
numeric string, an escape) nothing is decided here and the body takes the ordinary path. A body
refused here is refused for its cost before its other fields are validated: one that is also
wrong in another way gets this 400 and not that one.
"""
from __future__ import annotations

from typing import Annotated

import msgspec

from server.api.openai_requests import MAX_LOGPROBS, MAX_N

_TOP = Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)]
_ID_LIST_BYTES = b"0123456789,[]"
_WHITESPACE = b" \t\n\r"


class CostFields(msgspec.Struct, frozen=True):
    """What a completion's cost depends on, as validation would accept them (else no decision)."""

    prompt: msgspec.Raw = msgspec.Raw(b"")
    echo: bool = False
    logprobs: _TOP | None = None
    prompt_logprobs: _TOP | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_N)] = 1
    max_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = None


_decode = msgspec.json.Decoder(CostFields).decode


def prompt_lengths(prompt: bytes) -> list[int] | None:
    """Each prompt's length where `prompt` (valid JSON) is a token-id list or a batch of non-empty
    ones; None for anything else."""
    if prompt.translate(None, _WHITESPACE + _ID_LIST_BYTES):
        return None  # strings, floats, negatives, objects: not plain ids
    prompt = prompt.translate(None, _WHITESPACE)
    if len(prompt) < 3 or b"[]" in prompt:
        return None
    if prompt[1:2] != b"[":
        return [prompt.count(b",") + 1] if prompt.count(b"[") == 1 else None
    inner = prompt[2:-2].split(b"],[")
    if not prompt.endswith(b"]]") or prompt.count(b"[") != len(inner) + 1:
        return None  # a list nested deeper, or ids beside lists
    return [p.count(b",") + 1 for p in inner]


def cost_fields(raw: bytes | bytearray) -> tuple[CostFields, list[int]] | None:
    """The cost fields and prompt lengths of a completions body, where they are exact."""
    try:
        fields = _decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return None  # not JSON, a field not plain: the ordinary path says what is wrong
    lengths = prompt_lengths(bytes(fields.prompt))
    return None if lengths is None else (fields, lengths)
