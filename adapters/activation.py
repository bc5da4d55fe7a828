"""Activated LoRA (aLoRA): PEFT's `alora_invocation_tokens`, and where such an adapter starts applying.

PEFT 0.21 (`tuners/lora/variants.py`: `calculate_alora_offsets` and
`ALoraLinearVariant.forward`) applies an aLoRA's delta only from the *start*
of the *last* occurrence of the invocation sequence in the prompt onwards:
every prompt position before it runs as the base model, every position from
it on (the invocation tokens included) and every generated token with the
adapter. The offset is computed once, from the prompt (`generate` computes it
from its input ids; each decode step then applies the adapter to its one new
token), so an invocation that only appears in the generated text changes
nothing. A prompt without the invocation sequence runs as the base model
throughout, generated tokens included.

So the KV of the prompt before the activation point is the base model's: the
engine serves it from, and adds it to, the base model's prefix cache.
"""
from __future__ import annotations

import sys
from array import array
from typing import Any, Mapping, Sequence

FIELD = "alora_invocation_tokens"
# Real invocation sequences are a role marker or a short phrase (a few to a
# few dozen tokens); the bound keeps the per-admission search cheap
# (prompt length x this, in the worst case) and every message small.
MAX_INVOCATION_TOKENS = 128
# The activation point of a prompt that lacks the invocation sequence: no
# position reaches it, so the adapter never applies.
NOT_INVOKED = sys.maxsize
# Token ids are searched as int64 (activation_start); no vocabulary comes near this bound.
MAX_TOKEN_ID = 2**31 - 1
TOKEN_BYTES = array("q").itemsize


def invocation_config_problem(cfg: Mapping[str, Any]) -> str | None:
    """Why the config's `alora_invocation_tokens` cannot be served (types, length, the combinations
    PEFT refuses), or None. A reason, not an exception: adapters.peft_config raises it as its own."""
    tokens = cfg.get(FIELD)
    if tokens is None:
        return None
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        return f"{FIELD} must be a list of token ids (integers)"
    if not tokens:
        # PEFT serves an empty list as plain LoRA; it is far likelier a mistake than a wish.
        return f"{FIELD} is empty; give the invocation's token ids or leave the field out"
    if len(tokens) > MAX_INVOCATION_TOKENS:
        return f"{FIELD} has {len(tokens)} tokens; at most {MAX_INVOCATION_TOKENS} are served"
    if any(t < 0 or t > MAX_TOKEN_ID for t in tokens):
        return f"{FIELD} holds {next(t for t in tokens if t < 0 or t > MAX_TOKEN_ID)}, which is not a token id"
    # PEFT has no variant for these combinations: loading such an adapter raises there.
    if cfg.get("use_dora"):
        return f"{FIELD} cannot be combined with use_dora (PEFT has no such variant)"
    if cfg.get("init_lora_weights") == "mica":
        return f"{FIELD} cannot be combined with init_lora_weights='mica' (PEFT has no such variant)"
    return None


def invocation_vocab_problem(cfg: Mapping[str, Any], vocab_size: int | None) -> str | None:
    """Why an invocation token id is not one of the base model's, or None (also when vocab_size,
    the vocabulary, is not known to the caller)."""
    tokens = cfg.get(FIELD)
    if tokens is None or vocab_size is None:
        return None
    outside = [t for t in tokens if t >= vocab_size]
    if outside:
        return f"{FIELD} holds token id {outside[0]}, outside the base model's vocabulary of {vocab_size}"
    return None


def invocation_tokens(cfg: Mapping[str, Any]) -> tuple[int, ...] | None:
    """The adapter's invocation sequence (from a config checked by invocation_config_problem); None: plain LoRA."""
    tokens = cfg.get(FIELD)
    return None if tokens is None else tuple(tokens)


def activation_start(invocation: Sequence[int], prompt: Sequence[int]) -> int:
    """The first position the adapter applies to: where the last occurrence of `invocation` in
    `prompt` starts, or NOT_INVOKED when it does not occur (PEFT's `calculate_alora_offsets`).

    Searched as bytes (C's linear-time substring search; a prompt of thousands of tokens takes
    microseconds, whatever the invocation): a match must start on a token's first byte."""
    assert invocation, "an invocation sequence is never empty (invocation_config_problem)"
    needle, hay = array("q", invocation).tobytes(), array("q", prompt).tobytes()
    width = len(needle)
    end = len(hay)
    while (at := hay.rfind(needle, 0, end)) >= 0:
        if at % TOKEN_BYTES == 0:
            return at // TOKEN_BYTES
        end = at + width - 1  # a misaligned match: look for the last one starting before it
    return NOT_INVOKED
