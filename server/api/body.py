"""Reading a JSON request body an attacker controls: bounded before it is parsed.

The body's size is capped while it streams in (Content-Length first, then a
running count), so an oversized body is refused before it is buffered. The
parse itself is bounded too: integer literals longer than any real field
(Python's int() is quadratic past a few thousand digits and refuses 4,300),
NaN/Infinity literals, nesting deeper than any OpenAI body, and lone UTF-16
surrogates (valid JSON escapes that no UTF-8 encoder accepts, so they would
fail later, wherever the string is encoded) are all a 400 that says which.

The size of the document is bounded before it is built: a pre-scan (C-speed
string searches, one Python step per string literal) counts the values outside
strings and refuses a body with more than its endpoint can use (a completions
body's token ids are at most `--max-batch-prompts` x `max_model_len`), so 16 MB
of token ids is a 400 in milliseconds, not 8 million ints built and then
refused. A large body is scanned and parsed on a worker thread, never on the
event loop.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from json.decoder import scanstring
from typing import Any, TypeVar

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from server.api.errors import APIError

# Far deeper than any OpenAI request (chat content parts sit at depth 4) and far
# below the C parser's recursion limit, so a hostile body never recurses far.
MAX_JSON_DEPTH = 32
# A 64-bit integer has at most 20 digits; anything longer is no field we know.
MAX_INT_DIGITS = 24
# String literals (object keys included) in one body: 4,096 chat messages of a few fields each,
# 1,024 logit_bias keys and 64 prompts stay far below it.
MAX_STRINGS = 1 << 16
# Values besides token ids that a body may carry (messages and their fields, logit_bias, stop ids).
BASE_VALUES = 1 << 16
# Bodies up to this size are parsed on the event loop: a thread hop would cost more than the parse.
INLINE_PARSE_BYTES = 64 << 10
SCAN_WINDOW_CHARS = 1 << 20
_DIGITS_AS_ZERO = bytes.maketrans(b"0123456789", b"0" * 10)
T = TypeVar("T")
_SCALAR_TYPES = frozenset({int, float, bool, type(None)})  # JSON values with no string or nesting in them


def _too_large(cap: int) -> APIError:
    return APIError(413, f"request body larger than the limit of {cap} bytes (--max-request-bytes)",
                    "request_too_large")


async def read_capped(request: Request, cap: int) -> bytes:
    """The whole body, refusing with 413 as soon as it is known to exceed `cap` bytes."""
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isascii() or not length.isdigit() or len(length) > 19:
            raise APIError(400, "invalid Content-Length header", "invalid_request")
        if int(length) > cap:
            raise _too_large(cap)
    chunks: list[bytes] = []
    received = 0
    async for chunk in request.stream():
        received += len(chunk)
        if received > cap:
            raise _too_large(cap)
        chunks.append(chunk)
    return b"".join(chunks)


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise APIError(400, f"an integer in the body has more than {MAX_INT_DIGITS} digits",
                       "invalid_json")
    return int(text)


def _parse_constant(name: str) -> Any:
    raise APIError(400, f"{name} is not valid JSON (only finite numbers are accepted)", "invalid_json")


def _check_string(s: str) -> None:
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, "the body contains an unpaired UTF-16 surrogate (\\ud800-\\udfff) "
                                "in a string", "invalid_json") from None


def _check_tree(doc: Any) -> None:
    """Depth and string checks without recursion (the tree may be deep)."""
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            _check_string(node)
            continue
        if not isinstance(node, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise APIError(400, f"the body is nested deeper than {MAX_JSON_DEPTH} levels", "invalid_json")
        if isinstance(node, dict):
            for key, value in node.items():
                _check_string(key)
                stack.append((value, depth + 1))
        elif not set(map(type, node)) <= _SCALAR_TYPES:
            stack.extend((value, depth + 1) for value in node)
        # else: a list of numbers (token ids) has nothing below it to check; map and set run at C speed,
        # where one Python step per value cost 70% of parsing a 64-prompt token batch


def _too_many_values(cap: int, what: str) -> APIError:
    return APIError(400, f"the body has more than {cap} {what}; no request to this endpoint needs that many "
                         f"(token ids are bounded by max_model_len per prompt and --max-batch-prompts)",
                    "too_many_values")


def check_value_count(text: str, max_values: int) -> None:
    """Refuse a document with more than `max_values` values outside strings (counted by their
    separating commas) or more than MAX_STRINGS string literals, before any of them is built.
    Strings are skipped with the JSON decoder's own C scanner, so a comma inside one never counts."""
    pos, values, strings = 0, 0, 0
    while True:
        quote = text.find('"', pos)
        end = len(text) if quote < 0 else quote
        # In windows: a C call holds the GIL throughout, and 16 MB of ids is refused after the first.
        for lo in range(pos, end, SCAN_WINDOW_CHARS):
            values += text.count(",", lo, min(end, lo + SCAN_WINDOW_CHARS))
            if values > max_values:
                raise _too_many_values(max_values, "values (array elements and object members)")
        if quote < 0:
            return
        strings += 1
        if strings > MAX_STRINGS:
            raise _too_many_values(MAX_STRINGS, "strings")
        try:
            _, pos = scanstring(text, quote + 1, True)
        except json.JSONDecodeError as e:
            raise APIError(400, f"the body is not valid JSON: {e}", "invalid_json") from None


def parse_json(raw: bytes, max_values: int = BASE_VALUES) -> Any:
    """Parse a bounded JSON document; every malformed input is a 400 naming the problem."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the body is not valid JSON: {e}", "invalid_json") from None
    check_value_count(text, max_values)
    # Python's own int parsing is C-speed; the per-literal digit check only where a long digit run exists.
    long_digits = b"0" * (MAX_INT_DIGITS + 1) in raw.translate(_DIGITS_AS_ZERO)
    try:
        doc = json.loads(text, parse_int=_parse_int if long_digits else None, parse_constant=_parse_constant)
    except json.JSONDecodeError as e:
        raise APIError(400, f"the body is not valid JSON: {e}", "invalid_json") from None
    except RecursionError:
        raise APIError(400, f"the body is nested deeper than {MAX_JSON_DEPTH} levels",
                       "invalid_json") from None
    _check_tree(doc)
    return doc


def parse_json_object(raw: bytes, max_values: int = BASE_VALUES) -> dict:
    body = parse_json(raw, max_values)
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object", "invalid_json")
    return body


async def read_json_object(request: Request, max_values: int = BASE_VALUES) -> dict:
    """Read (capped by the server's --max-request-bytes) and parse a JSON object body of at most
    `max_values` values; a large body is parsed on a worker thread."""
    return await read_json_as(request, lambda body: body, max_values)


async def read_json_as(request: Request, build: Callable[[dict], T], max_values: int = BASE_VALUES) -> T:
    """read_json_object, then `build` (a model's validation) on the object where it was parsed: a large
    body's validation runs on the worker thread too, not on the event loop (64 prompts of 2,046 ids
    take ~10 ms to validate, holding the GIL, and every stream and /health waited for it)."""
    raw = await read_capped(request, request.app.state.lp.config.max_request_bytes)
    if len(raw) <= INLINE_PARSE_BYTES:
        return build(parse_json_object(raw, max_values))
    return await run_in_threadpool(lambda: build(parse_json_object(raw, max_values)))
