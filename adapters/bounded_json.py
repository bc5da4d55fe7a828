"""JSON parsing for untrusted uploads: every input ends in a value or a JsonLimitError.

`json.loads` alone turns hostile input into exceptions the callers do not
expect (RecursionError for deep nesting, ValueError from Python's 4,300-digit
int limit) or into values that explode later (NaN/Infinity literals, 1e400 as
inf, lone surrogates that raise UnicodeEncodeError when the text is stored or
logged). Everything here is bounded before or while it is converted, so the
callers (adapter_config.json, the safetensors header) only have to translate
one exception into their own.
"""
from __future__ import annotations

import json
import math
from typing import Any, Callable

# adapter_config.json nests 2 levels and a safetensors header 3; 32 leaves room
# for any future field while staying far below Python's recursion limit.
MAX_DEPTH = 32
# Safetensors offsets are u64 (20 digits); no other integer a LoRA adapter
# carries is longer, so 20 digits never refuses a real file.
MAX_INT_DIGITS = 20
# Parsing costs per value, in C but holding the GIL: 16 MiB of `[[1],[1],...`
# takes seconds. Values are counted cheaply first, as the structural
# characters that separate or open them (over-counting any inside strings).
# A LoRA header has ~7 per tensor: a 126-layer model's all-projection adapter
# needs ~12,000, and a config a few hundred.
MAX_ITEMS = 250_000


class JsonLimitError(ValueError):
    """The JSON is malformed or outside the bounds above; the message says which."""


def loads_bounded(text: str | bytes, *,
                  object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None) -> Any:
    """json.loads with bounded size, depth, integer length, finite numbers and encodable strings."""
    marks = (b",", b"[", b"{") if isinstance(text, bytes) else (",", "[", "{")
    items = sum(text.count(mark) for mark in marks)
    if items > MAX_ITEMS:
        raise JsonLimitError(f"JSON with about {items} values (more than {MAX_ITEMS} are not accepted)")
    try:
        doc = json.loads(text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant,
                         object_pairs_hook=object_pairs_hook)
    except RecursionError:
        # The C scanner recurses once per level and stops at the interpreter's
        # recursion limit (~1000), long before the stack is at risk.
        raise JsonLimitError(f"JSON nested deeper than {MAX_DEPTH} levels") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise JsonLimitError(f"invalid JSON: {e}") from None
    if _deeper_than(doc, MAX_DEPTH):
        raise JsonLimitError(f"JSON nested deeper than {MAX_DEPTH} levels")
    try:
        # A lone surrogate (from a "\ud800" escape) cannot be encoded as UTF-8,
        # so storing, logging or re-serialising it would fail far from here.
        # The C encoder finds one far faster than a walk in Python.
        json.dumps(doc, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise JsonLimitError(f"a string holds a lone surrogate U+{ord(e.object[e.start]):04X} "
                             "(not encodable as UTF-8)") from None
    return doc


def _deeper_than(doc: Any, limit: int) -> bool:
    """Level by level over containers only, so the walk itself cannot recurse."""
    level = [doc] if isinstance(doc, (dict, list)) else []
    for _ in range(limit):
        if not level:
            return False
        level = [child for node in level for child in (node.values() if isinstance(node, dict) else node)
                 if isinstance(child, (dict, list))]
    return bool(level)


def _parse_int(literal: str) -> int:
    digits = len(literal.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise JsonLimitError(f"integer literal with {digits} digits (at most {MAX_INT_DIGITS} are accepted)")
    return int(literal)


def _parse_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise JsonLimitError(f"number {literal[:40]!r} is out of the float64 range")
    return value


def _parse_constant(literal: str) -> float:
    raise JsonLimitError(f"{literal} is not valid JSON (only finite numbers are accepted)")
