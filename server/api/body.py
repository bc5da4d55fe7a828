"""Reading a JSON request body an attacker controls: bounded before it is parsed.

The body's size is capped while it streams in (Content-Length first, then a
running count), so an oversized body is refused before it is buffered. The
parse itself is bounded too: integer literals longer than any real field
(Python's int() is quadratic past a few thousand digits and refuses 4,300),
NaN/Infinity literals, nesting deeper than any OpenAI body, and lone UTF-16
surrogates (valid JSON escapes that no UTF-8 encoder accepts, so they would
fail later, wherever the string is encoded) are all a 400 that says which.
"""
from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

from server.api.errors import APIError

# Far deeper than any OpenAI request (chat content parts sit at depth 4) and far
# below the C parser's recursion limit, so a hostile body never recurses far.
MAX_JSON_DEPTH = 32
# A 64-bit integer has at most 20 digits; anything longer is no field we know.
MAX_INT_DIGITS = 24


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
        else:
            stack.extend((value, depth + 1) for value in node)


def parse_json(raw: bytes) -> Any:
    """Parse a bounded JSON document; every malformed input is a 400 naming the problem."""
    try:
        doc = json.loads(raw, parse_int=_parse_int, parse_constant=_parse_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(400, f"the body is not valid JSON: {e}", "invalid_json") from None
    except RecursionError:
        raise APIError(400, f"the body is nested deeper than {MAX_JSON_DEPTH} levels",
                       "invalid_json") from None
    _check_tree(doc)
    return doc


def parse_json_object(raw: bytes) -> dict:
    body = parse_json(raw)
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object", "invalid_json")
    return body


async def read_json_object(request: Request) -> dict:
    """Read (capped by the server's --max-request-bytes) and parse a JSON object body."""
    return parse_json_object(await read_capped(request, request.app.state.lp.config.max_request_bytes))
